"""Exceptions and warnings raised at ddtree's boundaries, and the token-id check that the engine and the reference
share. Each message names the file, tensor, field or argument at fault."""

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


class DeviceError(DDTreeError, RuntimeError):
    """A command that runs the GPU engine was started where there is no CUDA device (or no native module)."""


class NonFiniteError(DDTreeError, ArithmeticError):
    """A forward pass produced NaN or infinite logits: the weights or config.json hold values that overflow."""


class CheckpointWarning(UserWarning):
    """A checkpoint holds tensors that ddtree does not know and ignores."""


def printable(text: str) -> str:
    """`text` with its control characters escaped: names read from files (tensor names, index entries, config
    keys) may hold newlines, and a message must stay one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def check_token_ids(ids: Sequence[int] | np.ndarray, vocab_size: int, name: str | None = None) -> np.ndarray:
    """A non-empty 1-D int64 array of ids in [0, vocab); else RequestError naming the first bad id and position
    (after `name`, the argument, when given)."""
    where = f"{name}: " if name else ""
    try:
        array = np.asarray(ids)
    except ValueError:  # ragged nesting
        raise RequestError(f"{where}token ids must be a flat sequence of integers") from None
    if array.ndim != 1 or array.size == 0:
        raise RequestError(f"{where}token ids must be a non-empty 1-D sequence, got shape {list(array.shape)}")
    if array.dtype == object:  # Python ints beyond 64 bits (or mixed types) are kept as objects
        values = array.tolist()
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
            raise RequestError(f"{where}token ids must be integers, got {values!r:.80}")
        bad = np.flatnonzero([not 0 <= v < vocab_size for v in values])
    elif np.issubdtype(array.dtype, np.integer):
        bad = np.flatnonzero((array < 0) | (array >= vocab_size))
    else:
        raise RequestError(f"{where}token ids must be integers, got dtype {array.dtype}")
    if bad.size:
        raise RequestError(f"{where}token id {array[bad[0]]} at position {bad[0]} is outside the vocabulary "
                           f"[0, {vocab_size})")
    return array.astype(np.int64)
