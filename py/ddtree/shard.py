"""How a target model splits over G GPUs (ranks), and each rank's slice of a checkpoint tensor.

Tensor-parallel attention and dense parts, expert-parallel routed experts, as serving stacks run Kimi-K2:
- MLA heads split G ways: q_b_proj and kv_b_proj by output rows of whole heads, o_proj by input columns of them;
  q_a_proj, kv_a_proj_with_mqa (the LoRA down-projections), their norms and the router are replicated;
- the dense MLP and the shared expert split by intermediate columns (gate/up rows, down columns);
- routed experts: rank r holds experts [r E / G, (r + 1) E / G);
- lm_head split by vocabulary rows; the embedding table and every norm are replicated.
Each layer then ends its attention and its MLP with a partial sum [rows, hidden] per rank, and the LM head with a
vocabulary slice of the logits per rank: 2 x layers + 1 collectives per forward (runtime/collectives.h). The C++
runtime has the same layout (runtime/shard.h); tests/test_shard.py checks that the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddtree.config import ModelConfig
from ddtree.errors import RequestError


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of `ranks` GPUs. Shard() is the whole model on one GPU."""

    rank: int = 0
    ranks: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 1:
            raise RequestError(f"ranks must be a positive integer, got {self.ranks!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.ranks:
            raise RequestError(f"rank must be an integer in 0..{self.ranks - 1} (ranks {self.ranks}), "
                               f"got {self.rank!r}")


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """One rank's share of every split dimension: a count per rank and where this rank's part starts."""

    heads: int
    inter: int         # dense MLP intermediate columns
    shared_inter: int  # shared expert intermediate columns
    experts: int       # routed experts held
    vocab: int         # lm_head rows
    first_head: int
    first_inter: int
    first_shared_inter: int
    first_expert: int
    first_token: int


def _split(ranks: int, field: str, value: int, needed: bool = True) -> int:
    if needed and value % ranks:
        raise RequestError(f"ranks {ranks} does not divide the config's {field} {value}: choose ranks that divide "
                           f"it")
    return value // ranks


def shard_layout(cfg: ModelConfig, shard: Shard) -> ShardLayout:
    """The layout of `shard`; RequestError naming `ranks` and the config field a rank count does not divide. The
    dense MLP's width is only checked when the model has dense layers, the experts' only when it has MoE layers."""
    g = shard.ranks
    has_dense = cfg.first_k_dense_replace > 0
    has_moe = cfg.num_hidden_layers > cfg.first_k_dense_replace
    heads = _split(g, "num_attention_heads", cfg.num_attention_heads)
    inter = _split(g, "intermediate_size", cfg.intermediate_size, has_dense)
    shared = _split(g, "moe_intermediate_size", cfg.n_shared_experts * cfg.moe_intermediate_size, has_moe)
    experts = _split(g, "n_routed_experts", cfg.n_routed_experts, has_moe)
    vocab = _split(g, "vocab_size", cfg.vocab_size)
    r = shard.rank
    return ShardLayout(heads, inter, shared, experts, vocab, r * heads, r * inter, r * shared, r * experts,
                       r * vocab)


def shard_tensor(name: str, array: np.ndarray, cfg: ModelConfig, layout: ShardLayout) -> np.ndarray:
    """The part of checkpoint tensor `name` (no weight prefix) a rank of `layout` holds: a view where it can be
    (row slices), a contiguous copy for column slices; replicated tensors and owned experts as they are."""
    parts = name.split(".")
    if name == "lm_head.weight":
        return array[layout.first_token:layout.first_token + layout.vocab]
    if len(parts) < 5 or parts[0] != "model" or parts[1] != "layers" or ".mlp.experts." in name:
        return array
    module, proj = parts[3], parts[-2]
    if module == "self_attn":
        qk, vo = cfg.qk_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim
        if proj == "q_b_proj":
            return array[layout.first_head * qk:(layout.first_head + layout.heads) * qk]
        if proj == "kv_b_proj":
            return array[layout.first_head * vo:(layout.first_head + layout.heads) * vo]
        if proj == "o_proj":
            v = cfg.v_head_dim
            return np.ascontiguousarray(array[:, layout.first_head * v:(layout.first_head + layout.heads) * v])
        return array
    if module != "mlp" or proj not in ("gate_proj", "up_proj", "down_proj"):
        return array
    first, width = ((layout.first_shared_inter, layout.shared_inter) if parts[4] == "shared_experts"
                    else (layout.first_inter, layout.inter))
    if proj == "down_proj":
        return np.ascontiguousarray(array[:, first:first + width])
    return array[first:first + width]


__all__ = ["Shard", "ShardLayout", "shard_layout", "shard_tensor"]
