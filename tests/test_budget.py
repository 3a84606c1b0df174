"""The cost-aware budget ("--budget auto"): the probe and the policy of ddtree.reference.budget (the numpy twin of
runtime/budget_policy and the tree_probe kernel), the C++ policy held to the twin on the host, the reference
backend's auto rounds (tokens equal AR's, greedy and sampled) and the CLI's --budget auto."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ddtree.cli import DEFAULT_MODEL_DIR, main
from ddtree.drafter import make_drafter
from ddtree.errors import RequestError
from ddtree.reference import ReferenceModel, generate
from ddtree.reference.budget import (BudgetPolicy, CostTable, LaggedPolicy, check_candidates, default_candidates,
                                     probe_masses, rows_cost)
from ddtree.reference.drafter import ReferenceDrafter
from ddtree.reference.tree import build_tree

CANDIDATES = (8, 16, 32, 64)


def random_candidates(rng: np.random.Generator, depth: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """One stream's per-depth top-K: log-softmax values of random logits (sorted, <= 0), distinct ids."""
    logits = rng.normal(0, rng.uniform(0.5, 4), (depth, 4 * width))
    lp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    lp = -np.sort(-lp, axis=1)[:, :width].astype(np.float32)
    ids = np.argsort(rng.random((depth, width)), axis=1).astype(np.int64)
    return lp, ids


# ---- the probe ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_probe_masses_are_the_pops_path_probabilities(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lp, ids = random_candidates(rng, int(rng.integers(1, 16)), int(rng.integers(1, 80)))
    masses = probe_masses(lp, ids, CANDIDATES)
    big = build_tree(lp, ids, CANDIDATES[-1])
    for b, mass in zip(CANDIDATES, masses):
        small = build_tree(lp, ids, b)  # a smaller tree is the prefix of the larger one's pops
        assert np.array_equal(small.parents, big.parents[: small.num_nodes + 1])
        assert np.array_equal(small.scores, big.scores[: small.num_nodes])
        assert mass == np.float32(1.0 + np.exp(big.scores[:b]).sum())
    assert np.all(np.diff(masses) >= 0) and masses[0] >= 1


def test_probe_masses_past_the_candidates_hold_the_whole_sum() -> None:
    lp = np.log(np.array([[0.5, 0.3], [0.9, 0.05]], dtype=np.float32))
    ids = np.array([[1, 2], [3, 4]])
    masses = probe_masses(lp, ids, (2, 3, 8))
    paths = [0.5, 0.5 * 0.9, 0.3, 0.3 * 0.9, 0.5 * 0.05, 0.3 * 0.05]  # every path of the 2 x 2 candidates
    np.testing.assert_allclose(masses, [1 + 0.5 + 0.45, 1 + 0.5 + 0.45 + 0.3, 1 + sum(paths)], rtol=1e-6)


def test_default_and_checked_candidates() -> None:
    assert default_candidates(64) == (8, 16, 32, 64)
    assert default_candidates(15) == (8, 15)
    assert default_candidates(7) == (7,)
    assert default_candidates(1024) == (16, 32, 64, 128, 256, 512, 1024)[-8:] or len(default_candidates(1024)) <= 8
    assert check_candidates([4, 9], 16) == (4, 9)
    for bad in ([], [8, 8], [16, 8], [0, 4], [4, 17], list(range(1, 10))):
        with pytest.raises(ValueError):
            check_candidates(bad, 16)


def test_cost_table_interpolates_in_streams() -> None:
    table = CostTable((1, 2, 4), ((1.0, 2.0), (2.0, 3.0), (4.0, 9.0)))
    assert table.at(1, 0) == 1.0 and table.at(3, 0) == 3.0 and table.at(3, 1) == 6.0 and table.at(16, 1) == 9.0
    assert rows_cost((8, 16), 16, streams=2).at(2, 1) == 2 * (16 + 16 + 1)


# ---- the policy on synthetic tables --------------------------------------------------------------------------------

def masses_row(values: list[float]) -> np.ndarray:
    return np.asarray([values], dtype=np.float32)


def test_policy_first_round_runs_the_middle_candidate() -> None:
    policy = BudgetPolicy(CANDIDATES, CostTable((1,), ((1.0, 1.0, 1.0, 1.0),)))
    assert policy.choose(1) == 16
    assert BudgetPolicy((8, 15), CostTable((1,), ((1.0, 1.0),))).choose(4) == 8


