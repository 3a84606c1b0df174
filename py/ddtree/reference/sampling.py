"""The target's token choice, as the GPU engine makes it (kernels/sample.cu): the arg-max at temperature 0 (lowest
id on ties), else Gumbel-max, argmax(logit / T + G) with G = -log(-log(u)) and u in (0, 1) from a counter-based hash
of (seed, stream, position, token id).

The noise belongs to a position of a stream, not to a call: whichever method computes the logits at a position (an
autoregressive step or any node of a DDTree round), the token drawn there is the same. So sampled DDTree output
equals sampled autoregressive output for a seed, token for token, and its distribution is the target's. The
arithmetic is float32 as on the device; the device's logf and its fused multiply-subtract may round the last bit
differently, which moves a token only where two candidates tie to within that bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_WEYL = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 arrays (wrapping arithmetic, as on the device)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniform_from_hash(h: np.ndarray) -> np.ndarray:
    """u in (0, 1) from uint64 hashes: the top 23 bits plus a half, over 2^23. Every value, 1 - 2^-24 at most, is a
    float32 below 1, so -log(-log(u)) stays finite (24 bits would round the top one to 1.0: an infinite G that wins
    whatever the logits)."""
    return ((h >> np.uint64(41)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 8388608.0)


def gumbel_noise(seed: int, stream: int, position: int, vocab: int) -> np.ndarray:
    """G for every token id at (seed, stream, position): float32 [vocab]."""
    where = np.array([(stream << 32) | (position & 0xFFFFFFFF)], dtype=np.uint64)
    key = _mix64(np.array([seed], dtype=np.uint64) ^ _mix64(where))
    h = _mix64(key + np.arange(vocab, dtype=np.uint64) * _WEYL)
    return -np.log(-np.log(uniform_from_hash(h)))


def target_choices(logits: np.ndarray, temperature: float, seed: int, stream: int,
                   positions: Sequence[int] | np.ndarray) -> np.ndarray:
    """The token chosen from each row of `logits` [rows, vocab], row i computed at `positions[i]` of `stream`:
    int64 [rows]. NaN never wins; a row whose logits are all NaN or -inf gives token 0 (as the device does)."""
    logits = np.asarray(logits, dtype=np.float32)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {logits.shape}")
    positions = np.asarray(positions, dtype=np.int64)
    if positions.shape != (logits.shape[0],):
        raise ValueError(f"positions must hold one position per row ({logits.shape[0]}), got {positions.shape}")
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if temperature > 0:
        inv_t = np.float32(1.0) / np.float32(temperature)
        noise = np.stack([gumbel_noise(seed, stream, int(p), logits.shape[1]) for p in positions])
        values = logits * inv_t + noise
    else:
        values = logits
    values = np.where(np.isnan(values), np.float32(-np.inf), values)
    choices = np.argmax(values, axis=1)
    return np.where(np.isneginf(values[np.arange(len(values)), choices]), 0, choices).astype(np.int64)
