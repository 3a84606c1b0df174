"""How well the cost model predicts measurements it was not fitted to: the model fitted without one point in three
of each table, then asked for those points (and for every AR step, whose totals it never fits)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from ddtree.estimate.measurements import points
from ddtree.estimate.round_cost import CostModel, Layout, fit

MEASURED_LAYOUT = Layout()


@dataclass(frozen=True)
class Check:
    table: str
    config: str
    measured_ms: float
    predicted_ms: float

    @property
    def error(self) -> float:
        return self.predicted_ms / self.measured_ms - 1


def _rounds(m: CostModel) -> list[Check]:
    return [Check("DDTree round (oracle acceptance)",
                  f"{p['streams']} x budget {p['budget']}, accept {p['mean_accept']:.2f}", p["ms"],
                  m.round(MEASURED_LAYOUT, p["streams"], p["budget"], p["context"], p["mean_accept"]).total)
            for p in points("round", held_out=True)]


def _verifies(m: CostModel) -> list[Check]:
    return [Check("verify forward (eager)", f"{p['streams']} x budget {p['budget']} @ {p['context']}", p["ms"],
                  m.verify_ms(MEASURED_LAYOUT, p["streams"], p["rows"], p["context"],
                              m.routing.active(p["streams"], p["budget"] + 1), eager=True))
            for p in points("verify", held_out=True)]


def _drafts(m: CostModel) -> list[Check]:
    return [Check("draft (eager)", f"{p['layers']} layers, {p['streams']} streams @ {p['context']}", p["ms"],
                  m.draft_ms(MEASURED_LAYOUT, p["streams"], p["context"], p["append_rows"], p["layers"], eager=True))
            for p in points("draft", held_out=True)]


def _ar_steps(m: CostModel) -> list[Check]:
    return [Check("AR step (graph)", f"{p['streams']} streams @ {p['context']}", p["ms"],
                  m.ar_step(MEASURED_LAYOUT, p["streams"], p["context"]).total) for p in points("ar")]


@cache
def checks() -> tuple[Check, ...]:
    m = fit(validation=True)
    return tuple(_rounds(m) + _verifies(m) + _drafts(m) + _ar_steps(m))


def rms(table: str) -> float:
    """RMS relative error of one table's held-out predictions."""
    errors = [c.error for c in checks() if c.table == table]
    return float(np.sqrt(np.mean(np.square(errors))))


ROUND_TABLE = "DDTree round (oracle acceptance)"
AR_TABLE = "AR step (graph)"
