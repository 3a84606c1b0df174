"""The sweep of `ddtree-run bench`: at every context x streams, autoregressive decoding, then DDTree rounds at every
budget (and acceptance profile, with the oracle's candidates), each timed after an untimed run that captures its
graphs. Greedy throughout, with no stop tokens, so every stream decodes the same token count and every DDTree run
must give AR's tokens exactly (checked)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from ddtree.bench.models import ModelSource, check_lengths
from ddtree.bench.oracle import Decoded, decode_ar, decode_ddtree, hit_for
from ddtree.engine import Engine
from ddtree.errors import RequestError
from ddtree.limits import MAX_TREE_BUDGET
from ddtree.request import AUTO, AUTO_MAX_BUDGET


@dataclass(frozen=True, slots=True)
class BenchRequest:
    streams: tuple[int, ...]
    budgets: tuple[int | str, ...]  # "auto": the cost-aware budget per round
    contexts: tuple[int, ...]  # prompt tokens per stream
    accepts: tuple[float, ...]  # the oracle's target mean tokens per round; () for the drafter's own candidates
    new_tokens: int

    @property
    def max_budget(self) -> int:
        """The engine's budget: the largest one given, AUTO_MAX_BUDGET when only "auto" is."""
        fixed = [b for b in self.budgets if b != AUTO]
        return max(fixed) if fixed else AUTO_MAX_BUDGET

    @property
    def points(self) -> int:
        """Rows the sweep measures."""
        return len(self.contexts) * len(self.streams) * (1 + len(self.budgets) * max(len(self.accepts), 1))


@dataclass(frozen=True, slots=True)
class BenchRow:
    """One measured configuration. `budget` is 0 and `target_accept` None for AR (a step is its round);
    `speedup` is tokens/s over AR's at the same context and streams; `exact` whether the tokens equal AR's.
    `budget` "auto" rows ran the cost-aware budget per round; `budget_rounds` counts the rounds at each budget."""

    context: int
    streams: int
    method: str
    budget: int | str
    target_accept: float | None
    mean_accept: float
    tokens_per_s: float
    round_ms: float
    host_us_per_round: float
    speedup: float
    exact: bool
    budget_rounds: dict[int, int] | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _unique(values: Sequence, name: str) -> tuple:
    if len(set(values)) != len(values):
        raise RequestError(f"{name} lists a value twice: {' '.join(map(str, values))}")
    return tuple(values)


def check_bench(source: ModelSource, streams: Sequence[int], budgets: Sequence[int], contexts: Sequence[int],
                accepts: Sequence[float] | None, new_tokens: int) -> BenchRequest:
    """The sweep's options, checked against the model before anything loads (RequestError naming the option)."""
    if source.drafter is None:
        raise RequestError(f"{source.label} has no drafter (MODEL/drafter or --drafter): bench compares DDTree "
                           "rounds with autoregressive decoding")
    if new_tokens < 2:
        raise RequestError(f"-n must be at least 2 (the prefill gives the first token), got {new_tokens}")
    for budget in budgets:
        if budget != AUTO and budget > MAX_TREE_BUDGET:
            raise RequestError(f"--budget {budget} is more than the maximum tree budget {MAX_TREE_BUDGET}")
    for accept in accepts or ():
        if not 1 <= accept <= source.depth + 1:
            raise RequestError(f"--accept {accept:g}: a mean of tokens committed per round must be in "
                               f"1..{source.depth + 1} (the drafter's block size)")
    check_lengths(source, contexts, new_tokens, ("--context", "-n"))
    return BenchRequest(_unique(streams, "--streams"), _unique(budgets, "--budget"),
                        _unique(contexts, "--context"), _unique(tuple(accepts or ()), "--accept"), new_tokens)


def bench_engine(source: ModelSource, req: BenchRequest) -> Engine:
    """One engine for the whole sweep: the most streams, the longest context, the largest budget."""
    return source.engine(max(req.streams), max(req.contexts) + req.new_tokens, req.max_budget)


def _row(context: int, streams: int, method: str, budget: int, target: float | None, run: Decoded,
         ar: Decoded) -> BenchRow:
    return BenchRow(context, streams, method, budget, target, run.mean_accept if method == "ddtree" else 1.0,
                    run.tokens_per_second, run.round_seconds * 1e3, run.host_seconds_per_round * 1e6,
                    run.tokens_per_second / ar.tokens_per_second if ar.tokens_per_second else 0.0,
                    run.tokens == ar.tokens, run.budget_counts if method == "ddtree" else None)


def run_sweep(engine: Engine, source: ModelSource, req: BenchRequest,
              on_row: Callable[[BenchRow], None]) -> list[BenchRow]:
    """Every row of the sweep, each handed to `on_row` as soon as it is measured."""
    rows: list[BenchRow] = []

    def add(row: BenchRow) -> None:
        rows.append(row)
        on_row(row)

    n, depth = req.new_tokens, source.depth
    for context in req.contexts:
        for streams in req.streams:
            prompts = source.prompts(streams, context, seed=context * 1009 + streams)
            decode_ar(engine, prompts, n)  # captures the decode graph
            ar = decode_ar(engine, prompts, n)
            add(_row(context, streams, "ar", 0, None, ar, ar))
            for target in req.accepts or (None,):
                oracle = {} if target is None else {"reference": ar.tokens, "hit": [hit_for(target, depth)] * depth}
                for budget in req.budgets:
                    decode_ddtree(engine, prompts, n, budget, **oracle)  # captures the round graphs
                    run = decode_ddtree(engine, prompts, n, budget, **oracle)
                    add(_row(context, streams, "ddtree", budget, target, run, ar))
    return rows
