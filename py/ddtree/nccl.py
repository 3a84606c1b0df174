"""Where the NCCL library is, for a target split over several GPUs (ddtree.Engine(devices=...)).

The runtime loads NCCL itself, at run time (runtime/nccl_library.h), so that ddtree imports and runs on one GPU
without it; this module only finds the file: the DDTREE_NCCL_LIBRARY environment variable when set, else the
`libnccl.so.2` of an nvidia-nccl wheel (the Python package nvidia.nccl, under its lib/ folder: the cu13 wheel
that `pip install 'ddtree[multigpu]'` brings, or a cu12 one another package brought; the few entry points the
runtime uses keep their ABI across NCCL 2.x).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ddtree.errors import RequestError

ENV_VAR = "DDTREE_NCCL_LIBRARY"
WHEEL = "nvidia-nccl-cu13"
LIBRARY_NAME = "libnccl.so.2"


def _wheel_library() -> Path | None:
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):  # no nvidia namespace package at all
        return None
    if spec is None:
        return None
    for folder in spec.submodule_search_locations or ():
        candidate = Path(folder) / "lib" / LIBRARY_NAME
        if candidate.is_file():
            return candidate
    return None


def nccl_library() -> str:
    """The path of the NCCL library the runtime is to load; RequestError saying how to get one when there is
    none."""
    configured = os.environ.get(ENV_VAR)
    if configured:
        if not Path(configured).is_file():
            raise RequestError(f"{ENV_VAR} names {configured!r}, which is not a file: point it at a "
                               f"{LIBRARY_NAME}, or unset it to use the {WHEEL} wheel's")
        return configured
    found = _wheel_library()
    if found is None:
        raise RequestError(f"devices: several GPUs need NCCL, and none was found: pip install 'ddtree[multigpu]' "
                           f"(the {WHEEL} wheel), or set {ENV_VAR} to the path of a {LIBRARY_NAME}")
    return str(found)


__all__ = ["ENV_VAR", "nccl_library"]
