"""The DDTree round on the GPU (one captured graph per bucket, replayed): generated tokens equal the engine's own
autoregressive tokens bitwise, greedy and sampled. With the drafter's own candidates (random weights: short
paths), and with the oracle replacing them after the drafter's forward (candidates that hold the autoregressive
continuation at a drawn rank, so paths of every length up to the depth limit are accepted)."""

from __future__ import annotations

import gc
import types
import weakref
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import ddtree  # noqa: E402
from ddtree.drafter import drafter_config_for, make_drafter  # noqa: E402
from ddtree.errors import RequestError  # noqa: E402
from ddtree.presets import preset_config  # noqa: E402
from ddtree.results import cut_at_stop  # noqa: E402
from conftest import sanitize_keep, sanitizing, trimmed  # noqa: E402
from engine_models import TINY_FUSED, model_config  # noqa: E402

NEW_TOKENS = 64
# New tokens of the budget sweeps: fewer in the sanitizer mode (conftest.sanitizing), so fewer rounds over the same
# graph buckets.
SWEEP_TOKENS = trimmed(NEW_TOKENS, 8)
# The replay check in the sanitizer mode: a few rounds still capture, replay and run eagerly every stage (racecheck
# runs a round's launches about 100x slower, and 32 tokens of it did not end in 500 s).
REPLAY_TOKENS = trimmed(NEW_TOKENS, 6)
# The stop check: stop ids taken from two streams' AR tokens (at 9 and 30; in the sanitizer mode at 2 and 7).
STOP_TOKENS = trimmed(NEW_TOKENS, 10)
MODELS = ["tiny", "small", TINY_FUSED, "k2-layers"]
# k2-layers: a dense layer and MoE layers at K2 dimensions; the sanitizer mode keeps one MoE layer (the same kernel
# instantiations), as the sanitizers check every byte of the weights each forward streams.
K2_LAYERS = trimmed(3, 2)
STREAMS = [1, 3, 16]
TEMPERATURES = [0.0, 0.8]
DRAFTERS = {"tiny": "tiny", "small": "small", TINY_FUSED: "tiny", "k2-layers": "k2-layers"}



