"""Projected tokens/s of DDTree rounds and AR steps for a GPU, a layout and acceptance profiles, each with its
uncertainty: the held-out RMS error of the measured rounds (or AR steps), the GPU's transfer uncertainty, and the
unmeasured collectives' share, added in quadrature."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ddtree.estimate import shapes
from ddtree.estimate.gpus import GpuSpec
from ddtree.estimate.round_cost import COLLECTIVE_SIGMA, Breakdown, Layout, fitted
from ddtree.estimate.validation import AR_TABLE, ROUND_TABLE, rms


@dataclass(frozen=True)
class Projection:
    gpu: str
    gpus: int
    layers: int
    context: int
    streams: int
    budget: int
    mean_accept: float
    round_ms: float
    round_sigma: float  # relative
    tokens_per_s: float
    ar_step_ms: float
    ar_sigma: float
    ar_tokens_per_s: float
    verify_ms: float
    draft_ms: float
    fixed_ms: float  # tree kernels and the per-round terms
    collectives_ms: float
    weights_gb_per_gpu: float
    fits_in_memory: bool

    @property
    def speedup(self) -> float:
        return self.tokens_per_s / self.ar_tokens_per_s

    def as_dict(self) -> dict:
        return {**asdict(self), "speedup": self.speedup}


def _sigma(b: Breakdown, measured: float, gpu: GpuSpec) -> float:
    collectives = COLLECTIVE_SIGMA * b.collectives / b.total
    return math.sqrt(measured ** 2 + gpu.transfer_uncertainty ** 2 + collectives ** 2)


def project(lay: Layout, context: int, streams: int, budget: int, mean_accept: float) -> Projection:
    """`mean_accept`: tokens committed per round per stream (accepted nodes + the bonus token)."""
    model = fitted()
    b = model.round(lay, streams, budget, context, mean_accept)
    ar = model.ar_step(lay, streams, context)
    weights = shapes.target_weight_bytes(lay.layers, lay.gpus) + shapes.drafter_weight_bytes(lay.gpus)
    return Projection(lay.gpu.name, lay.gpus, lay.layers, context, streams, budget, mean_accept, b.total,
                      _sigma(b, rms(ROUND_TABLE), lay.gpu), streams * mean_accept / b.total * 1e3, ar.total,
                      _sigma(ar, rms(AR_TABLE), lay.gpu), streams / ar.total * 1e3, b.scale * b.verify,
                      b.scale * b.draft, b.tree + b.per_round, b.collectives, weights / 1e9,
                      weights < lay.gpu.memory_bytes)
