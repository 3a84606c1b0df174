"""What `ddtree-run estimate` shows: one table of projected rounds, or one JSON document."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from ddtree.estimate.projection import Projection
from ddtree.estimate.request import EstimateRequest
from ddtree.estimate.round_cost import COLLECTIVE_LATENCY_MS
from ddtree.estimate.validation import AR_TABLE, ROUND_TABLE, rms


def _pm(value: float, sigma: float, digits: int = 0) -> str:
    return f"{value:.{digits}f} ± {value * sigma:.{digits}f}"


def _header(req: EstimateRequest, first: Projection) -> str:
    lay = req.layout
    fits = "fits" if first.fits_in_memory else "does NOT fit"
    return (f"{lay.gpu.name} x {lay.gpus}, K2 target of {lay.layers} layers (1 dense + {lay.layers - 1} MoE) with "
            f"the Kimi-K2.5-DFlash drafter, context {req.context}: weights {first.weights_gb_per_gpu:.1f} GB per GPU "
            f"({fits} in {lay.gpu.memory_bytes / 1e9:.0f} GB)")


def show(req: EstimateRequest, rows: list[Projection], console: Console, as_json: bool) -> None:
    if as_json:
        console.out(json.dumps({"gpu": req.layout.gpu.name, "gpus": req.layout.gpus, "layers": req.layout.layers,
                                "context": req.context, "held_out_rms": {"round": rms(ROUND_TABLE),
                                                                         "ar_step": rms(AR_TABLE)},
                                "projections": [r.as_dict() for r in rows]}, indent=2), highlight=False)
        return
    table = Table(title=_header(req, rows[0]), title_justify="left")
    for name in ("streams", "budget", "accept", "round ms", "DDTree tok/s", "AR tok/s", "speedup", "verify",
                 "draft", "fixed", "collectives"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(str(r.streams), str(r.budget), f"{r.mean_accept:g}", _pm(r.round_ms, r.round_sigma, 2),
                      _pm(r.tokens_per_s, r.round_sigma), _pm(r.ar_tokens_per_s, r.ar_sigma),
                      f"{r.speedup:.2f}", f"{r.verify_ms:.2f}", f"{r.draft_ms:.2f}", f"{r.fixed_ms:.2f}",
                      f"{r.collectives_ms:.2f}")
    # A pipe has no width: give the table its natural one rather than a default 80 columns that squeeze it.
    width = console.width
    if not console.is_terminal:
        console.width = max(width, 200)
    console.print(table)
    console.width = width
    transfer = req.layout.gpu.transfer_uncertainty
    console.print(f"ms per round per GPU. ± is one sigma: the held-out RMS error on the measured H200 rounds "
                  f"({rms(ROUND_TABLE):.1%}; AR steps {rms(AR_TABLE):.1%})"
                  + (f", {transfer:.0%} for kernels measured on another GPU" if transfer else "")
                  + (f", 50% of the collectives (modelled, not measured: {COLLECTIVE_LATENCY_MS * 1e3:.0f} us each "
                     f"plus their bytes over NVLink)" if req.layout.gpus > 1 else "")
                  + ". accept: tokens committed per round per stream (accepted nodes + the bonus token).",
                  highlight=False)
