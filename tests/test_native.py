"""The native module imports and reports itself on any machine, GPU or not (skipped, with the reason, in a build
without the CUDA toolkit)."""

import pytest

import ddtree
from ddtree.limits import MAX_STOP_IDS, MAX_TREE_BUDGET

native = pytest.importorskip("ddtree._native", exc_type=ImportError)
kernels = native.kernels


def test_native_module_imports_without_gpu() -> None:
    assert native.cuda_runtime_version() >= 12000
    assert "90a" in native.gpu_archs.split(",")


def test_runtime_and_python_share_the_tree_budget_limit() -> None:
    """The runtime sizes its tree buffers by kTreeMaxBudget; the Python checks refuse by MAX_TREE_BUDGET."""
    assert native.MAX_BUDGET == MAX_TREE_BUDGET
    assert native.MAX_STOP_IDS == MAX_STOP_IDS


def test_device_info_describes_itself() -> None:
    info = ddtree.device_info()
    text = str(info)
    if info.devices:
        assert "SMs" in text
    else:
        assert text.startswith("no CUDA device is present")


def test_attention_workspace_holds_the_most_chunks_under_the_bound() -> None:
    """Rows of up to 4096 keys have 512-key chunks, longer rows 1024-key ones, so a bound of 5000 keys must still
    hold the 8 chunks of a 4096-key row although a 5000-key row has 5."""
    per_chunk = 64 * (512 + 2)  # fp32 output plus (max, sum) per head

    def floats(max_len: int) -> int:
        return kernels.mla_workspace_floats(64, 512, 64, 1, max_len)

    assert floats(4096) == 8 * per_chunk
    assert floats(5000) == 8 * per_chunk
    assert floats(8192) == 8 * per_chunk
    assert floats(8193) == 9 * per_chunk
    assert kernels.mla_workspace_floats(64, 512, 64, 3, 600) == 3 * 2 * per_chunk
