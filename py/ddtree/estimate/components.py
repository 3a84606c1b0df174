"""Component curves: each part of a round is a few terms of known work (calls, bytes over the bandwidth, FLOPs over
the tensor rate) times fitted coefficients (microseconds per call, 1 / efficiency), fitted by non-negative least
squares on relative error to the measured H200 points. Work terms scale with the GPU (bandwidth, tensor rate, SM
count) and with the G-GPU layout of `shapes`; the per-call times are latencies, kept as measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ddtree.estimate import shapes
from ddtree.estimate.gpus import H200_TENSOR_FLOPS, MEASURED, GpuSpec
from ddtree.estimate.measurements import points
from ddtree.estimate.nnls import nnls

US = 1e-3  # one microsecond in ms: a per-call term counts calls in microseconds
Features = Callable[[dict, GpuSpec, int], list[float]]


def _bytes_ms(nbytes: float, gpu: GpuSpec) -> float:
    return nbytes / gpu.bytes_per_s * 1e3


def _flops_ms(flops: float, gpu: GpuSpec) -> float:
    return flops / gpu.tensor_flops * 1e3


def gemm_features(p: dict, gpu: GpuSpec, gpus: int) -> list[float]:
    """Our bf16 GEMM (kernels/gemm.cu): a fixed cost per call (more when timed alone between events), the weights
    read once, and a row term by row range (1-16 and 17-32 rows run different tiles, every token in one CTA).
    Above 32 rows a CTA takes 64 tokens per pass, reading the weights again per pass, and every warp sharing a
    token fragment re-reads it from shared memory (bench/results/engine/NOTES.md): those terms run far below the
    tensor rate and scale with the SM count, not with the tensor rate; each pass has a latency of its own, which
    dominates the small shapes (q_a+kv_a, q_b, shared down) at verify sizes. The kv_b absorbs (K <= 128) have
    their own kernel, hence their own row term."""
    g = shapes.GEMMS[p["op"]]
    n, rows, w = p["calls"], p["rows"], g.weight_bytes(gpus)
    flops = rows * w  # 2 FLOPs per weight (w / 2 weights) per row
    up_to_16 = flops if rows <= 16 else 0.0
    up_to_32 = flops if 16 < rows <= 32 else 0.0
    passes = -(-rows // 64) if rows > 32 else 0
    large = flops - up_to_16 - up_to_32
    absorb = g.name.startswith("kv_b_absorb")
    per_sm = 1e3 / H200_TENSOR_FLOPS * MEASURED.sms / gpu.sms
    return [n * US, n * US * p.get("eager", False), n * _bytes_ms(w, gpu), n * _flops_ms(up_to_16, gpu),
            n * _flops_ms(up_to_32, gpu), 0.0 if absorb else n * passes * 64 * w * per_sm,
            0.0 if absorb else n * large * per_sm, n * large * per_sm if absorb else 0.0, n * passes * US]


def _per_launch(p: dict) -> list[float]:
    """A fixed cost per layer, and its excess when each launch is timed alone between events."""
    return [p["layers"] * US, p["layers"] * US * p.get("eager", False)]


def moe_features(p: dict, gpu: GpuSpec, gpus: int) -> list[float]:
    """The fused INT4 MoE per layer: a fixed cost, each touched expert's bytes once, and its token-expert FLOPs."""
    layers = p["layers"]
    return [*_per_launch(p), layers * _bytes_ms(p["active"] / gpus * shapes.EXPERT_BYTES, gpu),
            layers * _flops_ms(p["rows"] * shapes.TOPK * shapes.EXPERT_FLOPS_PER_TOKEN / gpus, gpu)]


def attention_features(p: dict, gpu: GpuSpec, gpus: int) -> list[float]:
    """Tree-masked MLA per layer: a fixed cost, each stream's latent KV read once (not split by heads), and the
    FLOPs of every row over its keys (heads split G ways)."""
    layers, context = p["layers"], p["context"]
    return [*_per_launch(p), layers * _bytes_ms(p["streams"] * context * shapes.LATENT_ROW_BYTES, gpu),
            layers * _flops_ms(p["rows"] * context * shapes.ATTENTION_FLOPS_PER_KEY / gpus, gpu)]


def draft_attention_features(p: dict, gpu: GpuSpec, gpus: int) -> list[float]:
    """The drafter's GQA block attention per layer: each stream's draft KV once and the block rows over the
    context and the block (KV heads split G ways)."""
    layers, keys = p["layers"], p["context"] + shapes.DRAFT_BLOCK
    return [*_per_launch(p), layers * _bytes_ms(p["streams"] * keys * shapes.DRAFT_KV_ROW_BYTES / gpus, gpu),
            layers * _flops_ms(p["rows"] * keys * shapes.DRAFT_ATTENTION_FLOPS_PER_KEY / gpus, gpu)]


