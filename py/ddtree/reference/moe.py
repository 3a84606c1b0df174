"""Mixture of experts with noaux_tc routing, INT4 routed experts and a shared expert."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ddtree.config import ModelConfig
from ddtree.reference import int4
from ddtree.reference.layers import linear, sigmoid, swiglu_mlp


@dataclass(frozen=True)
class Routing:
    experts: np.ndarray  # int64 [n, top_k]: chosen experts, best biased score first
    weights: np.ndarray  # float32 [n, top_k]: their combine weights


def route(x: np.ndarray, gate: np.ndarray, correction_bias: np.ndarray, cfg: ModelConfig) -> Routing:
    """noaux_tc: sigmoid scores; the correction bias only picks the top-k; the weights are the unbiased scores.

    With n_group = topk_group the group stage selects every group and is omitted. Ties in the biased score go
    to the lower expert index.
    """
    scores = sigmoid(linear(x, gate))
    biased = scores + correction_bias
    experts = np.argsort(-biased, axis=-1, kind="stable")[:, :cfg.num_experts_per_tok]
    weights = np.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    return Routing(experts, (weights * np.float32(cfg.routed_scaling_factor)).astype(np.float32))


@dataclass(frozen=True)
class Expert:
    gate_proj: np.ndarray  # float32 [moe_intermediate, hidden], dequantized
    up_proj: np.ndarray
    down_proj: np.ndarray  # float32 [hidden, moe_intermediate]


class ExpertStore:
    """Routed experts dequantized on first use, kept in a least-recently-used cache bounded in bytes."""

    def __init__(self, tensor: Callable[[str], np.ndarray], cache_bytes: int) -> None:
        self._tensor = tensor
        self._cache: OrderedDict[str, Expert] = OrderedDict()
        self._cache_bytes = cache_bytes
        self._held = 0

    def get(self, prefix: str) -> Expert:
        if prefix in self._cache:
            self._cache.move_to_end(prefix)
            return self._cache[prefix]
        expert = Expert(*(int4.dequantize(self._tensor(f"{prefix}.{p}.weight_packed"),
                                          self._tensor(f"{prefix}.{p}.weight_scale"))
                          for p in ("gate_proj", "up_proj", "down_proj")))
        size = sum(a.nbytes for a in (expert.gate_proj, expert.up_proj, expert.down_proj))
        while self._cache and self._held + size > self._cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._held -= sum(a.nbytes for a in (old.gate_proj, old.up_proj, old.down_proj))
        self._cache[prefix] = expert
        self._held += size
        return expert


def moe(x: np.ndarray, routing: Routing, experts_prefix: str, store: ExpertStore,
        owned: range | None = None) -> np.ndarray:
    """Routed-expert output [n, hidden]: sum over each token's chosen experts of weight * expert(x); with `owned`,
    over those of its experts only (one GPU's partial sum when the experts are split over several)."""
    out = np.zeros_like(x)
    for e in np.unique(routing.experts):
        if owned is not None and e not in owned:
            continue
        tokens, slot = np.nonzero(routing.experts == e)
        expert = store.get(f"{experts_prefix}.{e}")
        y = swiglu_mlp(x[tokens], expert.gate_proj, expert.up_proj, expert.down_proj)
        np.add.at(out, tokens, routing.weights[tokens, slot][:, None] * y)
    return out