@pytest.fixture(scope="module")
def drafter_dirs(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for model in ("tiny", "small", TINY_FUSED):
        dirs[model] = tmp_path_factory.mktemp(f"drafter-{model}")
        make_drafter(model_config(model), dirs[model], seed=5, preset=DRAFTERS[model])
    return dirs


def _prompt_lengths(streams: int) -> list[int]:
    """The round checks' ragged prompt lengths, 5 + 29 i tokens for stream i. In the sanitizer mode all but the last
    stream's are 5 + 3 i: the same shortest and longest prompt, and fewer prefill rows in between, which a
    sanitizer slows like any other rows."""
    return [5 + trimmed(29, 3) * i for i in range(streams - 1)] + [5 + 29 * (streams - 1)]


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _config(model: str):
    return preset_config("k2-layers", K2_LAYERS) if model == "k2-layers" else model_config(model)


def _engine(model: str, model_dirs: dict[str, Path], drafter_dirs: dict[str, Path], streams: int, budget: int,
            window: int | None = None):
    if model == "k2-layers":
        cfg = _config(model)
        return ddtree.Engine.random(cfg, streams, 512, budget=budget, seed=2,
                                    drafter=drafter_config_for(cfg, "k2-layers"), draft_window=window)
    return ddtree.Engine(model_dirs[model], drafter_dirs[model], streams=streams, max_context=512, budget=budget,
                         draft_window=window)


def _depth(engine) -> int:
    return engine.drafter_config.block_size - 1


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _check_round_equals_ar(engine, streams: int, budget: int, temperature: float, hit: float | None,
                           seed: int, stops: tuple[int, ...] = (), new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """DDTree tokens (oracle candidates with rank-0 probability `hit` per depth, or the drafter's own when None)
    equal AR's; returns each stream's accept lengths."""
    prompts = _prompts(engine.config.vocab_size, _prompt_lengths(streams), seed)
    ar = [r.tokens for r in engine.generate(prompts, new_tokens, temperature=temperature, seed=seed, method="ar",
                                            stop_token_ids=())]
    depth = _depth(engine)
    oracle = {} if hit is None else {"reference": ar, "hit": [hit] * depth, "oracle_seed": seed + 1}
    out = engine.native.generate_ddtree(prompts, new_tokens, temperature, seed, budget, list(stops), **oracle)
    for s in range(streams):
        want = cut_at_stop(ar[s], stops)[0]
        got = cut_at_stop(out["tokens"][s], stops)[0]
        assert got == want, f"stream {s}: first difference at token {_first_difference(got, want)}"
        accepts = out["accept_lengths"][s]
        assert all(1 <= a <= depth + 1 for a in accepts), accepts
        if not stops:
            assert len(out["tokens"][s]) == new_tokens and sum(accepts) >= new_tokens - 1, accepts
    assert out["rounds"] >= max(len(a) for a in out["accept_lengths"])
    return out["accept_lengths"]


# (budget, the oracle's rank-0 probability per depth) of each sweep case: the oracle at every budget, and the
# drafter's own candidates (None: random weights, mostly the root alone, sometimes more). One case a test, so that a
# sanitizer shard's command never has to hold a whole model's sweep.
ROUND_CASES = [pytest.param(b, 0.9, id=f"oracle-{b}") for b in (1, 2, 8, 32, 64, 255)] + \
    [pytest.param(32, None, id="drafter-32")]


@pytest.fixture(scope="module")
def sweep_engines() -> dict:
    """The round sweep's engine of one (model, streams, temperature), kept for its budget cases (collected one after
    another) as the unsplit sweep kept it for its budgets: one engine at a time, dropped with the module."""
    held: dict = {}
    yield held
    held.clear()


@sanitize_keep(lambda model, streams, temperature:
               TEMPERATURES.index(temperature) == (MODELS.index(model) + STREAMS.index(streams)) % 2)
@pytest.mark.parametrize("budget,hit", ROUND_CASES)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("streams", STREAMS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_round_equals_autoregressive(model: str, streams: int, temperature: float, budget: int, hit: float | None,
                                     model_dirs: dict[str, Path], drafter_dirs: dict[str, Path],
                                     sweep_engines: dict) -> None:
    """Greedy, and sampled: Gumbel-max noise is keyed by (seed, stream, position) in both methods, so a node on the
    accepted path draws what AR draws at its position. The engine's budget is 255 in every case, so each budget
    runs in the graph buckets of the largest engine."""
    key = (model, streams, temperature)
    if key not in sweep_engines:
        sweep_engines.clear()  # the last case's engine freed before the next one's pre-flight
        sweep_engines[key] = _engine(model, model_dirs, drafter_dirs, streams, 255)
    engine = sweep_engines[key]
    accepts = _check_round_equals_ar(engine, streams, budget, temperature, hit, seed=budget if hit is not None else 1,
                                     new_tokens=SWEEP_TOKENS)
    if hit is not None and budget >= 8 and not sanitizing():
        _check_acceptance([a for stream in accepts for a in stream], budget, _depth(engine))


def _check_acceptance(accepts: list[int], budgets: int | str, depth: int) -> None:
    mean = np.mean(accepts)
    assert mean >= 4, (budgets, mean)
    # paths as deep as the budget's trees reach with these candidates (the whole depth at depth 7)
    assert max(accepts) >= min(depth, 7) + 1


def test_window_round_equals_autoregressive(model_dirs: dict[str, Path], drafter_dirs: dict[str, Path]) -> None:
    """A drafter context window shorter than the prompts (its ring wraps during the prefill and the rounds)."""
    engine = _engine("tiny", model_dirs, drafter_dirs, 3, 16, window=24)
    _check_round_equals_ar(engine, 3, 16, 0.0, None, seed=3)
    _check_round_equals_ar(engine, 3, 16, 0.0, 0.9, seed=4)


def test_chain_of_top_1_tokens(model_dirs: dict[str, Path], drafter_dirs: dict[str, Path]) -> None:
    """width 1 at budget block - 1: the tree is the drafter's chain of top-1 tokens (every node one deeper than the
    last), still AR's tokens; an oracle at width 1 accepts the whole chain when it always hits."""
    engine = _engine("tiny", model_dirs, drafter_dirs, 3, 16)
    prompts = _prompts(512, [5, 34, 63], 6)
    ar = [r.tokens for r in engine.generate(prompts, NEW_TOKENS, method="ar", stop_token_ids=())]
    chain = engine.native.generate_ddtree(prompts, NEW_TOKENS, 0.0, 6, 7, width=1)
    assert chain["tokens"] == ar
    hits = engine.native.generate_ddtree(prompts, NEW_TOKENS, 0.0, 6, 7, width=1, reference=ar, hit=[1.0] * 7,
                                         oracle_seed=1)
    assert hits["tokens"] == ar
    assert all(a == 8 for stream in hits["accept_lengths"] for a in stream[:-1])


def test_replayed_round_equals_eager_round(model_dirs: dict[str, Path], drafter_dirs: dict[str, Path]) -> None:
    """profile=True runs every round eagerly, stage by stage: the same tokens and accept lengths as the graphs."""
    engine = _engine("tiny", model_dirs, drafter_dirs, 3, 16)
    prompts = _prompts(512, [7, 40, 19], 5)
    for oracle in ({}, {"reference": [[0] * REPLAY_TOKENS] * 3, "hit": [0.5] * 7, "oracle_seed": 2}):
        replayed = engine.native.generate_ddtree(prompts, REPLAY_TOKENS, 0.7, 9, 16, **oracle)
        eager = engine.native.generate_ddtree(prompts, REPLAY_TOKENS, 0.7, 9, 16, profile=True, **oracle)
        assert eager["tokens"] == replayed["tokens"] and eager["accept_lengths"] == replayed["accept_lengths"]
        stages = dict(eager["stages"])
        assert {"draft", "top_k", "tree_build", "verify", "accept", "commit", "draft_append"} <= set(stages)
        assert all(sec > 0 for sec in stages.values()) and replayed["stages"] == []
        assert replayed["host_seconds_per_round"] > 0


def test_streams_stop_at_different_rounds(model_dirs: dict[str, Path], drafter_dirs: dict[str, Path]) -> None:
    """A stop id ends each stream where AR's tokens first hold it (streams then leave the batch); the others run to
    max_new_tokens; tokens equal AR's cut at the stop, through the Python API as through the native one."""
    engine = _engine("tiny", model_dirs, drafter_dirs, 4, 16)
    prompts = _prompts(512, [6, 30, 13, 51], 8)
    ar = [r.tokens for r in engine.generate(prompts, STOP_TOKENS, method="ar", stop_token_ids=())]
    stops = (ar[1][trimmed(9, 2)], ar[3][trimmed(30, 7)])
    cut = [cut_at_stop(t, stops)[0] for t in ar]
    assert len({len(c) for c in cut}) > 1  # the streams stop at different lengths
    # The sanitizer mode keeps the oracle's pass (commits of several tokens reaching the stops at different rounds,
    # streams compacted out): the drafter's pass and the Python API's run the same kernels again.
    for hit in trimmed((0.9, None), (0.9,)):
        _check_round_equals_ar(engine, 4, 16, 0.0, hit, seed=8, stops=stops, new_tokens=STOP_TOKENS)
    if not sanitizing():
        ddtree_results = engine.generate(prompts, STOP_TOKENS, method="ddtree", stop_token_ids=stops)
        assert [r.tokens for r in ddtree_results] == cut
        assert [r.tokens for r in engine.generate(prompts, STOP_TOKENS, method="ar", stop_token_ids=stops)] == cut
        assert all(r.accept_lengths and r.decode_seconds > 0 for r in ddtree_results)


def _holders(objects: list[object]) -> str:
    """What still refers to each of `objects` (the list itself aside), for a failure message."""
    lines = []
    for obj in objects:
        for holder in gc.get_referrers(obj):
            if holder is objects:
                continue
            where = f"{holder.f_code.co_name} line {holder.f_lineno}" if isinstance(holder, types.FrameType) \
                else repr(holder)[:160]
            lines.append(f"{type(obj).__name__} held by {type(holder).__name__} {where}")
    return "; ".join(lines) or "no referrer that gc tracks (a reference from native code)"


@sanitize_keep(lambda model: model == "tiny")
@pytest.mark.parametrize("model", ["tiny", "k2-layers"])  # loaded from a checkpoint; random weights
def test_a_dropped_engine_is_freed_at_once(model: str, model_dirs: dict[str, Path],
                                           drafter_dirs: dict[str, Path]) -> None:
    """Dropping the last reference to an engine that ran AR, DDTree (auto budgets, the oracle) frees it, its native
    engine and its device memory at once, with the cyclic garbage collector off: a user who replaces an engine
    needs its memory for the next one, whose pre-flight counts free memory."""
    prompts = _prompts(_config(model).vocab_size, [6, 30], 2)

    def run_and_drop() -> tuple[int, int]:
        free_before = torch.cuda.mem_get_info()[0]
        engine = _engine(model, model_dirs, drafter_dirs, 2, 16)
        ar = [r.tokens for r in engine.generate(prompts, 8, method="ar", stop_token_ids=())]
        engine.generate(prompts, 8, method="ddtree", budget="auto", stop_token_ids=())
        engine.native.generate_ddtree(prompts, 8, 0.0, 1, 16, reference=ar, hit=[0.9] * _depth(engine),
                                      oracle_seed=2)
        free_held = torch.cuda.mem_get_info()[0]
        alive = [weakref.ref(engine), weakref.ref(engine.native)]
        del engine
        left = [obj for obj in (ref() for ref in alive) if obj is not None]
        assert not left, f"the engine outlived its last reference: {_holders(left)}"
        return free_before - free_held, torch.cuda.mem_get_info()[0] - free_held

    gc.collect()
    gc.disable()
    try:
        run_and_drop()  # the kernels' modules load on their first launch and stay
        held, freed = run_and_drop()
    finally:
        gc.enable()
    # k2-layers holds GBs, far above the driver's 2 MiB pages (the sanitizer's shards share the device, so its free
    # memory would move under them)
    if model == "k2-layers":  # the sanitizer mode keeps the tiny case only
        assert held > 2**30 and freed >= held - 4 * 2**20, f"held {held} bytes, freed {freed}"


def test_round_with_misses_and_one_token(model_dirs: dict[str, Path], drafter_dirs: dict[str, Path]) -> None:
    """An oracle that is never right: one token per round, still the AR tokens; and a single new token (no
    round)."""
    engine = _engine("tiny", model_dirs, drafter_dirs, 2, 8)
    prompts = _prompts(512, [5, 34], 3)
    ar = [r.tokens for r in engine.generate(prompts, NEW_TOKENS, method="ar", stop_token_ids=())]
    out = engine.native.generate_ddtree(prompts, NEW_TOKENS, 0.0, 3, 1, reference=ar, hit=[0.0] * 7, oracle_seed=4)
    assert out["tokens"] == ar and out["rounds"] >= NEW_TOKENS - 1
    assert all(a == 1 for stream in out["accept_lengths"] for a in stream)
    prompts = _prompts(512, [4, 9], 1)
    ar = [r.tokens for r in engine.generate(prompts, 1, method="ar", stop_token_ids=())]
    out = engine.native.generate_ddtree(prompts, 1, 0.0, 0, 8)
    assert out["tokens"] == ar and out["rounds"] == 0


def test_oracle_alone_in_an_engine_without_drafter(model_dirs: dict[str, Path]) -> None:
    engine = ddtree.Engine(model_dirs["tiny"], streams=3, max_context=512, budget=32)
    prompts = _prompts(512, [5, 34, 63], 4)
    ar = [r.tokens for r in engine.generate(prompts, NEW_TOKENS, stop_token_ids=())]
    out = engine.native.generate_ddtree(prompts, NEW_TOKENS, 0.0, 4, 32, reference=ar, hit=[0.9] * 7,
                                        oracle_seed=5, depth_limit=7, width=8)
    assert out["tokens"] == ar
    assert np.mean([a for stream in out["accept_lengths"] for a in stream]) >= 4
    with pytest.raises(RequestError, match="needs a drafter"):
        engine.generate(prompts, 8, method="ddtree")
    with pytest.raises(ValueError, match="no drafter"):
        engine.native.generate_ddtree(prompts, 8, 0.0, 0, 8)


def test_round_refuses_bad_arguments(model_dirs: dict[str, Path], drafter_dirs: dict[str, Path]) -> None:
    engine = _engine("tiny", model_dirs, drafter_dirs, 1, 8)
    native = engine.native
    good = dict(prompts=[[1, 2]], max_new_tokens=8, temperature=0.0, seed=0, budget=8, reference=[[0] * 8],
                hit=[0.5] * 7, oracle_seed=1)
    for key, value, message in [("budget", 9, "budget must be in 1..8"), ("hit", [0.5], "hit"),
                                ("hit", [float("nan")] * 7, "hit"), ("reference", [[0] * 8, [0] * 8], "reference"),
                                ("max_new_tokens", 600, "max_new_tokens"), ("stop_ids", [512], "stop_token_ids"),
                                ("stop_ids", [1] * 65, "stop_token_ids"), ("hit", None, "reference and hit")]:
        with pytest.raises(ValueError, match=message):
            native.generate_ddtree(**{**good, key: value})
    with pytest.raises(RequestError, match="budget must be an integer in 1..8"):
        engine.generate([[1, 2]], 4, budget=9)
    with pytest.raises(RequestError, match="stop_token_ids"):
        engine.generate([[1, 2]], 4, stop_token_ids=[512])
    with pytest.raises(RequestError, match="method"):
        engine.generate([[1, 2]], 4, method="beam")


def test_preflight_counts_the_drafter() -> None:
    """A K2-sized drafter's cache for 64 streams x 163840 positions (about 200 GiB) does not fit beside the target:
    refused before anything is allocated, with the drafter's bytes named."""
    cfg = preset_config("k2-layers", 3)
    drafter = drafter_config_for(cfg, "k2-layers")
    with pytest.raises(RequestError, match=r"drafter [0-9]{3}\.[0-9]{2} GiB"):
        ddtree.Engine.random(cfg, 64, 163840, drafter=drafter)
