"""Rotary position embedding with DeepSeek's YaRN extension, computed as HF transformers does.

- inv_freq over the rope dims d = qk_rope_head_dim: theta^(-2i/d) for i < d/2. Under YaRN each frequency blends
  the extrapolated value and the interpolated value (divided by `factor`) with a linear ramp between the
  correction dims of beta_fast and beta_slow rotations over original_max_position_embeddings (floored/ceiled,
  clamped to [0, d-1]).
- cos and sin are multiplied by the attention factor mscale(factor, mscale) / mscale(factor, mscale_all_dim)
  when both are non-zero, else mscale(factor, 1). (The softmax scale correction is separate:
  ModelConfig.softmax_scale.)
- Angles are position * inv_freq in float32, as a GPU kernel computes them.
- Interleaved layout (rope_interleave, DeepSeek checkpoints): dims (2i, 2i+1) form pair i. Otherwise
  (rotate-half layout) dims (i, i + d/2) do. The rotated pair is written back to the same two dims. HF's
  interleaved path writes the rotated pairs de-interleaved instead; the permutation is the same for queries and
  keys, so every q.k product, and hence the model, is identical.
The DFlash drafter uses the same frequencies over its whole head_dim in the rotate-half layout, with its own
attention factor (DrafterConfig.rope_attention_factor; ddtree.drafter._parse_rope says why it differs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ddtree.config import ModelConfig, yarn_mscale
from ddtree.drafter import DrafterConfig


def rope_inv_freq(theta: float, dim: int) -> np.ndarray:
    """Plain RoPE frequencies theta^(-2i/dim), i < dim/2, in float64."""
    return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def yarn_inv_freq(theta: float, dim: int, factor: float, beta_fast: float, beta_slow: float,
                  original_max: int) -> np.ndarray:
    """YaRN frequencies in float64: each plain frequency blended between itself (extrapolation) and itself
    divided by `factor` (interpolation), the interpolation weight ramping linearly from 0 to 1 over the
    correction dims of beta_fast .. beta_slow rotations."""
    inv_freq = rope_inv_freq(theta, dim)
    low, high = _yarn_correction_range(beta_fast, beta_slow, dim, theta, original_max)
    if low == high:
        high += 0.001  # as HF: avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation_weight = 1.0 - ramp
    return inv_freq / factor * ramp + inv_freq * extrapolation_weight


@dataclass(frozen=True)
class Rope:
    inv_freq: np.ndarray  # float32 [d / 2]
    attention_factor: float
    interleave: bool

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> Rope:
        dim, r = cfg.qk_rope_head_dim, cfg.rope
        inv_freq = rope_inv_freq(r.theta, dim)
        attention_factor = 1.0
        if r.kind == "yarn":
            inv_freq = yarn_inv_freq(r.theta, dim, r.factor, r.beta_fast, r.beta_slow,
                                     r.original_max_position_embeddings)
            if r.mscale and r.mscale_all_dim:
                attention_factor = yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim)
            else:
                attention_factor = yarn_mscale(r.factor, 1.0)
        return cls(inv_freq.astype(np.float32), attention_factor, cfg.rope_interleave)

    @classmethod
    def from_drafter_config(cls, cfg: DrafterConfig) -> Rope:
        """The DFlash drafter's RoPE: over the whole head_dim, rotate-half layout, its own amplitude."""
        r = cfg.rope
        inv_freq = rope_inv_freq(r.theta, cfg.head_dim) if r.kind != "yarn" else yarn_inv_freq(
            r.theta, cfg.head_dim, r.factor, r.beta_fast, r.beta_slow, r.original_max_position_embeddings)
        return cls(inv_freq.astype(np.float32), cfg.rope_attention_factor, interleave=False)

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[n, d / 2] cos and sin of each position's angles, times the attention factor."""
        angles = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]
        factor = np.float32(self.attention_factor)
        return np.cos(angles) * factor, np.sin(angles) * factor

    def apply(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Rotate x [n, ..., d] by the per-token cos/sin [n, d / 2] (broadcast over middle axes)."""
        shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
        cos, sin = cos.reshape(shape), sin.reshape(shape)
        half = x.shape[-1] // 2
        first, second = (x[..., 0::2], x[..., 1::2]) if self.interleave else (x[..., :half], x[..., half:])
        out = np.empty_like(x)
        if self.interleave:
            out[..., 0::2] = first * cos - second * sin
            out[..., 1::2] = second * cos + first * sin
        else:
            out[..., :half] = first * cos - second * sin
            out[..., half:] = second * cos + first * sin
        return out


def _yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, theta: float,
                           original_max: int) -> tuple[float, float]:
    """Dims whose wavelength completes beta_fast (low) .. beta_slow (high) rotations over the original context."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = math.floor(correction_dim(beta_fast))
    high = math.ceil(correction_dim(beta_slow))
    return max(low, 0), min(high, dim - 1)
