"""ddtree: a native C++/CUDA engine for DDTree speculative decoding of Kimi-K2-class MoE models."""

from ddtree.device import DeviceInfo, device_info

__all__ = ["DeviceInfo", "device_info"]
__version__ = "0.1.0"
