"""A DDTree round and an AR step composed from the component curves, on a G-GPU layout of a target of L layers.

Round = k * (verify forward + draft) + tree kernels + per-round terms + collectives, where the verify forward holds
streams x (budget + 1) rows and the draft a block of 8 rows per stream, an LM head over 7 of them and the append of
the accepted rows. k (the replayed graph against the sum of the kernels alone: the shared expert runs beside the
routed experts, dependent launches overlap ramps) and the per-round terms (the drafter's per-depth top-K over the
vocabulary, a cost per round and per draft row; never measured alone above one stream) are fitted on the DDTree
round benchmark's rows.

On G > 1 GPUs the layout is the runtime's (runtime/shard.h, runtime/collectives.h): the target split, its
collectives gathered (gathered_collectives_ms; latency and NVLink bytes, not measured yet: issue 27), and the
drafter whole on every GPU with the target's whole lm_head of its own, so a draft costs what it costs on one GPU
and needs no collective.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import numpy as np

from ddtree.estimate import components as c
from ddtree.estimate import shapes
from ddtree.estimate.gpus import MEASURED, GpuSpec
from ddtree.estimate.measurements import points
from ddtree.estimate.nnls import nnls

COLLECTIVE_LATENCY_MS = 0.010  # per collective inside a graph (assumption; issue 27 measures it)
COLLECTIVE_SIGMA = 0.5  # relative uncertainty of the collective costs, unmeasured
BENCH_LAYERS = 4  # the measured k2-layers models: 1 dense + 3 MoE layers


@dataclass(frozen=True)
class Layout:
    """Where a round runs: `gpus` GPUs of one kind for a target of `layers` layers (1 dense, the rest MoE)."""

    gpu: GpuSpec = MEASURED
    gpus: int = 1
    layers: int = BENCH_LAYERS


@dataclass(frozen=True)
class Breakdown:
    """ms per round (or AR step) by part, per GPU."""

    verify: float
    draft: float
    tree: float
    per_round: float
    collectives: float
    scale: float

    @property
    def total(self) -> float:
        return self.scale * (self.verify + self.draft) + self.tree + self.per_round + self.collectives


@dataclass(frozen=True)
class CostModel:
    gemm: c.Curve
    moe: c.Curve
    attention: c.Curve
    small_ops: c.Curve
    draft_attention: c.Curve
    draft_small_ops: c.Curve
    routing: c.Routing
    tree: c.TreeKernels
    round_coef: np.ndarray  # k, per-round ms, per-draft-row ms

    def _gemm(self, op: shapes.Gemm, rows: int, calls: int, lay: Layout, eager: bool) -> float:
        return self.gemm.ms({"op": op.name, "rows": rows, "calls": calls, "eager": eager}, lay.gpu, lay.gpus)

    def verify_ms(self, lay: Layout, streams: int, rows: int, context: int, active: float,
                  eager: bool = False) -> float:
        """The target forward over `rows` rows of `streams` streams at `context` keys, `active` experts touched
        per MoE layer; no collectives."""
        dense = sum(self._gemm(g, rows, calls, lay, eager) for g, calls in shapes.target_gemm_calls(lay.layers))
        moe = self.moe.ms({"rows": rows, "active": active, "layers": lay.layers - 1, "eager": eager},
                          lay.gpu, lay.gpus)
        attention = self.attention.ms({"streams": streams, "rows": rows, "context": context, "layers": lay.layers,
                                       "eager": eager}, lay.gpu, lay.gpus)
        small = self.small_ops.ms({"rows": rows, "layers": lay.layers}, lay.gpu, lay.gpus)
        return dense + moe + attention + small

    def draft_ms(self, lay: Layout, streams: int, context: int, append_rows: int,
                 draft_layers: int = shapes.DRAFT_LAYERS, eager: bool = False) -> float:
        """One draft: the append of `append_rows` context rows, the block forward of 8 rows per stream and the LM
        head over 7 of them, by a drafter whole on the GPU whatever the layout's count."""
        lay = replace(lay, gpus=1)
        block = streams * shapes.DRAFT_BLOCK
        gemms = sum(self._gemm(g, block, draft_layers, lay, eager)
                    for g in (shapes.DRAFT_QKV, shapes.DRAFT_O, shapes.DRAFT_GATE_UP, shapes.DRAFT_DOWN))
        gemms += self._gemm(shapes.DRAFT_FC, append_rows, 1, lay, eager)
        gemms += self._gemm(shapes.DRAFT_KV_PROJ, append_rows, draft_layers, lay, eager)
        gemms += self._gemm(shapes.LM_HEAD, streams * (shapes.DRAFT_BLOCK - 1), 1, lay, eager)
        attention = self.draft_attention.ms({"streams": streams, "rows": block, "context": context,
                                             "layers": draft_layers, "eager": eager}, lay.gpu, lay.gpus)
        small = self.draft_small_ops.ms({"rows": block, "layers": draft_layers}, lay.gpu, lay.gpus)
        return gemms + attention + small

    @staticmethod
    def gathered_collectives_ms(lay: Layout, rows: int) -> float:
        """The target forward's collectives as the runtime implements them (runtime/collectives.h): per layer,
        every rank's bf16 partials all-gathered and added locally in rank order, one term after attention, one
        after a dense MLP and two (shared, routed experts) after a MoE MLP, each GPU receiving (G-1) x terms x rows
        x hidden x 2 bytes; and the pick of the vocabulary-split LM head, (G-1) x rows x 8 bytes; each with a fixed
        latency."""
        if lay.gpus == 1:
            return 0.0

        def one(received: float) -> float:
            return COLLECTIVE_LATENCY_MS + received / lay.gpu.collective_bytes_per_s * 1e3

        partial = (lay.gpus - 1) * rows * shapes.HIDDEN * 2
        dense, moe = 1, lay.layers - 1
        return (lay.layers * one(partial) + dense * one(partial) + moe * one(2 * partial)
                + one((lay.gpus - 1) * rows * 8))

    def round(self, lay: Layout, streams: int, budget: int, context: int, mean_accept: float) -> Breakdown:
        rows = streams * (budget + 1)
        active = self.routing.active(streams, budget + 1)
        verify = self.verify_ms(lay, streams, rows, context, active)
        draft = self.draft_ms(lay, streams, context, max(1, round(streams * mean_accept)))
        k, per_round, per_row = self.round_coef
        return Breakdown(verify, draft, self.tree.cost(streams, budget),
                         per_round + per_row * streams * (shapes.DRAFT_BLOCK - 1),
                         self.gathered_collectives_ms(lay, rows), k)

    def ar_step(self, lay: Layout, streams: int, context: int) -> Breakdown:
        """One AR decode step: the forward of one row per stream, experts touched as the routing fit says for
        trees of one node."""
        active = self.routing.active(streams, 1)
        verify = self.verify_ms(lay, streams, streams, context, active)
        return Breakdown(verify, 0.0, 0.0, 0.0, self.gathered_collectives_ms(lay, streams),
                         float(self.round_coef[0]))