def test_policy_follows_cost_and_mass() -> None:
    masses = masses_row([3.0, 3.5, 3.8, 4.0])
    flat = BudgetPolicy(CANDIDATES, CostTable((1,), ((1.0, 1.0, 1.0, 1.0),)))
    flat.observe(masses, [4], 16)
    assert flat.choose(1) == 64  # the same time per round: the largest expected tokens
    steep = BudgetPolicy(CANDIDATES, CostTable((1,), ((1.0, 1.5, 2.0, 3.0),)))
    steep.observe(masses, [4], 16)
    assert steep.choose(1) == 8
    # the cost table depends on the live streams: flat at 1 stream, steep at 4
    table = CostTable((1, 4), ((1.0, 1.01, 1.02, 1.03), (1.0, 2.0, 3.0, 4.0)))
    mixed = BudgetPolicy(CANDIDATES, table)
    mixed.observe(masses, [3], 16)
    assert mixed.choose(1) == 64 and mixed.choose(4) == 8


def test_policy_calibrates_against_observed_accepts() -> None:
    """Predicted extra tokens 3 at budget 16 but only 0.5 observed: the larger trees' promise shrinks with it."""
    costs = CostTable((1,), ((1.0, 1.2, 1.5, 2.0),))
    trusting = BudgetPolicy(CANDIDATES, costs)
    trusting.observe(masses_row([3.0, 4.0, 6.0, 9.0]), [4], 16)
    assert trusting.ratio(1) == pytest.approx(1.0) and trusting.choose(1) == 64
    sceptical = BudgetPolicy(CANDIDATES, costs)
    sceptical.observe(masses_row([3.0, 4.0, 6.0, 9.0]), [1], 16)
    assert sceptical.ratio(1) == 0.0 and sceptical.choose(1) == 8
    # a candidate not yet run: the calibration of the largest smaller one run, else the expectation of the smallest
    # larger one run (an upper bound), so that each gets tried when it might pay
    policy = BudgetPolicy(CANDIDATES, costs)
    policy.observe(masses_row([2.0, 3.0, 4.0, 5.0]), [2], 8)
    policy.observe(masses_row([2.0, 3.0, 4.0, 5.0]), [4], 64)
    assert policy.ratio(0) == pytest.approx(1.0) and policy.ratio(3) == pytest.approx(0.75)
    assert [policy.expected_per_stream(c) for c in range(4)] == pytest.approx([2.0, 3.0, 4.0, 4.0])
    above = BudgetPolicy(CANDIDATES, costs)
    above.observe(masses_row([2.0, 3.0, 4.0, 5.0]), [3], 32)
    assert [above.expected_per_stream(c) for c in range(4)] == pytest.approx([3.0, 3.0, 3.0, 1 + 8 / 3])
    assert above.choose(1) == 8  # an accept curve as flat as the probe allows: the cheapest tree is tried


def test_policy_leaves_out_finished_streams_and_smooths() -> None:
    policy = BudgetPolicy(CANDIDATES, CostTable((1,), ((1.0, 1.0, 1.0, 1.0),)))
    rows = np.asarray([[2.0, 2.0, 2.0, 2.0], [9.0, 9.0, 9.0, 9.0]], dtype=np.float32)
    policy.observe(rows, [2, 9], 8, skip=[False, True])
    assert policy.mass == [1.0] * 4 and policy.observed[0] == 1.0
    policy.observe(rows[:1] + 4, [2], 8)
    assert policy.mass[0] == pytest.approx(1.0 + 0.25 * (5.0 - 1.0))
    policy.observe(rows[:0], [], 8)  # no stream: nothing changes
    assert policy.mass[0] == pytest.approx(2.0)
    policy.observe(np.full((1, 4), np.nan, dtype=np.float32), [5], 8)  # a non-finite row: left out
    assert policy.mass[0] == pytest.approx(2.0) and policy.observed[0] == pytest.approx(1.0)


