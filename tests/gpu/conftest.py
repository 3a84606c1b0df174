"""tests/gpu needs the native module, a CUDA device and torch with CUDA; without them every test here is skipped with
the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtree.device import device_info, native_unavailable
from engine_models import make_model_dirs


def _skip_reason() -> str | None:
    missing = native_unavailable()
    if missing is not None:
        return missing
    info = device_info()
    if not info.devices:
        return f"needs a CUDA device: {info}"
    try:
        import torch
    except ImportError:
        return "needs torch as the external reference"
    if not torch.cuda.is_available():
        return "needs a CUDA build of torch as the external reference"
    return None


_REASON = _skip_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if _REASON is not None:
                item.add_marker(pytest.mark.skip(reason=_REASON))


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints of the presets and variants the engine tests run on (engine_models), written once."""
    return make_model_dirs(tmp_path_factory)
