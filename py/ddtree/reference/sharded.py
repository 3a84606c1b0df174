"""The target's forward split over G ranks, in numpy: the specification of the engine on several GPUs.

Every rank computes the replicated parts (norms, the LoRA down-projections, the router) and its own share of the
rest (ddtree.shard): its heads' attention and o_proj, its columns of the dense MLP or of the shared expert, its
routed experts, its vocabulary slice of the LM head. Each attention and each MLP ends with one partial sum
[rows, hidden] per rank (a MoE layer's as two terms: shared expert, then routed experts), which every rank adds in
rank order (`rank_order_sum`): the all-gather-then-sum that keeps a row's result independent of the batch and of
the collective's algorithm. The LM head ends with each rank's best (value, id) over its slice, combined by
`pick_across_ranks`. The cache holds every head's latent rows on every rank (MLA's latent is shared by the heads),
so one KVCache serves all ranks here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ddtree.reference.layers import linear, rms_norm, swiglu_mlp
from ddtree.reference.mla import KVCache, mla_compress, mla_heads
from ddtree.reference.model import ReferenceModel, _check_positions, _check_visible
from ddtree.reference.moe import moe, route
from ddtree.reference.sampling import gumbel_noise
from ddtree.errors import check_token_ids
from ddtree.shard import Shard, ShardLayout, shard_layout, shard_tensor


def rank_order_sum(partials: Sequence[Sequence[np.ndarray]]) -> np.ndarray:
    """sum over ranks r = 0..G-1, then over r's terms in order, of partials[r][t], in float32, in that order."""
    total = np.zeros_like(partials[0][0], dtype=np.float32)
    for terms in partials:
        for term in terms:
            total = total + term
    return total


