"""Multi-head latent attention (MLA) and its KV cache in latent form.

The cache holds, per layer and token, the normalised KV latent [kv_lora_rank] and the rotated shared rope key
[qk_rope_head_dim]. Keys and values of every head are re-expanded from the latent through kv_b_proj at each
step (the "naive" form; the absorbed form of fast kernels is algebraically the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ddtree.config import LORA_NORM_EPS, ModelConfig
from ddtree.errors import RequestError
from ddtree.reference.layers import linear, rms_norm, softmax
from ddtree.reference.rope import Rope
from ddtree.reference.tree import commit_rows


@dataclass
class LayerKV:
    latent: np.ndarray  # float32 [T, kv_lora_rank], after kv_a_layernorm
    k_rope: np.ndarray  # float32 [T, qk_rope_head_dim], after RoPE


class KVCache:
    """Per-layer latent KV rows of the tokens seen so far; row t belongs to the t-th token fed."""

    def __init__(self, num_layers: int, kv_lora_rank: int, rope_dim: int) -> None:
        self.layers = [LayerKV(np.zeros((0, kv_lora_rank), np.float32), np.zeros((0, rope_dim), np.float32))
                       for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].latent.shape[0]

    def truncate(self, length: int) -> None:
        """Drop every row at index >= length."""
        if not 0 <= length <= self.length:
            raise RequestError(f"truncate: length {length} is outside [0, {self.length}]")
        for layer in self.layers:
            layer.latent, layer.k_rope = layer.latent[:length], layer.k_rope[:length]

    def compact(self, start: int, keep: Sequence[int]) -> None:
        """Move rows start + keep[i] -> start + i (all reads before any write), then truncate to start + len(keep).

        This is DDTree's commit: `keep` lists the accepted tree nodes' offsets from `start`.
        """
        keep = np.asarray(keep, dtype=np.int64).reshape(-1)
        if not 0 <= start <= self.length:
            raise RequestError(f"compact: start {start} is outside [0, {self.length}]")
        bad = np.flatnonzero((keep < 0) | (start + keep >= self.length))
        if bad.size:
            raise RequestError(f"compact: keep[{bad[0]}] = {keep[bad[0]]} is outside [0, {self.length - start})")
        for layer in self.layers:
            commit_rows(layer.latent, start, keep)
            commit_rows(layer.k_rope, start, keep)
        self.truncate(start + keep.size)

    def append(self, layer: int, latent: np.ndarray, k_rope: np.ndarray) -> LayerKV:
        kv = self.layers[layer]
        kv.latent = np.concatenate([kv.latent, latent])
        kv.k_rope = np.concatenate([kv.k_rope, k_rope])
        return kv


@dataclass(frozen=True)
class AttentionWeights:
    q_a_proj: np.ndarray
    q_a_layernorm: np.ndarray
    q_b_proj: np.ndarray
    kv_a_proj_with_mqa: np.ndarray
    kv_a_layernorm: np.ndarray
    kv_b_proj: np.ndarray
    o_proj: np.ndarray


def mla_attention(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, allowed: np.ndarray, w: AttentionWeights,
                  cache: KVCache, layer: int, cfg: ModelConfig, rope: Rope) -> np.ndarray:
    """Attention output [n, hidden] of n new tokens x [n, hidden] (already input-normed).

    The new tokens' latent rows are appended to the cache first; `allowed` [n, T] (T = cache rows after the
    append) says which rows each new token attends to.
    """
    q_latent, kv = mla_compress(x, cos, sin, w, cache, layer, cfg, rope)
    return mla_heads(q_latent, kv, cos, sin, allowed, w.q_b_proj, w.kv_b_proj, w.o_proj, cfg, rope)


def mla_compress(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, w: AttentionWeights, cache: KVCache, layer: int,
                 cfg: ModelConfig, rope: Rope) -> tuple[np.ndarray, LayerKV]:
    """The part every head shares: the normed query latent [n, q_lora_rank], and the layer's cache after the new
    tokens' latent rows are appended."""
    rank = cfg.kv_lora_rank
    q_latent = rms_norm(linear(x, w.q_a_proj), w.q_a_layernorm, LORA_NORM_EPS)
    compressed = linear(x, w.kv_a_proj_with_mqa)
    latent = rms_norm(compressed[:, :rank], w.kv_a_layernorm, LORA_NORM_EPS)
    k_rope_new = rope.apply(compressed[:, rank:], cos, sin)
    return q_latent, cache.append(layer, latent, k_rope_new)


def mla_heads(q_latent: np.ndarray, kv: LayerKV, cos: np.ndarray, sin: np.ndarray, allowed: np.ndarray,
              q_b_proj: np.ndarray, kv_b_proj: np.ndarray, o_proj: np.ndarray, cfg: ModelConfig,
              rope: Rope) -> np.ndarray:
    """The heads whose rows q_b_proj and kv_b_proj hold (and o_proj's columns): their o_proj output [n, hidden]. On
    several GPUs each holds some heads, and this is its partial sum."""
    nope, rope_dim, v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    n, heads = q_latent.shape[0], q_b_proj.shape[0] // (nope + rope_dim)
    q = linear(q_latent, q_b_proj).reshape(n, heads, nope + rope_dim)
    q_nope, q_rope = q[..., :nope], rope.apply(q[..., nope:], cos, sin)

    total = kv.latent.shape[0]
    expanded = linear(kv.latent, kv_b_proj).reshape(total, heads, nope + v_dim)
    k_nope, values = expanded[..., :nope], expanded[..., nope:]

    scores = np.einsum("nhd,thd->hnt", q_nope, k_nope) + np.einsum("nhd,td->hnt", q_rope, kv.k_rope)
    scores = np.where(allowed[None], scores * np.float32(cfg.softmax_scale), -np.inf).astype(np.float32)
    probs = softmax(scores)
    out = np.einsum("hnt,thd->nhd", probs, values).reshape(n, heads * v_dim)
    return linear(out, o_proj)