def test_lagged_policy_reads_a_round_late() -> None:
    lagged = LaggedPolicy(BudgetPolicy(CANDIDATES, CostTable((1,), ((1.0, 1.0, 1.0, 1.0),))))
    first = [lagged.next_budget(), lagged.next_budget()]
    lagged.finished_round(np.asarray([2.0, 3.0, 4.0, 5.0], dtype=np.float32), 5, first[0])
    assert lagged.next_budget() == 16  # round 0 not read yet
    lagged.finished_round(np.asarray([2.0, 3.0, 4.0, 5.0], dtype=np.float32), 5, first[1])
    assert lagged.next_budget() == 64 and lagged.budgets == [16, 16, 16, 64]


def twin_choices(candidates, table: CostTable, rounds) -> list[int]:
    policy = BudgetPolicy(tuple(candidates), table)
    out = [policy.choose(rounds[0][4] if rounds else 1)]
    for masses, accepts, skip, used, live in rounds:
        policy.observe(np.asarray(masses, dtype=np.float32).reshape(len(accepts), -1), accepts, used,
                       [bool(s) for s in skip])
        out.append(policy.choose(live))
    return out


def test_native_policy_equals_the_twin() -> None:
    native = pytest.importorskip("ddtree._native", exc_type=ImportError)
    rng = np.random.default_rng(7)
    for case in range(40):
        count = int(rng.integers(1, 6))
        candidates = sorted(rng.choice(np.arange(1, 129), count, replace=False).tolist())
        streams = sorted(set([1] + rng.integers(2, 17, int(rng.integers(0, 3))).tolist()))
        table = CostTable(tuple(streams), tuple(tuple(float(x) for x in rng.uniform(0.5, 3.0, count))
                                                for _ in streams))
        rounds = []
        for _ in range(int(rng.integers(0, 25))):
            rows = int(rng.integers(1, 5))
            masses = np.sort(1 + rng.exponential(2.0, (rows, count)), axis=1).astype(np.float32)
            if rng.random() < 0.15:  # a drafter's NaN: that row is left out on both sides
                masses[rng.integers(rows), rng.integers(count)] = np.nan
            rounds.append((masses.ravel().tolist(), rng.integers(1, 9, rows).tolist(),
                           (rng.random(rows) < 0.2).astype(int).tolist(),
                           int(rng.choice(candidates + [candidates[-1] + 1])), int(rng.integers(1, 17))))
        expected = twin_choices(candidates, table, rounds)
        got = native.budget_policy_choices(candidates, list(table.streams), [list(r) for r in table.seconds],
                                           [r[0] for r in rounds], [r[1] for r in rounds], [r[2] for r in rounds],
                                           [r[3] for r in rounds], [r[4] for r in rounds])
        assert got == expected, f"case {case}"


# ---- the reference backend ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[ReferenceModel, ReferenceDrafter]:
    drafter_dir = tmp_path_factory.mktemp("tiny_drafter_budget")
    model = ReferenceModel.load(tiny_model_dir)
    make_drafter(model.config, drafter_dir, seed=1, preset="tiny")
    return model, ReferenceDrafter.for_model(drafter_dir, model)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_reference_auto_budget_equals_ar(tiny, temperature: float) -> None:
    model, drafter = tiny
    for prompt in ([1, 17, 300, 5, 42], [7, 7, 7, 200]):
        ar = generate(model, None, prompt, 20, temperature=temperature, seed=3)
        auto = generate(model, drafter, prompt, 20, method="ddtree", budget="auto", temperature=temperature, seed=3)
        assert auto.tokens == ar.tokens
        assert len(auto.budgets) == len(auto.accept_lengths) and set(auto.budgets) <= set(CANDIDATES)
    fixed = generate(model, drafter, [1, 2, 3], 8, method="ddtree", budget=4)
    assert fixed.budgets == [4] * len(fixed.accept_lengths)


def test_reference_auto_budget_on_the_demo_pair_adapts() -> None:
    """The demo drafter accepts well: after the first rounds the policy leaves the middle candidate."""
    model = ReferenceModel.load(DEFAULT_MODEL_DIR)
    drafter = ReferenceDrafter.for_model(DEFAULT_MODEL_DIR / "drafter", model)
    prompt = "def fibonacci(n):"
    ar = generate(model, None, prompt, 40)
    auto = generate(model, drafter, prompt, 40, method="ddtree", budget="auto")
    assert auto.tokens == ar.tokens
    assert auto.budgets[:2] == [16, 16] and 8 in auto.budgets[2:]  # rows cost: the smallest tree pays here
    assert sum(auto.accept_lengths) >= len(auto.tokens) - 1


