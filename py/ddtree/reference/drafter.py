"""numpy DFlash drafter forward (float32): one block-diffusion step per DDTree round.

Per round the drafter sees
- the context: the concatenated tapped target hidden states of the tokens committed since its last call, at
  their absolute positions ``[start - a, start)``; ``fc`` + ``hidden_norm`` project them to hidden size and every
  layer turns them into K/V with its own ``k_proj``/``v_proj`` (and ``k_norm``, RoPE). These rows are appended
  to the draft KV cache, which (without a window) holds exactly one row per committed token;
- the block ``[bonus, MASK x (B - 1)]`` at positions ``[start, start + B)``, embedded with the target's
  embedding. Block queries attend to every cached context row and bidirectionally to the whole block (no
  mask); block K/V are used in this call only and never cached.
An optional context window W (serving stacks run this drafter with W = 4096 on long prompts) limits the cache to
the last W committed rows: block queries then see rows ``[max(start - W, 0), start)`` only, still at their absolute
positions, and the cache never holds more than W rows per layer.
RoPE is plain or YaRN over the whole head_dim, in the rotate-half layout, with the amplitude
DrafterConfig.rope_attention_factor (ddtree.drafter says why it is not the target's).
The final-normed block hidden states at positions 1..B-1 go through the target's LM head: B - 1 per-depth
logits, the distribution of the token at depth d = 1..B-1 below the bonus.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddtree import bf16
from ddtree.drafter import DrafterConfig, drafter_tensor_specs, open_drafter
from ddtree.errors import CheckpointError, RequestError
from ddtree.reference.layers import linear, rms_norm, softmax, swiglu_mlp
from ddtree.reference.model import ReferenceModel
from ddtree.reference.rope import Rope


@dataclass
class DraftCache:
    """Per-layer K (after k_norm and RoPE) and V rows [rows, kv_heads, head_dim] of the committed context.
    ``length`` tokens are committed; the rows held are those of positions ``[length - rows, length)``: all of
    them, or with a ``window`` the last ``min(window, length)``."""

    keys: list[np.ndarray]
    values: list[np.ndarray]
    length: int = 0
    window: int | None = None


class ReferenceDrafter:
    """The DFlash drafter in float32. ``weights`` hold the drafter's tensors (bf16 bits or float32);
    ``embed_tokens`` and ``lm_head`` [vocab, hidden] are the target's."""

    def __init__(self, config: DrafterConfig, weights: Mapping[str, np.ndarray], embed_tokens: np.ndarray,
                 lm_head: np.ndarray) -> None:
        self.config = config
        specs = drafter_tensor_specs(config)
        for name, spec in specs.items():
            if name not in weights:
                raise CheckpointError(f"drafter weight '{name}' is missing")
            if tuple(np.shape(weights[name])) != spec.shape:
                raise CheckpointError(f"drafter weight '{name}' has shape {list(np.shape(weights[name]))}, "
                                 f"expected {list(spec.shape)}")
        for name, table in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if tuple(np.shape(table)) != (config.vocab_size, config.hidden_size):
                raise CheckpointError(f"target {name} has shape {list(np.shape(table))}, "
                                 f"expected {[config.vocab_size, config.hidden_size]}")
        self.weights = {name: bf16.as_float32(weights[name]) for name in specs}
        self.embed_tokens = np.asarray(embed_tokens)  # rows are widened when used: the table is vocab x hidden
        self.lm_head = bf16.as_float32(lm_head)
        self.rope = Rope.from_drafter_config(config)

    @classmethod
    def for_model(cls, drafter_dir: str | Path, model: ReferenceModel) -> ReferenceDrafter:
        """Open a drafter checkpoint, validated against its target's config, sharing the target model's
        embedding table and float32 LM head (the target checkpoint is not opened again)."""
        config, weights = open_drafter(drafter_dir, model.config)
        return cls(config, weights, model.embedding_table(), model.lm_head())

    def new_cache(self, window: int | None = None) -> DraftCache:
        """An empty draft cache; ``window`` (None: unbounded) keeps only the last ``window`` committed rows."""
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise RequestError(f"window must be a positive integer or None, got {window!r}")
        c = self.config
        empty = np.zeros((0, c.num_key_value_heads, c.head_dim), dtype=np.float32)
        return DraftCache([empty] * c.num_hidden_layers, [empty] * c.num_hidden_layers, window=window)

    def _kv(self, layer: str, x: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        c, w = self.config, self.weights
        k = linear(x, w[f"{layer}.self_attn.k_proj.weight"]).reshape(-1, c.num_key_value_heads, c.head_dim)
        v = linear(x, w[f"{layer}.self_attn.v_proj.weight"]).reshape(-1, c.num_key_value_heads, c.head_dim)
        k = rms_norm(k, w[f"{layer}.self_attn.k_norm.weight"], c.rms_norm_eps)
        return self.rope.apply(k, *self.rope.cos_sin(positions)), v

    def draft(self, cache: DraftCache, context: np.ndarray, bonus_token: int, start: int) -> np.ndarray:
        """Append the context rows (committed tokens ``[start - a, start)``) to ``cache`` (dropping rows that
        fall out of its window) and return the float32 [B - 1, vocab] logits of depths 1..B-1 below
        ``bonus_token`` (the token at position ``start``)."""
        c, w = self.config, self.weights
        context = np.asarray(context, dtype=np.float32)
        if context.ndim != 2 or context.shape[1] != c.context_width:
            raise RequestError(f"context must be [rows, {c.context_width}], got shape {context.shape}")
        rows = context.shape[0]
        if cache.length + rows != start:
            raise RequestError(f"draft cache has {cache.length} committed rows and {rows} context rows arrive, "
                             f"but the block starts at position {start}")
        if not 0 <= bonus_token < c.vocab_size:
            raise RequestError(f"bonus_token {bonus_token} is outside the vocabulary of {c.vocab_size}")
        # Rows are projected independently, so rows already outside the window need not be projected at all.
        kept = rows if cache.window is None else min(rows, cache.window)
        oldest = None if cache.window is None else -cache.window  # slice start of the rows the cache keeps
        ctx_positions = np.arange(start - kept, start)
        block_positions = np.arange(start, start + c.block_size)
        ctx = rms_norm(linear(context[rows - kept:], w["fc.weight"]), w["hidden_norm.weight"], c.rms_norm_eps)
        ids = np.full(c.block_size, c.mask_token_id, dtype=np.int64)
        ids[0] = bonus_token
        x = bf16.as_float32(self.embed_tokens[ids])
        q_cos, q_sin = self.rope.cos_sin(block_positions)
        group = c.num_attention_heads // c.num_key_value_heads
        for i in range(c.num_hidden_layers):
            layer = f"layers.{i}"
            h = rms_norm(x, w[f"{layer}.input_layernorm.weight"], c.rms_norm_eps)
            q = linear(h, w[f"{layer}.self_attn.q_proj.weight"]).reshape(-1, c.num_attention_heads, c.head_dim)
            q = self.rope.apply(rms_norm(q, w[f"{layer}.self_attn.q_norm.weight"], c.rms_norm_eps), q_cos, q_sin)
            k_ctx, v_ctx = self._kv(layer, ctx, ctx_positions)
            cache.keys[i] = np.concatenate([cache.keys[i], k_ctx])[oldest:]
            cache.values[i] = np.concatenate([cache.values[i], v_ctx])[oldest:]
            k_blk, v_blk = self._kv(layer, h, block_positions)
            keys = np.repeat(np.concatenate([cache.keys[i], k_blk]), group, axis=1)  # [keys, heads, hd]
            values = np.repeat(np.concatenate([cache.values[i], v_blk]), group, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, keys) * np.float32(c.head_dim**-0.5)
            attn = np.einsum("hqk,khd->qhd", softmax(scores), values).reshape(c.block_size, -1)
            x = x + linear(attn, w[f"{layer}.self_attn.o_proj.weight"])
            h = rms_norm(x, w[f"{layer}.post_attention_layernorm.weight"], c.rms_norm_eps)
            x = x + swiglu_mlp(h, w[f"{layer}.mlp.gate_proj.weight"], w[f"{layer}.mlp.up_proj.weight"],
                               w[f"{layer}.mlp.down_proj.weight"])
        cache.length = start
        out = rms_norm(x[1:], w["norm.weight"], c.rms_norm_eps)
        return linear(out, self.lm_head).astype(np.float32)


def draft_top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-depth top-k of log-softmax(logits) (temperature 1): float32 log-probs sorted descending, ties by
    ascending token id, and their int64 token ids. ``k`` is capped at the vocabulary size."""
    logits = np.asarray(logits, dtype=np.float32)
    k = min(int(k), logits.shape[1])
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    order = np.lexsort((np.broadcast_to(np.arange(logits.shape[1]), logits.shape), -log_probs), axis=1)[:, :k]
    return np.take_along_axis(log_probs, order, axis=1).astype(np.float32), order.astype(np.int64)
