"""The cost-aware budget per round (budget="auto") on the GPU: tokens bitwise those of autoregressive decoding
whatever budget each round runs at (greedy and sampled, several streams, streams that stop early, eager rounds);
the probe kernel against ddtree.reference.budget.probe_masses; budgets that follow the acceptance (oracle
profiles of high and low acceptance); the round times measured on the engine; bad values refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import ddtree  # noqa: E402
from ddtree.drafter import (drafter_config_for, make_drafter, random_drafter_tensors,  # noqa: E402
                            write_drafter)
from ddtree.errors import RequestError  # noqa: E402
from ddtree.reference.budget import CostTable, probe_masses  # noqa: E402
from ddtree.results import cut_at_stop  # noqa: E402
from conftest import sanitize_keep, trimmed  # noqa: E402
from engine_models import model_config  # noqa: E402

kernels = pytest.importorskip("ddtree._native", exc_type=ImportError).kernels
# New tokens of the exactness checks (fewer in the sanitizer mode: every kernel still runs, in fewer rounds), and
# of the policy checks, whose budgets after the first two rounds need a run of rounds to say anything.
NEW_TOKENS = trimmed(64, 12)
POLICY_TOKENS = 64
CANDIDATES = (8, 16, 32, 64)
# A round time that grows with the budget: large trees pay only when the drafter's paths are accepted.
RISING = CostTable((1,), ((1.0, 1.1, 1.25, 1.5),))


@pytest.fixture(scope="module")
def engine(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    drafter_dir = tmp_path_factory.mktemp("drafter-budget")
    make_drafter(model_config("tiny"), drafter_dir, seed=5, preset="tiny")
    return ddtree.Engine(model_dirs["tiny"], drafter_dir, streams=3, max_context=512, budget=64)


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _depth(engine) -> int:
    return engine.drafter_config.block_size - 1


@sanitize_keep(lambda temperature, hit: [0.0, 0.8].index(temperature) == [None, 0.9, 0.3].index(hit) % 2)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("hit", [None, 0.9, 0.3])
def test_auto_budget_equals_autoregressive(engine, temperature: float, hit: float | None) -> None:
    prompts = _prompts(engine.config.vocab_size, [5, 40, 17], 11)
    ar = [r.tokens for r in engine.generate(prompts, NEW_TOKENS, temperature=temperature, seed=4, method="ar",
                                            stop_token_ids=())]
    oracle = {} if hit is None else {"reference": ar, "hit": [hit] * _depth(engine), "oracle_seed": 3}
    for profile in (False, True):  # eager rounds read each round's probe at once: other budgets, the same tokens
        out = engine.native.generate_ddtree(prompts, NEW_TOKENS, temperature, 4, 64, [], profile,
                                            auto_budgets=list(CANDIDATES), **oracle)
        assert out["tokens"] == ar
        assert set(out["budgets"]) <= set(CANDIDATES) and len(out["budgets"]) == out["rounds"]
        assert max(len(a) for a in out["accept_lengths"]) <= len(out["budgets"])
        assert out["cost_streams"] == [1, 2, 3] and all(t > 0 for row in out["cost_seconds"] for t in row)
        assert all(len(row) == len(CANDIDATES) for row in out["cost_seconds"])


def test_auto_budget_through_the_python_api(engine) -> None:
    """Engine.generate(budget="auto"): streams that stop at different rounds (stop ids), each result's budgets one
    per round; the measured round times are kept (Engine.last_costs) and reused."""
    prompts = _prompts(engine.config.vocab_size, [6, 30, 13], 8)
    ar = [r.tokens for r in engine.generate(prompts, NEW_TOKENS, method="ar", stop_token_ids=())]
    stops = (ar[1][9],)
    results = engine.generate(prompts, NEW_TOKENS, budget="auto", stop_token_ids=stops)
    assert [r.tokens for r in results] == [cut_at_stop(t, stops)[0] for t in ar]
    for r in results:
        assert len(r.budgets) == len(r.accept_lengths) and set(r.budgets) <= set(CANDIDATES)
    costs = engine.last_costs
    assert costs is not None and costs.streams == (1, 2, 3)
    # every (stream count, candidate) round graph was timed: larger trees never take much less time
    for row in costs.seconds:
        assert row[-1] > 0.5 * row[0]
    names = [g.name for g in engine.graphs() if g.kind == "round"]
    assert any(name.endswith("probe=8,16,32,64") for name in names)
    again = engine.generate(prompts, NEW_TOKENS, budget="auto", stop_token_ids=stops)
    assert [r.tokens for r in again] == [r.tokens for r in results] and engine.last_costs == costs
    fixed = engine.generate(prompts, NEW_TOKENS, budget=16, stop_token_ids=())
    assert all(r.budgets == [16] * len(r.accept_lengths) for r in fixed)


def test_given_costs_and_candidates(engine) -> None:
    """A cost table given by the caller replaces the measured one; a flat one leads to the largest candidate once
    the probe's masses are read, a steep one to the smallest."""
    prompts = _prompts(engine.config.vocab_size, [9], 2)
    ar = [r.tokens for r in engine.generate(prompts, POLICY_TOKENS, method="ar", stop_token_ids=())]
    oracle = {"reference": ar, "hit": [1.0] * _depth(engine), "oracle_seed": 1}
    flat = engine.native.generate_ddtree(prompts, POLICY_TOKENS, 0.0, 0, 32, auto_budgets=[4, 32],
                                         cost_streams=[1], cost_seconds=[[1.0, 1.0]], **oracle)
    assert flat["tokens"] == ar and flat["budgets"][:2] == [4, 4] and set(flat["budgets"][2:]) == {32}
    assert flat["cost_seconds"] == [[1.0, 1.0]]
    steep = engine.native.generate_ddtree(prompts, POLICY_TOKENS, 0.0, 0, 32, auto_budgets=[4, 32],
                                          cost_streams=[1], cost_seconds=[[1.0, 100.0]], **oracle)
    assert steep["tokens"] == ar and set(steep["budgets"]) == {4}


