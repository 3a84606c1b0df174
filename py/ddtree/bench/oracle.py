"""Decoding runs that a benchmark times: autoregressive, and DDTree with the drafter's candidates or with ORACLE
candidates (the drafter's forward and top-K still run, then candidates holding the target's own continuation at a
drawn rank replace its top-K: speed at a set acceptance, whatever the weights)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ddtree.engine import Engine
from ddtree.request import AUTO


def hit_for(mean: float, depth: int) -> float:
    """The per-depth rank-0 probability h with 1 + h + h^2 + ... + h^depth = mean (the chain's expected accept
    length; the oracle's side branches add a little)."""
    if mean <= 1:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        h = (lo + hi) / 2
        lo, hi = (h, hi) if sum(h ** d for d in range(depth + 1)) < mean else (lo, h)
    return lo


def random_prompts(vocab_size: int, streams: int, length: int, seed: int) -> list[list[int]]:
    """`streams` prompts of `length` token ids drawn uniformly (seeded): distinct per stream, so the streams route
    to different experts."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, length).tolist() for _ in range(streams)]


@dataclass(frozen=True, slots=True)
class Decoded:
    """One timed generation of every stream: its tokens and per-round accept lengths (DDTree), device seconds of
    the decode phase and the rounds the longest stream took."""

    tokens: list[list[int]]
    accept_lengths: list[list[int]]
    decode_seconds: float
    rounds: int
    host_seconds_per_round: float = 0.0
    budgets: list[int] = field(default_factory=list)  # each round's budget (DDTree)
    costs: dict[str, list] = field(default_factory=dict)  # budget "auto": the round times it chose by

    @property
    def budget_counts(self) -> dict[int, int]:
        """Rounds run at each budget."""
        return dict(sorted(Counter(self.budgets).items()))

    @property
    def tokens_per_second(self) -> float:
        """Tokens after each stream's first (the prefill's), all streams together, per decode second."""
        decoded = sum(len(t) - 1 for t in self.tokens)
        return decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def mean_accept(self) -> float:
        accepts = [a for stream in self.accept_lengths for a in stream]
        return float(np.mean(accepts)) if accepts else 0.0

    @property
    def round_seconds(self) -> float:
        return self.decode_seconds / self.rounds if self.rounds else 0.0


def decode_ar(engine: Engine, prompts: Sequence[Sequence[int]], new_tokens: int) -> Decoded:
    """Greedy autoregressive decoding of `new_tokens` per stream (no stop tokens): a step is a round."""
    results = engine.generate(prompts, new_tokens, method="ar", stop_token_ids=())
    return Decoded([r.tokens for r in results], [], results[0].decode_seconds, new_tokens - 1)


def decode_ddtree(engine: Engine, prompts: Sequence[Sequence[int]], new_tokens: int, budget: int | str,
                  reference: Sequence[Sequence[int]] | None = None, hit: Sequence[float] | None = None,
                  oracle_seed: int = 1, auto_budgets: Sequence[int] | None = None) -> Decoded:
    """Greedy DDTree rounds of `budget` nodes, `new_tokens` per stream (no stop tokens); with `reference` (each
    stream's continuation, e.g. decode_ar's tokens) and `hit` (rank-0 probability per depth), the oracle's
    candidates. budget "auto": each round's budget among `auto_budgets` (default: the engine's default
    candidates) by the cost-aware policy, its round times measured on the engine."""
    kwargs: dict = {} if reference is None else {"reference": [list(r) for r in reference], "hit": list(hit or ()),
                                                 "oracle_seed": oracle_seed}
    if budget == AUTO:
        autos = engine.auto_candidates(auto_budgets)
        kwargs["auto_budgets"] = list(autos)
        budget = autos[-1]
    out = engine.native.generate_ddtree([list(p) for p in prompts], new_tokens, 0.0, 0, budget, **kwargs)
    costs = {"streams": out["cost_streams"], "seconds": out["cost_seconds"]} if out.get("cost_streams") else {}
    return Decoded(out["tokens"], out["accept_lengths"], out["decode_seconds"],
                   max(len(a) for a in out["accept_lengths"]), out["host_seconds_per_round"],
                   list(out.get("budgets", [])), costs)
