"""The measured H200 points the cost model fits to, shipped with the package (tools/estimate_report.py writes them
from the committed bench/results reports)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

POINTS_FILE = Path(__file__).resolve().parent / "h200_points.json"


@cache
def _load() -> tuple[dict, ...]:
    return tuple(json.loads(POINTS_FILE.read_text())["points"])


def points(kind: str, *, held_out: bool | None = None) -> list[dict]:
    """The points of one kind (gemm, moe, attention, misc, draft_attention, draft_misc, routing, tree, verify, draft,
    ar, round, round_stages); only those held out of (True) or kept for (False) the validation fit if asked."""
    return [p for p in _load() if p["kind"] == kind and (held_out is None or p["held_out"] == held_out)]
