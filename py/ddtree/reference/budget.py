"""The cost-aware budget of DDTree rounds ("--budget auto"): the executable specification of the GPU engine's
runtime/budget_policy (the policy) and kernels/tree_build tree_probe (the probe), step for step in float64.

- Probe: for each candidate budget b (ascending; the largest is the probe's own budget), the mass
  ``M(b) = 1 + sum of exp(path score)`` over the first b nodes the best-first build pops (``build_tree``'s pops at
  the largest candidate: a tree of a smaller budget is the prefix of those pops), summed in pop order in float64.
  Under the drafter's probabilities it is the expected accept length (accepted nodes + the bonus token) of that
  tree. Budgets past the nodes the candidates allow get the whole sum.
- Policy (CaDDTree's rule): each round runs at the candidate maximising (expected tokens committed per round,
  summed over the live streams) / (round time at that stream count and budget). ``mass[c]`` is a running mean over
  rounds (newest weighted SMOOTHING) of the streams' mean ``M(b_c) - 1``. Drafter probabilities are over-confident
  (an oracle's say nothing at all), so a candidate that has run expects ``1 + ratio(c) * mass[c]`` tokens per
  stream, ``ratio(c)`` the running mean of its observed accept length - 1 over the running mean of its predicted
  ``M(b_c) - 1`` (clamped to [0, MAX_RATIO]). A candidate not run yet is judged optimistically, so that it gets
  tried: with the ratio of the largest smaller candidate run (the mass keeps growing with the budget), else with the
  expectation of the smallest larger candidate run (an upper bound: a smaller tree is a prefix of a larger one's
  pops and accepts no more), else with ratio 1. Before any observation the middle candidate runs; ties go to the
  smaller budget.
- The engine reads a round's probe and accept lengths one round late (with the finished flags it already copies),
  so round r's budget is chosen from rounds up to r - 2; ``run_rounds`` below keeps that lag.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ddtree.reference.tree import build_tree

SMOOTHING = 0.25
MAX_RATIO = 2.0
MAX_CANDIDATES = 8  # kernels::kProbeMaxBudgets
AUTO_STEPS = (8, 16, 32, 64, 128, 256, 512)


def default_candidates(max_budget: int) -> tuple[int, ...]:
    """The auto budgets of an engine (or request) whose largest tree is ``max_budget``: the powers of two from 8
    below it, then ``max_budget`` (at most MAX_CANDIDATES, the largest kept)."""
    if max_budget < 1:
        raise ValueError(f"max_budget must be >= 1, got {max_budget}")
    below = [b for b in AUTO_STEPS if b < max_budget]
    return tuple((below + [max_budget])[-MAX_CANDIDATES:])


def check_candidates(candidates: Sequence[int], max_budget: int) -> tuple[int, ...]:
    """``candidates`` as a tuple, ascending within 1..max_budget and at most MAX_CANDIDATES; ValueError otherwise."""
    out = tuple(int(c) for c in candidates)
    if not 1 <= len(out) <= MAX_CANDIDATES:
        raise ValueError(f"auto budgets: 1..{MAX_CANDIDATES} candidates, got {len(out)}")
    if any(not 1 <= c <= max_budget for c in out) or any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"auto budgets must ascend within 1..{max_budget}, got {list(out)}")
    return out


def probe_masses(log_probs: np.ndarray, token_ids: np.ndarray, candidates: Sequence[int]) -> np.ndarray:
    """float32 [len(candidates)]: M(b) for each candidate b, from one stream's per-depth top-K candidates."""
    tree = build_tree(log_probs, token_ids, int(candidates[-1]))
    out = np.empty(len(candidates), dtype=np.float32)
    mass, popped, at = 1.0, 0, 0
    for score in tree.scores:
        mass += float(np.exp(score))
        popped += 1
        while at < len(candidates) and candidates[at] == popped:
            out[at] = mass
            at += 1
    out[at:] = mass
    return out


@dataclass(frozen=True, slots=True)
class CostTable:
    """Seconds per round at (live streams, candidate index): rows at ascending stream counts starting at 1, linear
    in between and flat past the last."""

    streams: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]

    def at(self, live: int, candidate: int) -> float:
        s, t = self.streams, self.seconds
        if live <= s[0]:
            return t[0][candidate]
        for i in range(1, len(s)):
            if live <= s[i]:
                f = (live - s[i - 1]) / (s[i] - s[i - 1])
                return t[i - 1][candidate] + f * (t[i][candidate] - t[i - 1][candidate])
        return t[-1][candidate]


def rows_cost(candidates: Sequence[int], block_size: int, streams: int = 1) -> CostTable:
    """The reference backend's round time, in verify-and-draft rows: its numpy forwards take time in proportion to
    the rows they run (the drafter's block, then the tree's budget + 1 rows), per stream."""
    return CostTable(tuple(range(1, streams + 1)),
                     tuple(tuple(float(m * (block_size + b + 1)) for b in candidates) for m in range(1, streams + 1)))


