"""The target split over several GPUs through NCCL (runtime/multi_gpu_engine.h, nccl_collectives.h).

On one GPU: the NCCL library loads, a one-rank communicator comes up, and the exchange's graph (the in-place
gathers, which NCCL makes no-ops on one rank, then the rank-order sum and pick) captures and runs. On two or more: the same exchange across
GPUs; a G-GPU engine's logits and tokens are bitwise the one-GPU simulation of every rank's (the same rank-order
sums), DDTree equals AR greedy and sampled, and auto budgets agree on every rank. Skipped, with the reason, without
an NCCL library (ddtree.nccl) or enough GPUs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ddtree
from ddtree import bf16
from ddtree.device import device_info
from ddtree.errors import RequestError
from ddtree.nccl import nccl_library
from ddtree.reference.sharded import pick_across_ranks, rank_order_sum
from ddtree.shard import Shard
from engine_models import model_config


def _library() -> str:
    try:
        return nccl_library()
    except RequestError as err:
        pytest.skip(str(err))


def _gpus(n: int) -> tuple[int, ...]:
    present = len(device_info().devices)
    if present < n:
        pytest.skip(f"needs {n} GPUs, {present} present")
    return tuple(range(n))


@pytest.mark.parametrize("ranks", [1, 2])
def test_nccl_exchange_in_a_graph(ranks: int) -> None:
    from ddtree import _native

    library, devices = _library(), _gpus(ranks)
    terms, rows, width = 2, 5, 96
    rng = np.random.default_rng(ranks)
    parts = bf16.from_float32(rng.standard_normal((ranks, terms, rows, width)).astype(np.float32))
    candidates = np.zeros((ranks, rows), dtype=[("value", np.float32), ("id", np.int32)])
    candidates["value"] = rng.integers(-3, 3, size=(ranks, rows)).astype(np.float32)  # ties across ranks
    candidates["id"] = rng.integers(0, 1000, size=(ranks, rows))
    pairs = [np.stack([candidates[r]["value"].view(np.int32), candidates[r]["id"]], axis=1).ravel().tolist()
             for r in range(ranks)]
    sums, tokens = _native.kernels.nccl_exchange_check(library, list(devices), terms, rows, width,
                                                       [p.ravel().tolist() for p in parts], pairs)
    want_sums = bf16.from_float32(rank_order_sum(bf16.to_float32(parts)))  # rounded once to bf16
    want_tokens = pick_across_ranks([(candidates[r]["value"], candidates[r]["id"]) for r in range(ranks)])
    for r in range(ranks):
        np.testing.assert_array_equal(np.array(sums[r], dtype=np.uint16).reshape(rows, width), want_sums)
        np.testing.assert_array_equal(np.array(tokens[r]), want_tokens)


def test_nccl_exchange_times_both_ways() -> None:
    from ddtree import _native

    library, devices = _library(), _gpus(1)
    gathered, reduced = _native.kernels.nccl_exchange_seconds(library, list(devices), 2, 4, 7168, 4, 3)
    # on one rank NCCL's in-place all-reduce is a no-op: its graph may time as nothing
    assert 0 < gathered < 1 and 0 <= reduced < 1


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=n).tolist() for n in lengths]


def test_one_device_engine_runs_unsplit(model_dirs: dict[str, Path]) -> None:
    """devices=(0,) is the whole model on one GPU (with a one-rank communicator beside it): the plain engine's
    tokens."""
    _library()
    prompts = _prompts(model_config("tiny").vocab_size, [7, 9], seed=3)
    plain = ddtree.Engine(model_dirs["tiny"], streams=2, max_context=64)
    one = ddtree.Engine(model_dirs["tiny"], streams=2, max_context=64, devices=(0,))
    for temperature in (0.0, 0.8):
        want = [r.tokens for r in plain.generate(prompts, 6, temperature=temperature, seed=2, stop_token_ids=())]
        got = [r.tokens for r in one.generate(prompts, 6, temperature=temperature, seed=2, stop_token_ids=())]
        assert got == want


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_gpus_equal_the_rank_simulation(preset: str, model_dirs: dict[str, Path]) -> None:
    """Bitwise: logits of a prompt's rows, and greedy and sampled AR tokens."""
    library, devices = _library(), _gpus(2)
    del library
    cfg = model_config(preset)
    prompts = _prompts(cfg.vocab_size, [11, 30], seed=4)
    simulated = ddtree.Engine(model_dirs[preset], streams=2, max_context=128, shard=Shard(0, 2), all_ranks=True)
    split = ddtree.Engine(model_dirs[preset], streams=2, max_context=128, devices=devices)
    rows = (prompts[0], [0] * len(prompts[0]), list(range(len(prompts[0]))))
    np.testing.assert_array_equal(split.native.forward_logits(*rows), simulated.native.forward_logits(*rows))
    for temperature in (0.0, 0.9):
        want = [r.tokens for r in simulated.generate(prompts, 8, temperature=temperature, seed=5, stop_token_ids=())]
        got = [r.tokens for r in split.generate(prompts, 8, temperature=temperature, seed=5, stop_token_ids=())]
        assert got == want


def test_random_gpus_equal_the_random_rank_simulation() -> None:
    """Engine.random(devices=...) draws the all_ranks engine's model: rank r's split tensors from seed + r, the
    replicated ones rank 0's."""
    _library()
    devices = _gpus(2)
    cfg = model_config("tiny")
    simulated = ddtree.Engine.random(cfg, 1, 64, seed=9, shard=Shard(0, 2), all_ranks=True)
    split = ddtree.Engine.random(cfg, 1, 64, seed=9, devices=devices)
    prompt = _prompts(cfg.vocab_size, [12], seed=6)[0]
    rows = (prompt, [0] * len(prompt), list(range(len(prompt))))
    np.testing.assert_array_equal(split.native.forward_logits(*rows), simulated.native.forward_logits(*rows))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_gpus_ddtree_equals_ar(temperature: float, model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """DDTree rounds on G GPUs, the drafter's candidates and an oracle's: bitwise the G-GPU AR tokens; and auto
    budgets, chosen alike on every rank (the runtime checks their budgets agree), give the same tokens."""
    from ddtree.drafter import make_drafter
    from test_ddtree_round import _check_round_equals_ar

    _library()
    devices = _gpus(2)
    make_drafter(model_config("tiny"), tmp_path, seed=5, preset="tiny")
    engine = ddtree.Engine(model_dirs["tiny"], tmp_path, streams=3, max_context=512, budget=16, devices=devices)
    _check_round_equals_ar(engine, 3, 16, temperature, None, seed=7)
    _check_round_equals_ar(engine, 3, 8, temperature, 0.8, seed=8)
    prompts = _prompts(engine.config.vocab_size, [5, 34], seed=9)
    ar = [r.tokens for r in engine.generate(prompts, 12, temperature=temperature, seed=3, method="ar",
                                            stop_token_ids=())]
    auto = engine.generate(prompts, 12, temperature=temperature, seed=3, budget="auto", stop_token_ids=())
    assert [r.tokens for r in auto] == ar
    assert engine.last_costs is not None and all(r.budgets for r in auto)
