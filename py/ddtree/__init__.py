"""ddtree: a native C++/CUDA engine for DDTree speculative decoding of Kimi-K2-class MoE models."""

from typing import Any

from ddtree.device import DeviceInfo, device_info

__all__ = ["DeviceInfo", "Engine", "device_info"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Engine is imported on first use, so `import ddtree` never needs a GPU or the native module.
    if name == "Engine":
        from ddtree.engine import Engine

        return Engine
    raise AttributeError(f"module 'ddtree' has no attribute {name!r}")
