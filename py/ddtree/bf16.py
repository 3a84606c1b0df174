"""bfloat16 on the host, carried as uint16 bit patterns (numpy has no bfloat16 dtype)."""

from __future__ import annotations

import numpy as np


def to_float32(bits: np.ndarray) -> np.ndarray:
    """Exact widening of bf16 bit patterns to float32."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def as_float32(array: np.ndarray) -> np.ndarray:
    """A tensor as float32: bf16 bit patterns (uint16) widened exactly, anything else converted (no copy when it
    is float32 already)."""
    array = np.asarray(array)
    return to_float32(array) if array.dtype == np.uint16 else array.astype(np.float32, copy=False)


def from_float32(values: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bf16 (ties to even), as bit patterns; NaN stays NaN."""
    f = np.ascontiguousarray(values, dtype=np.float32)
    u = f.view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(0x7FC0), rounded)


def round_float32(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 precision (the value a bf16 store would keep)."""
    return to_float32(from_float32(values))
