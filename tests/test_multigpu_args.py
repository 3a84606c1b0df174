"""The multi-GPU engine's arguments and the NCCL library lookup (ddtree.nccl): everything checked before any
device work, so no GPU is needed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import ddtree
from ddtree import nccl
from ddtree.engine import check_devices
from ddtree.errors import RequestError
from ddtree.presets import preset_config
from ddtree.shard import Shard


@pytest.mark.parametrize("devices, kwargs, message", [
    ((), {}, "devices must be a non-empty sequence"),
    ("01", {}, "devices must be a non-empty sequence"),
    (3, {}, "devices must be a non-empty sequence"),
    ((0, 0), {}, "devices must not repeat a device"),
    ((0, -1), {}, "devices must hold non-negative integers"),
    ((0, True), {}, "devices must hold non-negative integers"),
    ((0, 1.0), {}, "devices must hold non-negative integers"),
    ((0, 1), {"shard": Shard(0, 2)}, "devices and shard"),
    ((0, 1), {"all_ranks": True}, "devices and all_ranks"),
])
def test_bad_devices_name_the_argument(devices, kwargs, message) -> None:
    with pytest.raises(RequestError, match=message):
        check_devices(devices, kwargs.get("shard"), kwargs.get("all_ranks", False))


def test_good_devices_pass_through() -> None:
    assert check_devices([1, 0], None, False) == (1, 0)
    assert check_devices(None, Shard(0, 2), True) is None


def test_engine_refuses_before_device_work() -> None:
    cfg = preset_config("tiny")
    with pytest.raises(RequestError, match="devices must not repeat"):
        ddtree.Engine.random(cfg, 1, 64, devices=(1, 1))
    with pytest.raises(RequestError, match="devices and all_ranks"):
        ddtree.Engine.random(cfg, 1, 64, devices=(0, 1), all_ranks=True)
    ranks = cfg.num_attention_heads + 1  # divides no split field of the preset
    with pytest.raises(RequestError, match="ranks"):
        ddtree.Engine.random(cfg, 1, 64, devices=tuple(range(ranks)))


def test_library_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    library = tmp_path / "libnccl.so.2"
    library.write_bytes(b"")
    monkeypatch.setenv(nccl.ENV_VAR, str(library))
    assert nccl.nccl_library() == str(library)
    monkeypatch.setenv(nccl.ENV_VAR, str(tmp_path / "missing.so"))
    with pytest.raises(RequestError, match="DDTREE_NCCL_LIBRARY names .*missing.so.*not a file"):
        nccl.nccl_library()


def test_library_from_the_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The nvidia-nccl-cu13 wheel's layout: the package nvidia.nccl with lib/libnccl.so.2."""
    lib = tmp_path / "nvidia" / "nccl" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnccl.so.2").write_bytes(b"")
    monkeypatch.delenv(nccl.ENV_VAR, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    # the lookup imports the namespace package nvidia from tmp_path: drop it afterwards too, or a later lookup in
    # this process would find this empty file through the cached package
    names = ("nvidia", "nvidia.nccl")
    saved = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    try:
        assert Path(nccl.nccl_library()).resolve() == (lib / "libnccl.so.2").resolve()
    finally:
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def test_no_library_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(nccl.ENV_VAR, raising=False)
    monkeypatch.setattr(nccl, "_wheel_library", lambda: None)
    with pytest.raises(RequestError, match=r"ddtree\[multigpu\].*nvidia-nccl-cu13.*DDTREE_NCCL_LIBRARY"):
        nccl.nccl_library()


def test_runtime_loads_the_library_or_names_it(tmp_path: Path) -> None:
    """The runtime dlopens NCCL itself: a missing file is a RuntimeError naming it; the real library (when the wheel
    is installed) gives its version without a GPU."""
    native = pytest.importorskip("ddtree._native", exc_type=ImportError)
    if not hasattr(native, "kernels"):
        pytest.skip("the native module was built without CUDA")
    missing = tmp_path / "libnccl.so.2"
    with pytest.raises(RuntimeError, match=f"cannot load the NCCL library {missing}"):
        native.kernels.nccl_version(str(missing))
    try:
        library = nccl.nccl_library()
    except RequestError:
        pytest.skip("no NCCL library installed")
    assert native.kernels.nccl_version(library) >= 21000