def small_op_features(p: dict, gpu: GpuSpec, gpus: int) -> list[float]:
    """Norms, RoPE, KV stores, embedding, router and sampling: latency-bound launches, a cost per layer and per
    row, kept as measured on every GPU."""
    return [p["layers"] * US, p["layers"] * p["rows"] * US]


@dataclass(frozen=True)
class Curve:
    """One component: its feature function, the coefficients fitted to its points, and `sigma`, the RMS relative
    error of a fit without the held-out points (one in three) on those points."""

    name: str
    features: Features
    coef: np.ndarray
    sigma: float

    def ms(self, p: dict, gpu: GpuSpec = MEASURED, gpus: int = 1) -> float:
        return float(np.dot(self.features(p, gpu, gpus), self.coef))


def fit_coef(features: Features, pts: list[dict]) -> np.ndarray:
    a = np.array([features(p, MEASURED, 1) for p in pts])
    ms = np.array([p["ms"] for p in pts])
    return nnls(a / ms[:, None], np.ones(len(pts)))


def relative_errors(features: Features, coef: np.ndarray, pts: list[dict]) -> np.ndarray:
    """(predicted - measured) / measured."""
    return np.array([np.dot(features(p, MEASURED, 1), coef) / p["ms"] - 1 for p in pts])


def fit_curve(name: str, features: Features, kind: str, *, validation: bool = False) -> Curve:
    """The curve of `kind` points: fitted on all of them, or only on those not held out if `validation`; sigma
    always from the fit without the held-out points."""
    train = points(kind, held_out=False)
    held = points(kind, held_out=True)
    coef_train = fit_coef(features, train)
    sigma = float(np.sqrt(np.mean(relative_errors(features, coef_train, held) ** 2))) if held else 0.0
    coef = coef_train if validation else fit_coef(features, train + held)
    return Curve(name, features, coef, sigma)


@dataclass(frozen=True)
class Routing:
    """Experts a layer touches for a verify of `streams` trees of `nodes` nodes: uniform top-8 routing of an
    effective number of independent rows a * streams^g * nodes^b (fitted on the verify benchmark's own routing;
    tree nodes and streams of related tokens share experts), never more rows than there are."""

    a: float
    g: float
    b: float
    sigma: float

    def active(self, streams: int, nodes: int) -> float:
        rows = min(self.a * streams ** self.g * nodes ** self.b, streams * nodes)
        return shapes.EXPERTS * (1 - (1 - shapes.TOPK / shapes.EXPERTS) ** rows)


def _effective_rows(active: float) -> float:
    return float(np.log1p(-active / shapes.EXPERTS) / np.log1p(-shapes.TOPK / shapes.EXPERTS))


def _routing_coef(pts: list[dict]) -> np.ndarray:
    a = np.array([[1.0, np.log(p["streams"]), np.log(p["nodes"])] for p in pts])
    y = np.array([np.log(_effective_rows(p["active"])) for p in pts])
    return np.linalg.lstsq(a, y, rcond=None)[0]


def fit_routing(*, validation: bool = False) -> Routing:
    train, held = points("routing", held_out=False), points("routing", held_out=True)
    c = _routing_coef(train)
    probe = Routing(float(np.exp(c[0])), float(c[1]), float(c[2]), 0.0)
    sigma = float(np.sqrt(np.mean([(probe.active(p["streams"], p["nodes"]) / p["active"] - 1) ** 2 for p in held])))
    c = c if validation else _routing_coef(train + held)
    return Routing(float(np.exp(c[0])), float(c[1]), float(c[2]), sigma)


@dataclass(frozen=True)
class TreeKernels:
    """Build + accept + commit (with taps) per round, interpolated from the GPU tree benchmark in budget and
    log(streams): microseconds, latency-bound, kept as measured on every GPU."""

    budgets: np.ndarray
    streams: np.ndarray
    ms: np.ndarray  # [streams, budgets]

    def cost(self, streams: int, budget: int) -> float:
        per_streams = [np.interp(budget, self.budgets, row) for row in self.ms]
        return float(np.interp(np.log(streams), np.log(self.streams), per_streams))


def tree_kernels() -> TreeKernels:
    pts = points("tree")
    budgets = np.array(sorted({p["budget"] for p in pts}), dtype=float)
    streams = np.array(sorted({p["streams"] for p in pts}), dtype=float)
    ms = np.array([[next(p["ms"] for p in pts if p["budget"] == b and p["streams"] == s) for b in budgets]
                   for s in streams])
    return TreeKernels(budgets, streams, ms)