@dataclass(slots=True)
class BudgetPolicy:
    """runtime/budget_policy's BudgetPolicy: observe() each round's probe and accept lengths, choose() a budget."""

    candidates: tuple[int, ...]
    costs: CostTable
    mass: list[float] = field(default_factory=list)
    observed: list[float] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)
    seen: list[bool] = field(default_factory=list)
    any: bool = False

    def __post_init__(self) -> None:
        n = len(self.candidates)
        if n == 0 or any(len(row) != n for row in self.costs.seconds):
            raise ValueError("budget policy: no candidates, or a cost table of another width")
        self.mass, self.observed, self.predicted, self.seen = [0.0] * n, [0.0] * n, [0.0] * n, [False] * n

    @staticmethod
    def _smooth(running: float, value: float, first: bool) -> float:
        return value if first else running + SMOOTHING * (value - running)

    def observe(self, masses: np.ndarray, accepts: Sequence[int], used: int,
                skip: Sequence[bool] | None = None) -> None:
        """One round: masses float32 [rows, candidates], each row's accept length, the budget it ran at; rows with
        ``skip`` (streams that finished in that round) are left out, and so are rows holding a non-finite mass
        (a drafter's NaN would otherwise stay in every running mean)."""
        masses = np.asarray(masses, dtype=np.float32).reshape(len(accepts), len(self.candidates))
        keep = [i for i in range(len(accepts))
                if not (skip is not None and skip[i]) and bool(np.isfinite(masses[i]).all())]
        if not keep:
            return
        n = len(self.candidates)
        mean = [0.0] * n
        accepted = 0.0
        for row in keep:
            for c in range(n):
                mean[c] += float(masses[row, c]) - 1.0
            accepted += float(accepts[row]) - 1.0
        streams = len(keep)
        for c in range(n):
            self.mass[c] = self._smooth(self.mass[c], mean[c] / streams, not self.any)
        self.any = True
        if used in self.candidates:
            u = self.candidates.index(used)
            self.observed[u] = self._smooth(self.observed[u], accepted / streams, not self.seen[u])
            self.predicted[u] = self._smooth(self.predicted[u], mean[u] / streams, not self.seen[u])
            self.seen[u] = True

    def ratio(self, candidate: int) -> float:
        """Observed over predicted extra tokens of candidate index `candidate` (1 before it ran)."""
        if self.predicted[candidate] <= 1e-9:
            return 1.0
        return min(max(self.observed[candidate] / self.predicted[candidate], 0.0), MAX_RATIO)

    def expected_per_stream(self, candidate: int) -> float:
        if self.seen[candidate]:
            return 1.0 + self.ratio(candidate) * self.mass[candidate]
        for below in range(candidate - 1, -1, -1):  # the largest smaller candidate run: its calibration
            if self.seen[below]:
                return 1.0 + self.ratio(below) * self.mass[candidate]
        for above in range(candidate + 1, len(self.candidates)):  # the smallest larger one run bounds it
            if self.seen[above]:
                return self.expected_per_stream(above)
        return 1.0 + self.mass[candidate]

    def expected_tokens(self, live: int, candidate: int) -> float:
        return live * self.expected_per_stream(candidate)

    def choose(self, live: int) -> int:
        if not self.any:
            return self.candidates[(len(self.candidates) - 1) // 2]
        best, best_rate = 0, -1.0
        for c in range(len(self.candidates)):
            rate = self.expected_tokens(live, c) / self.costs.at(live, c)
            if rate > best_rate:
                best, best_rate = c, rate
        return self.candidates[best]


@dataclass(slots=True)
class LaggedPolicy:
    """The engine's loop around the policy for one stream: round r's budget from the statistics of rounds up to
    r - 2 (a round's probe is read while the next one runs)."""

    policy: BudgetPolicy
    pending: tuple[np.ndarray, int, int] | None = None  # the last round's (masses, accept length, budget), unread
    budgets: list[int] = field(default_factory=list)

    def next_budget(self) -> int:
        budget = self.policy.choose(1)
        self.budgets.append(budget)
        return budget

    def finished_round(self, masses: np.ndarray, accept: int, budget: int) -> None:
        if self.pending is not None:
            m, a, b = self.pending
            self.policy.observe(m[None, :], [a], b)
        self.pending = (masses, accept, budget)


__all__ = ["AUTO_STEPS", "BudgetPolicy", "CostTable", "LaggedPolicy", "MAX_CANDIDATES", "MAX_RATIO", "SMOOTHING",
           "check_candidates", "default_candidates", "probe_masses", "rows_cost"]
