"""What `ddtree-run profile` runs: a short generation that captures the engine's CUDA graphs (run twice; the second
is the one timed), the captured graphs each replayed on their own (Engine.replay), and with stages the eager rounds'
device time per stage (generate(profile=True)); or, for Nsight Compute, one graph replayed once and nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field

from ddtree.bench.models import ModelSource, check_lengths
from ddtree.engine import MAX_REPLAYS, Engine
from ddtree.errors import RequestError
from ddtree.limits import MAX_TREE_BUDGET

METHODS = ("ar", "ddtree", "both")


@dataclass(frozen=True, slots=True)
class ProfileRequest:
    streams: int
    budget: int | None  # None: the drafter's block size - 1
    context: int  # prompt tokens per stream
    new_tokens: int
    methods: tuple[str, ...]  # "ar", "ddtree"
    graph: str | None  # replay this one only
    replays: int
    stages: bool
    single: bool


@dataclass(frozen=True, slots=True)
class GraphTime:
    name: str
    nodes: int
    replays: int  # 0: not replayed
    ms: float | None  # median device ms per replay


@dataclass(frozen=True, slots=True)
class GenerateTime:
    """The timed generation of one method: device ms per step (AR) or round (DDTree), and its mean acceptance."""

    method: str
    ms_per_round: float
    rounds: int
    mean_accept: float


@dataclass(slots=True)
class ProfileResult:
    graphs: list[GraphTime] = field(default_factory=list)
    generate: list[GenerateTime] = field(default_factory=list)
    stage_ms: dict[str, float] = field(default_factory=dict)  # per eager round
    stage_rounds: int = 0


def check_profile(source: ModelSource, streams: int, budget: int | None, context: int, new_tokens: int,
                  method: str | None, graph: str | None, replays: int | None, stages: bool,
                  single: bool) -> ProfileRequest:
    """The options, checked against the model before anything loads (RequestError naming the option)."""
    if method is None:
        method = "both" if source.drafter is not None else "ar"
    methods = ("ar", "ddtree") if method == "both" else (method,)
    if "ddtree" in methods and source.drafter is None:
        raise RequestError(f"--method {method}: {source.label} has no drafter (MODEL/drafter or --drafter); "
                           "--method ar profiles its decode step")
    if budget is not None:
        if "ddtree" not in methods:
            raise RequestError("--budget applies to DDTree rounds: it needs --method ddtree or both")
        if budget > MAX_TREE_BUDGET:
            raise RequestError(f"--budget {budget} is more than the maximum tree budget {MAX_TREE_BUDGET}")
    if new_tokens < 2:
        raise RequestError(f"-n must be at least 2 (the prefill gives the first token), got {new_tokens}")
    if stages and "ddtree" not in methods:
        raise RequestError("--stages times the stages of DDTree rounds: it needs --method ddtree or both")
    if single:
        if graph is None:
            raise RequestError("--single replays one graph: name it with --graph (ddtree-run profile lists them)")
        if stages or replays is not None:
            raise RequestError("--single replays its graph once and runs nothing else: it takes no --stages or "
                               "--replays")
    if replays is not None and replays > MAX_REPLAYS:
        raise RequestError(f"--replays must be at most {MAX_REPLAYS}, got {replays}")
    if graph is not None and not graph.strip():
        raise RequestError("--graph is empty: give a name that ddtree-run profile lists")
    check_lengths(source, [context], new_tokens, ("--context", "-n"))
    return ProfileRequest(streams, budget, context, new_tokens, methods, graph, 20 if replays is None else replays,
                          stages, single)


def profile_engine(source: ModelSource, req: ProfileRequest) -> Engine:
    return source.engine(req.streams, req.context + req.new_tokens, req.budget)


def _generate(engine: Engine, prompts: list[list[int]], req: ProfileRequest, method: str,
              profile: bool = False) -> list:
    budget = req.budget if method == "ddtree" else None
    return engine.generate(prompts, req.new_tokens, method=method, stop_token_ids=(), budget=budget,
                           profile=profile)


def run_profile(engine: Engine, source: ModelSource, req: ProfileRequest) -> ProfileResult:
    out = ProfileResult()
    prompts = source.prompts(req.streams, req.context)
    for method in req.methods:
        _generate(engine, prompts, req, method)  # captures the graphs
        if req.single:
            continue
        results = _generate(engine, prompts, req, method)
        rounds = req.new_tokens - 1 if method == "ar" else max(len(r.accept_lengths) for r in results)
        accepts = [a for r in results for a in r.accept_lengths]
        out.generate.append(GenerateTime(method, results[0].decode_seconds / rounds * 1e3, rounds,
                                         sum(accepts) / len(accepts) if accepts else 1.0))
    captured = engine.graphs()
    if req.graph is not None and req.graph not in {g.name for g in captured}:
        names = "; ".join(g.name for g in captured) or "none"
        raise RequestError(f"--graph {req.graph!r}: no captured graph has that name (captured: {names})")
    for g in captured:
        if req.graph is not None and g.name != req.graph:
            continue
        replays = 1 if req.single else req.replays
        seconds = engine.replay(g.name, replays, warmup=not req.single)
        out.graphs.append(GraphTime(g.name, g.nodes, replays, seconds * 1e3))
    if req.stages:
        results = _generate(engine, prompts, req, "ddtree", profile=True)
        out.stage_rounds = max(len(r.accept_lengths) for r in results)
        out.stage_ms = {name: sec / out.stage_rounds * 1e3 for name, sec in
                        sorted(results[0].stage_seconds.items(), key=lambda kv: -kv[1])}
    return out