def _round_coef(model: CostModel, pts: list[dict]) -> np.ndarray:
    lay = Layout()
    rows = []
    for p in pts:
        b = model.round(lay, p["streams"], p["budget"], p["context"], p["mean_accept"])
        rows.append([b.verify + b.draft, 1.0, p["streams"] * (shapes.DRAFT_BLOCK - 1)])
    a = np.array(rows)
    ms = np.array([p["ms"] - model.tree.cost(p["streams"], p["budget"]) for p in pts])
    weights = np.array([p["ms"] for p in pts])
    return nnls(a / weights[:, None], ms / weights)


def fit(validation: bool = False) -> CostModel:
    """The cost model fitted to every measured point, or with one point in three of each table held out."""
    def curve(name: str, features: c.Features, kind: str) -> c.Curve:
        return c.fit_curve(name, features, kind, validation=validation)

    model = CostModel(curve("dense GEMMs", c.gemm_features, "gemm"), curve("routed experts", c.moe_features, "moe"),
                      curve("MLA attention", c.attention_features, "attention"),
                      curve("small ops", c.small_op_features, "misc"),
                      curve("drafter attention", c.draft_attention_features, "draft_attention"),
                      curve("drafter small ops", c.small_op_features, "draft_misc"),
                      c.fit_routing(validation=validation), c.tree_kernels(), np.array([1.0, 0.0, 0.0]))
    train = points("round", held_out=False) if validation else points("round")
    return replace(model, round_coef=_round_coef(model, train))


@cache
def fitted() -> CostModel:
    return fit()