def test_budgets_follow_the_acceptance(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Oracle candidates carry the same log-probs whatever they hit, so only the calibration against the observed
    accept lengths tells the profiles apart. A drafter of block 16 (chains of 15): when every rank-0 candidate
    hits, larger trees accept more and pay for their round time; when none does (the continuation then sits at
    another rank at some depths only), the smallest tree is the cheapest way to the few tokens a round commits.
    The oracle's draws are seeded: a numpy replay of this seed's hashes and accept walks through the policy gives
    budget 8 in every round after the first two at hit 0, and mostly 32 and 64 at hit 1 (not a GPU run)."""
    cfg = dataclasses.replace(drafter_config_for(model_config("tiny"), "tiny"), block_size=16)
    write_drafter(tmp_path, cfg, random_drafter_tensors(cfg, 5))
    engine = ddtree.Engine(model_dirs["tiny"], tmp_path, streams=1, max_context=512, budget=64)
    prompts = _prompts(engine.config.vocab_size, [12], 6)
    ar = [r.tokens for r in engine.generate(prompts, POLICY_TOKENS, method="ar", stop_token_ids=())]
    runs = {}
    for hit in (0.0, 1.0):
        out = engine.native.generate_ddtree(prompts, POLICY_TOKENS, 0.0, 0, 64, auto_budgets=list(CANDIDATES),
                                            cost_streams=[1], cost_seconds=[list(RISING.seconds[0])],
                                            reference=ar, hit=[hit] * 15, oracle_seed=2)
        assert out["tokens"] == ar
        runs[hit] = out["budgets"][2:]  # the first two rounds run before any probe is read
    low, high = runs[0.0], runs[1.0]
    assert np.mean([b == 8 for b in low]) >= 0.5, low
    assert np.mean([b >= 16 for b in high]) >= 0.5, high
    auto = engine.generate(prompts, POLICY_TOKENS, budget="auto", budget_costs=RISING, stop_token_ids=())
    assert auto[0].tokens == ar[0]


@pytest.mark.parametrize("seed", range(4))
def test_probe_kernel_equals_the_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    streams, depth, width = int(rng.integers(1, 9)), int(rng.integers(1, 16)), int(rng.integers(1, 200))
    logits = rng.normal(0, rng.uniform(0.3, 4), (streams, depth, 4 * width))
    lp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    lp = -np.sort(-lp, axis=-1)[..., :width].astype(np.float32)
    ids = np.argsort(rng.random((streams, depth, width)), axis=-1).astype(np.int32)
    budgets = sorted(rng.choice(np.arange(1, 300), int(rng.integers(1, 9)), replace=False).tolist())
    masses = torch.zeros((streams, len(budgets)), dtype=torch.float32, device="cuda")
    kernels.tree_probe(masses, torch.from_numpy(lp).cuda(), budgets)
    got = masses.cpu().numpy()
    for s in range(streams):
        np.testing.assert_allclose(got[s], probe_masses(lp[s], ids[s], budgets), rtol=2e-6)


def test_probe_kernel_refuses_bad_budgets() -> None:
    lp = torch.zeros((1, 3, 4), dtype=torch.float32, device="cuda")
    for budgets in ([], [4, 4], [8, 4], [0], list(range(1, 10)), [2000]):
        masses = torch.zeros((1, max(len(budgets), 1)), dtype=torch.float32, device="cuda")
        with pytest.raises(ValueError):
            kernels.tree_probe(masses, lp, budgets)


def test_auto_budget_refuses_bad_values(engine) -> None:
    prompts = [[1, 2, 3]]
    for kwargs, message in [({"budget": "automatic"}, "budget"), ({"budget": "auto", "auto_budgets": [8, 8]},
                                                                     "auto_budgets"),
                            ({"budget": "auto", "auto_budgets": [8, 128]}, "auto_budgets"),
                            ({"budget": "auto", "auto_budgets": list(range(1, 10))}, "auto_budgets"),
                            ({"budget": 8, "auto_budgets": [8, 16]}, "budget='auto'"),
                            ({"budget_costs": RISING}, "budget='auto'")]:
        with pytest.raises(RequestError, match=message):
            engine.generate(prompts, 4, **kwargs)
    native = engine.native
    for kwargs, message in [({"auto_budgets": [16, 8]}, "auto budgets"), ({"auto_budgets": [8, 65]}, "auto budgets"),
                            ({"auto_budgets": [8, 16], "cost_streams": [2], "cost_seconds": [[1.0, 1.0]]}, "costs"),
                            ({"auto_budgets": [8, 16], "cost_streams": [1], "cost_seconds": [[1.0]]}, "costs"),
                            ({"auto_budgets": [8, 16], "cost_streams": [1], "cost_seconds": [[1.0, 0.0]]}, "costs"),
                            ({"auto_budgets": [8, 16], "cost_seconds": [[1.0, 1.0]]}, "costs"),
                            ({"cost_streams": [1], "cost_seconds": [[1.0]]}, "costs")]:
        with pytest.raises(ValueError, match=message):
            native.generate_ddtree(prompts, 4, 0.0, 0, 16, **kwargs)