def rank_candidates(logits: np.ndarray, first_token: int, temperature: float, seed: int, stream: int,
                    positions: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One rank's best (value, global id) per row of its vocabulary slice `logits` [rows, slice], whose first
    column is token `first_token`: the arg-max at temperature 0, else of logit / T + Gumbel noise keyed by the
    global id (ddtree.reference.sampling); ties to the lower id, NaN never wins. A row with no finite value gives
    (-inf, first_token)."""
    logits = np.asarray(logits, dtype=np.float32)
    values = logits
    if temperature > 0:
        inv_t = np.float32(1.0) / np.float32(temperature)
        end = first_token + logits.shape[1]
        values = logits * inv_t + np.stack([gumbel_noise(seed, stream, int(p), end)[first_token:]
                                            for p in positions])
    values = np.where(np.isnan(values), np.float32(-np.inf), values)
    best = np.argmax(values, axis=1)
    return values[np.arange(len(values)), best].astype(np.float32), (best + first_token).astype(np.int64)


def pick_across_ranks(candidates: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The token per row from every rank's (value, id) candidates, in rank order: the highest value, ties to the
    lower id; a row where no rank has a value above -inf gives token 0 (as the single-GPU sampler does)."""
    values = np.stack([v for v, _ in candidates])  # [ranks, rows]
    ids = np.stack([i for _, i in candidates]).astype(np.int64)  # int32 ids would wrap the sentinel below
    best_value = values.max(axis=0)
    chosen = np.where(values == best_value[None], ids, np.iinfo(np.int64).max).min(axis=0)
    return np.where(np.isneginf(best_value), 0, chosen).astype(np.int64)


class ShardedReference:
    """The forward of `model` as G ranks compute it. logits() of each rank is its vocabulary slice; their
    concatenation in rank order is the full logits row."""

    def __init__(self, model: ReferenceModel, ranks: int) -> None:
        self.model, self.config = model, model.config
        self.layouts: list[ShardLayout] = [shard_layout(model.config, Shard(r, ranks)) for r in range(ranks)]
        self._sliced: dict[tuple[int, str], np.ndarray] = {}

    @property
    def ranks(self) -> int:
        return len(self.layouts)

    def _rank_tensor(self, rank: int, name: str) -> np.ndarray:
        key = (rank, name)
        if key not in self._sliced:
            self._sliced[key] = shard_tensor(name, self.model._tensor(name), self.config, self.layouts[rank])
        return self._sliced[key]

    def forward(self, ids: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray, cache: KVCache,
                visible: np.ndarray | None = None) -> list[np.ndarray]:
        """Each rank's logits slice [n, vocab / G] for n new tokens (as ReferenceModel.forward, which it matches
        to float32 rounding), appending their rows to `cache`."""
        cfg, model = self.config, self.model
        ids = check_token_ids(ids, cfg.vocab_size)
        positions = _check_positions(positions, len(ids), cfg.max_position_embeddings)
        visible = _check_visible(visible, len(ids))
        allowed = np.concatenate([np.ones((len(ids), cache.length), dtype=bool), visible], axis=1)
        cos, sin = model.rope.cos_sin(positions)
        x = model._embed(ids)
        for layer in range(cfg.num_hidden_layers):
            x = self._decoder_layer(layer, x, cos, sin, allowed, cache)
        xn = rms_norm(x, model._tensor("model.norm.weight"), cfg.rms_norm_eps)
        return [linear(xn, self._rank_tensor(r, "lm_head.weight")).astype(np.float32) for r in range(self.ranks)]

    def pick(self, rank_logits: Sequence[np.ndarray], temperature: float, seed: int, stream: int,
             positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """The target's token per row from the ranks' logits slices (as ddtree.reference.sampling's
        target_choices on the whole rows)."""
        return pick_across_ranks([rank_candidates(logits, layout.first_token, temperature, seed, stream, positions)
                                  for logits, layout in zip(rank_logits, self.layouts)])

    def _decoder_layer(self, layer: int, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, allowed: np.ndarray,
                       cache: KVCache) -> np.ndarray:
        cfg, model = self.config, self.model
        eps, prefix = cfg.rms_norm_eps, f"model.layers.{layer}"
        attn_in = rms_norm(x, model._tensor(f"{prefix}.input_layernorm.weight"), eps)
        q_latent, kv = mla_compress(attn_in, cos, sin, model._attention_weights(layer), cache, layer, cfg,
                                    model.rope)
        attn = f"{prefix}.self_attn"
        h = x + rank_order_sum([[mla_heads(q_latent, kv, cos, sin, allowed,
                                           *(self._rank_tensor(r, f"{attn}.{p}.weight")
                                             for p in ("q_b_proj", "kv_b_proj", "o_proj")), cfg, model.rope)]
                                for r in range(self.ranks)])
        mlp_in = rms_norm(h, model._tensor(f"{prefix}.post_attention_layernorm.weight"), eps)
        return h + rank_order_sum([self._mlp_terms(r, layer, mlp_in) for r in range(self.ranks)])

    def _mlp_terms(self, rank: int, layer: int, x: np.ndarray) -> list[np.ndarray]:
        cfg, prefix = self.config, f"model.layers.{layer}.mlp"
        if not cfg.is_moe_layer(layer):
            return [self._swiglu(rank, prefix, x)]
        routing = route(x, self.model._tensor(f"{prefix}.gate.weight"),
                        self.model._tensor(f"{prefix}.gate.e_score_correction_bias"), cfg)
        layout = self.layouts[rank]
        owned = range(layout.first_expert, layout.first_expert + layout.experts)
        routed = moe(x, routing, f"{prefix}.experts", self.model._experts, owned)
        return [self._swiglu(rank, f"{prefix}.shared_experts", x), routed]

    def _swiglu(self, rank: int, prefix: str, x: np.ndarray) -> np.ndarray:
        return swiglu_mlp(x, *(self._rank_tensor(rank, f"{prefix}.{p}.weight")
                               for p in ("gate_proj", "up_proj", "down_proj")))


__all__ = ["ShardedReference", "pick_across_ranks", "rank_candidates", "rank_order_sum"]
