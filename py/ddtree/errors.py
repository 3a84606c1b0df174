"""Exceptions raised at ddtree's boundaries, and the token-id check that the engine and the reference share. Each
message names the file, tensor, field or argument at fault."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class DDTreeError(Exception):
    """Base class of every error ddtree raises on bad input."""


class ConfigError(DDTreeError, ValueError):
    """A config.json field is missing, malformed or unsupported."""


class CheckpointError(DDTreeError, ValueError):
    """A checkpoint file or tensor is missing, truncated, or of the wrong dtype or shape."""


class RequestError(DDTreeError, ValueError):
    """A generation request is invalid (prompt ids, lengths, stream counts)."""


def check_token_ids(ids: Sequence[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    """A non-empty 1-D int64 array of ids in [0, vocab); else RequestError naming the first bad id and position."""
    array = np.asarray(ids)
    if array.ndim != 1 or array.size == 0:
        raise RequestError(f"token ids must be a non-empty 1-D sequence, got shape {list(array.shape)}")
    if not np.issubdtype(array.dtype, np.integer):
        raise RequestError(f"token ids must be integers, got dtype {array.dtype}")
    bad = np.flatnonzero((array < 0) | (array >= vocab_size))
    if bad.size:
        raise RequestError(f"token id {array[bad[0]]} at position {bad[0]} is outside the vocabulary "
                           f"[0, {vocab_size})")
    return array.astype(np.int64)
