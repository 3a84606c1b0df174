"""The cost model behind `ddtree-run estimate`: it reproduces its fitting points, predicts held-out measurements
within the issue's 15%, scales as its layout says, and the CLI prints a table, JSON, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ddtree.estimate import GPUS, Layout, project
from ddtree.estimate.gpus import H200_COPY_BYTES_PER_S, MEASURED
from ddtree.estimate.measurements import POINTS_FILE, points
from ddtree.estimate.nnls import nnls
from ddtree.estimate.round_cost import fitted
from ddtree.estimate.validation import checks

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    # A wide terminal keeps rich's table on one line per row.
    return subprocess.run([sys.executable, "-m", "ddtree.cli", "estimate", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "250"})


def test_points_file_matches_the_committed_reports() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import estimate_report
    finally:
        sys.path.pop(0)
    assert estimate_report.collect() == json.loads(POINTS_FILE.read_text())["points"], \
        "rerun tools/estimate_report.py: bench/results changed"


def test_rounds_reproduce_their_fitting_points() -> None:
    m, lay = fitted(), Layout()
    for p in points("round"):
        predicted = m.round(lay, p["streams"], p["budget"], p["context"], p["mean_accept"]).total
        assert predicted == pytest.approx(p["ms"], rel=0.10), p


def test_curves_reproduce_their_fitting_points() -> None:
    m = fitted()
    for curve, kind in ((m.gemm, "gemm"), (m.moe, "moe"), (m.attention, "attention"), (m.small_ops, "misc"),
                        (m.draft_attention, "draft_attention"), (m.draft_small_ops, "draft_misc")):
        errors = np.array([curve.ms(p) / p["ms"] - 1 for p in points(kind)])
        assert np.sqrt(np.mean(errors ** 2)) < 0.2, curve.name


def test_held_out_predictions_within_15_percent() -> None:
    for c in checks():
        assert abs(c.error) <= 0.15, c


def test_nnls_keeps_coefficients_non_negative() -> None:
    rng = np.random.default_rng(0)
    a = rng.uniform(0.1, 1.0, (40, 4))
    truth = np.array([2.0, 0.0, 0.5, 3.0])
    x = nnls(a, a @ truth)
    np.testing.assert_allclose(x, truth, atol=1e-9)
    x = nnls(a, -a[:, 0])  # best non-negative fit of a negative target: all zero
    assert (x >= 0).all() and np.allclose(x, 0)


def test_presets() -> None:
    assert MEASURED is GPUS["h200"] and MEASURED.bytes_per_s == pytest.approx(H200_COPY_BYTES_PER_S)
    assert set(GPUS) == {"h100", "h200", "b200", "b300"}
    assert GPUS["h100"].bytes_per_s < GPUS["h200"].bytes_per_s < GPUS["b200"].bytes_per_s
    assert GPUS["b300"].sms > GPUS["b200"].sms > GPUS["h200"].sms
    assert MEASURED.transfer_uncertainty == 0 and all(g.transfer_uncertainty > 0 for k, g in GPUS.items()
                                                      if k != "h200")
    # More bandwidth, tensor rate or SMs never make a round slower.
    rounds = [project(Layout(GPUS[k], 8, 61), 1024, 16, 32, 4.0).round_ms for k in ("h100", "h200", "b200", "b300")]
    assert rounds == sorted(rounds, reverse=True)


def test_round_cost_is_affine_in_layers() -> None:
    m = fitted()

    def total(layers: int) -> float:
        return m.round(Layout(MEASURED, 8, layers), 4, 32, 1024, 3.0).total

    assert total(62) - total(32) == pytest.approx(total(32) - total(2), rel=1e-9)


def test_projection_reports_its_parts() -> None:
    p = project(Layout(MEASURED, 1, 4), 176, 16, 64, 7.11)
    assert p.tokens_per_s == pytest.approx(16 * 7.11 / p.round_ms * 1e3)
    assert p.collectives_ms == 0 and p.round_sigma > 0 and p.fits_in_memory
    assert p.verify_ms + p.draft_ms + p.fixed_ms == pytest.approx(p.round_ms)
    full = project(Layout(MEASURED, 1, 61), 1024, 1, 8, 3.0)
    assert not full.fits_in_memory  # about 600 GB of K2 on one H200
    spread = project(Layout(MEASURED, 8, 61), 1024, 1, 8, 3.0)
    assert spread.fits_in_memory and spread.collectives_ms > 0 and spread.round_sigma > p.round_sigma


def test_cli_table() -> None:
    proc = _cli("--gpu", "b300", "--streams", "1", "16", "--budget", "8", "--mean-accept", "4")
    assert proc.returncode == 0, proc.stderr
    assert "B300 x 8, K2 target of 61 layers" in proc.stdout
    assert "DDTree tok/s" in proc.stdout and "±" in proc.stdout
    assert "25% for kernels measured on another GPU" in proc.stdout


def test_cli_json() -> None:
    proc = _cli("--gpus", "1", "--layers", "4", "--context", "176", "--streams", "4", "--budget", "8", "32",
                "--mean-accept", "2", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["gpu"] == "H200" and doc["layers"] == 4 and len(doc["projections"]) == 4
    for row in doc["projections"]:
        assert row["tokens_per_s"] == pytest.approx(row["streams"] * row["mean_accept"] / row["round_ms"] * 1e3)
    assert 0 < doc["held_out_rms"]["round"] < 0.15


@pytest.mark.parametrize("args,needle", [
    (("--gpu", "a100"), "--gpu"),
    (("--gpus", "3"), "--gpus 3"),
    (("--layers", "1"), "--layers 1"),
    (("--budget", "4096"), "--budget 4096"),
    (("--mean-accept", "9"), "--mean-accept 9"),
    (("--budget", "2", "--mean-accept", "4"), "--mean-accept 4"),
    (("--mean-accept", "0.5"), "--mean-accept 0.5"),
    (("--mean-accept", "inf"), "--mean-accept"),
    (("--streams", "0"), "--streams"),
])
def test_cli_bad_arguments_are_one_line(args: tuple[str, ...], needle: str) -> None:
    proc = _cli(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "ddtree-run: error:" in lines[0] and needle in lines[0], proc.stderr


def test_cli_warns_beyond_the_measured_range() -> None:
    proc = _cli("--streams", "64", "--budget", "8", "--mean-accept", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "ddtree-run: warning: --streams 64 is beyond the measured 16: the curves " \
                                  "extrapolate"


def test_gathered_collectives_count_two_per_layer_and_the_pick() -> None:
    from ddtree.estimate.round_cost import COLLECTIVE_LATENCY_MS, fitted

    model = fitted()
    assert model.gathered_collectives_ms(Layout(GPUS["h200"], 1, 61), 16) == 0.0
    one_row = model.gathered_collectives_ms(Layout(GPUS["h200"], 8, 61), 1)
    assert (2 * 61 + 1) * COLLECTIVE_LATENCY_MS < one_row < (2 * 61 + 1) * COLLECTIVE_LATENCY_MS * 1.1
    assert model.gathered_collectives_ms(Layout(GPUS["h200"], 8, 61), 16) > one_row


def test_the_layout_is_the_runtimes() -> None:
    """The drafter whole on every GPU (with the whole LM head of its own when the target's is split), and the
    target's collectives gathered, as runtime/shard.h and runtime/collectives.h run them."""
    from ddtree.estimate import shapes
    from ddtree.estimate.round_cost import fitted

    model = fitted()
    one, eight = (model.round(Layout(MEASURED, gpus, 61), 4, 8, 1024, 3.0) for gpus in (1, 8))
    assert one.draft == eight.draft and one.collectives == 0.0
    assert eight.collectives == model.gathered_collectives_ms(Layout(MEASURED, 8, 61), 4 * 9)
    assert shapes.drafter_weight_bytes(8) == shapes.drafter_weight_bytes(1) + shapes.LM_HEAD.weight_bytes(1)
