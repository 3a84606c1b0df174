"""tools/bench_ranksim.py --from-json: a committed rank-simulation measurement projected again with the current cost
model, on a machine without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "bench" / "results" / "multigpu" / "ranksim.json"


def _rounded(value):
    """`value` with every float to 9 significant digits: the model's least-squares fit may differ in the last bits
    across BLAS builds."""
    if isinstance(value, float):
        return float(f"{value:.9g}")
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def test_projects_a_committed_measurement_again(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_ranksim.py"), "--from-json", str(COMMITTED),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "ranksim.json").read_text())
    committed = json.loads(COMMITTED.read_text())
    assert report["measured"] == committed["measured"] and report["rounds"] == committed["rounds"]
    assert _rounded(report["projection"]) == _rounded(committed["projection"]), \
        "rerun tools/bench_ranksim.py --from-json on the committed report: the cost model changed"
    for p in report["projection"]:
        assert p["ar_step_ms"] > p["ar_collectives_ms"] > 0
        assert [d["budget"] for d in p["ddtree"]] == [8, 32]
        assert all(d["round_ms"] > d["collectives_ms"] > 0 and d["model_rank_round_ms"] > 0 for d in p["ddtree"])
    text = (tmp_path / "ranksim.md").read_text()
    assert "## 8 x H200 projection" in text and "held out" in text
