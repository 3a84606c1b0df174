"""compressed-tensors pack-quantized INT4 (symmetric, group 32): quantize, pack, unpack, dequantize.

Layout of one quantized Linear with weight w [out, in]:
- ``weight_scale`` bf16 [out, in / group]: one scale per `group` consecutive inputs.
- codes q = clip(round(w / scale), -8, 7) (round half to even), stored with a +8 offset as nibbles 0..15.
- ``weight_packed`` int32 [out, in / 8]: nibble i (bits 4i..4i+3, LSB first) of word j holds input 8j + i.
- ``weight_shape`` int32 [2] = [out, in].
Dequantization is ``(nibble - 8) * scale`` in float32.
"""

from __future__ import annotations

import numpy as np

from ddtree import bf16

NIBBLES_PER_WORD = 8
CODE_OFFSET = 8  # 1 << (bits - 1)
MAX_CODE = 7  # symmetric absmax scaling maps the largest |w| of a group to +-7


def absmax_scales(w: np.ndarray, group_size: int) -> np.ndarray:
    """Per-group scale absmax / 7 as bf16 bits [out, in / group]; an all-zero group gets scale 1."""
    groups = w.reshape(w.shape[0], -1, group_size)
    absmax = np.abs(groups).max(axis=-1)
    return bf16.from_float32(np.where(absmax > 0, absmax / MAX_CODE, 1.0).astype(np.float32))


def quantize(w: np.ndarray, scale_bits: np.ndarray, group_size: int) -> np.ndarray:
    """Signed codes in [-8, 7] (int8) of float32 weights w [out, in] under the given bf16 group scales."""
    scale = np.repeat(bf16.to_float32(scale_bits), group_size, axis=1)
    return np.clip(np.rint(w / scale), -CODE_OFFSET, MAX_CODE).astype(np.int8)


def pack(codes: np.ndarray) -> np.ndarray:
    """Signed codes [out, in] -> weight_packed int32 [out, in / 8] (+8 offset, LSB-first along in)."""
    nibbles = (codes.astype(np.int32) + CODE_OFFSET).astype(np.uint32)
    nibbles = nibbles.reshape(codes.shape[0], -1, NIBBLES_PER_WORD)
    shifts = np.arange(NIBBLES_PER_WORD, dtype=np.uint32) * 4
    return np.bitwise_or.reduce(nibbles << shifts, axis=-1).view(np.int32)


def unpack(packed: np.ndarray) -> np.ndarray:
    """weight_packed int32 [out, in / 8] -> signed codes int8 [out, in]."""
    words = np.asarray(packed).view(np.uint32)
    shifts = np.arange(NIBBLES_PER_WORD, dtype=np.uint32) * 4
    nibbles = (words[..., None] >> shifts) & 0xF
    return (nibbles.astype(np.int8) - CODE_OFFSET).reshape(words.shape[0], -1)


def dequantize(packed: np.ndarray, scale_bits: np.ndarray) -> np.ndarray:
    """float32 weight [out, in] = (nibble - 8) * scale."""
    codes = unpack(packed)
    group_size = codes.shape[1] // scale_bits.shape[1]
    scale = np.repeat(bf16.to_float32(scale_bits), group_size, axis=1)
    return codes.astype(np.float32) * scale


def quantize_linear(w: np.ndarray, group_size: int) -> dict[str, np.ndarray]:
    """The three compressed-tensors tensors of one Linear quantized from float32 weights w [out, in]."""
    scale_bits = absmax_scales(w, group_size)
    return {
        "weight_packed": pack(quantize(w, scale_bits, group_size)),
        "weight_scale": scale_bits,
        "weight_shape": np.array(w.shape, dtype=np.int32),
    }