def test_reference_rejects_bad_budgets(tiny) -> None:
    model, drafter = tiny
    for bad in ("automatic", -1, 1.5, "8"):
        with pytest.raises(RequestError, match="budget"):
            generate(model, drafter, [1, 2, 3], 4, method="ddtree", budget=bad)
    with pytest.raises(RequestError, match="budget"):
        generate(model, None, [1, 2, 3], 4, budget="auto")


# ---- the CLI --------------------------------------------------------------------------------------------------------

def test_cli_generate_budget_auto_on_the_reference(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    drafter_dir = tmp_path / "drafter"
    make_drafter(ReferenceModel.load(tiny_model_dir).config, drafter_dir, seed=1, preset="tiny")
    code = main(["generate", "--model", str(tiny_model_dir), "--drafter", str(drafter_dir), "--prompt-ids", "1,2,3",
                 "-n", "6", "--method", "ddtree", "--budget", "auto", "--backend", "reference", "--json"])
    assert code == 0
    stream = json.loads(capsys.readouterr().out)["streams"][0]
    assert set(stream["budgets"]) <= set(CANDIDATES) and len(stream["budgets"]) == len(stream["accept_lengths"])


@pytest.mark.parametrize("bad", ["0", "auto8", "-3", "Auto "])
def test_cli_budget_auto_parsing(bad: str, capsys) -> None:
    code = main(["generate", "--prompt-ids", "1,2", "--method", "ddtree", "--budget", bad, "--backend", "reference"])
    assert code == 2
    assert "--budget" in capsys.readouterr().err


def test_cli_bench_takes_budget_auto(capsys) -> None:
    """bench parses 'auto' among its budgets and checks the rest before it needs a device (status 3 here)."""
    from ddtree.bench.sweep import BenchRequest

    req = BenchRequest((1,), (8, "auto"), (16,), (), 8)
    assert req.max_budget == 8 and BenchRequest((1,), ("auto",), (16,), (), 8).max_budget == 64
    code = main(["bench", "--budget", "8", "auto", "--streams", "1", "--context", "16", "-n", "8"])
    assert code in (0, 3)


# ---- tools/bench_budget.py's report (its GPU runs are the lead's) ---------------------------------------------------

def test_bench_budget_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    import sys

    tools = Path(__file__).resolve().parent.parent / "tools"
    monkeypatch.syspath_prepend(str(tools))
    spec = importlib.util.spec_from_file_location("bench_budget", tools / "bench_budget.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_budget", bench)  # its dataclass looks its module up
    spec.loader.exec_module(bench)
    assert len(bench.held_out_prompts(8)) == 8 and all(len(p) == bench.PROMPT for p in bench.held_out_prompts(8))
    rows = []
    for streams in (1, 4):
        rows.append({"workload": "demo", "streams": streams, "profile": None, "budget": "ar",
                     "tokens_per_s": 100.0, "mean_accept": 1.0, "budget_rounds": {}, "exact": True})
        for budget, rate in zip(bench.FIXED + ("auto",), (150.0, 170.0, 160.0, 120.0, 175.0)):
            rows.append({"workload": "demo", "streams": streams, "profile": None, "budget": budget,
                         "tokens_per_s": rate / streams, "mean_accept": 2.5,
                         "budget_rounds": {"16": 30, "8": 4} if budget == "auto" else {str(budget): 34},
                         "exact": True})
    summary = bench.summarize(rows)
    assert [s["best_fixed"] for s in summary] == [16, 16]
    assert summary[0]["auto_over_best"] == pytest.approx(175 / 170)
    report = {"model": "test", "device": "none", "copy_bandwidth_gbs": 1.0, "prompt": 128, "new_tokens": 128,
              "rows": rows, "summary": summary}
    bench.write_reports(tmp_path, report)
    text = (tmp_path / "budget.md").read_text()
    assert "| demo | 4 | - | 100 | 38 | 42 | 40 | 30 | 16 | 44 | 1.03 | 16: 30, 8: 4 |" in text
    assert "auto within 2% of the best fixed budget or above it in 2 of 2" in text
    assert json.loads((tmp_path / "budget.json").read_text())["summary"] == summary
    assert (tmp_path / "budget.png").is_file() or bench_report_has_no_matplotlib()


def bench_report_has_no_matplotlib() -> bool:
    from ddtree.bench.report import pyplot

    return pyplot() is None
