"""What `ddtree-run estimate` accepts, checked once: every fault is a RequestError naming the argument."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from ddtree.errors import RequestError
from ddtree.estimate import shapes
from ddtree.estimate.gpus import GPUS
from ddtree.estimate.measurements import points
from ddtree.estimate.round_cost import Layout
from ddtree.limits import MAX_TREE_BUDGET


@dataclass(frozen=True)
class EstimateRequest:
    layout: Layout
    context: int
    streams: tuple[int, ...]
    budgets: tuple[int, ...]
    mean_accepts: tuple[float, ...]


def _measured_max(kind: str, key: str) -> int:
    return max(p[key] for p in points(kind))


def check_estimate(gpu: str, gpus: int, layers: int, context: int, streams: Sequence[int], budgets: Sequence[int],
                   mean_accepts: Sequence[float]) -> EstimateRequest:
    if gpu not in GPUS:
        raise RequestError(f"--gpu {gpu!r}: not a preset (one of {', '.join(GPUS)})")
    if layers < 2:
        raise RequestError(f"--layers {layers}: a K2 target has a dense first layer and at least one MoE layer (2 or "
                           f"more; K2 has 61)")
    # The layout splits 64 heads and 384 experts evenly.
    if shapes.HEADS % gpus or shapes.EXPERTS % gpus:
        raise RequestError(f"--gpus {gpus}: must divide the {shapes.HEADS} heads and {shapes.EXPERTS} experts "
                           f"(1, 2, 4, 8, 16, 32 or 64)")
    for b in budgets:
        if b > MAX_TREE_BUDGET:
            raise RequestError(f"--budget {b}: at most {MAX_TREE_BUDGET}")
    depth = shapes.DRAFT_BLOCK - 1
    for a in mean_accepts:
        if not math.isfinite(a) or a < 1:
            raise RequestError(f"--mean-accept {a}: tokens committed per round per stream is at least 1 (the bonus "
                               f"token)")
        if a > min(budgets) + 1 or a > depth + 1:
            raise RequestError(f"--mean-accept {a}: a round commits at most min(budget, {depth}) + 1 tokens per "
                               f"stream (block {shapes.DRAFT_BLOCK}), here {min(min(budgets), depth) + 1}")
    # Beyond the measured range the curves extrapolate: say so, once per argument.
    for name, value, limit in (("--streams", max(streams), _measured_max("round", "streams")),
                               ("--budget", max(budgets), _measured_max("round", "budget")),
                               ("--context", context, _measured_max("verify", "context"))):
        if value > limit:
            warnings.warn(f"{name} {value} is beyond the measured {limit}: the curves extrapolate", stacklevel=2)
    return EstimateRequest(Layout(GPUS[gpu], gpus, layers), context, tuple(streams), tuple(budgets),
                           tuple(mean_accepts))
