"""The native module imports and reports itself on any machine, GPU or not."""

import ddtree
import ddtree._native as native


def test_native_module_imports_without_gpu() -> None:
    assert native.cuda_runtime_version() >= 12000
    assert "90a" in native.gpu_archs.split(",")


def test_device_info_describes_itself() -> None:
    info = ddtree.device_info()
    text = str(info)
    if info.devices:
        assert "SMs" in text
    else:
        assert text.startswith("no CUDA device is present")
