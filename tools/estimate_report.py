"""The cost model's measured points and its validation report.

  python tools/estimate_report.py            # rewrite py/ddtree/estimate/h200_points.json from bench/results/*,
                                             # then bench/results/estimate/estimate.{json,md} (+ .png with matplotlib)

Points come from the committed H200 reports: engine (dense GEMMs at 1/16/64 rows, decode attention, the AR step and
its per-op split), verify (the tree-verify forward and its per-op split), moe (routed experts vs rows), drafter
(the draft and its per-op split), tree (build, accept, commit), ddtree (rounds and tokens/s with oracle acceptance).
One point in three of each table is held out: the validation fit never sees it, and the report shows how well it is
predicted. The package's model fits on every point.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "py"))
sys.path.insert(0, str(ROOT / "tools"))

from dataclasses import asdict, replace  # noqa: E402

import numpy as np  # noqa: E402
from bench_report import pyplot  # noqa: E402

from ddtree.estimate import validation  # noqa: E402
from ddtree.estimate.gpus import GPUS, GpuSpec  # noqa: E402
from ddtree.estimate.measurements import POINTS_FILE  # noqa: E402
from ddtree.estimate.projection import project  # noqa: E402
from ddtree.estimate.round_cost import Layout, fitted  # noqa: E402

RESULTS = ROOT / "bench" / "results"
# Per-operation names of the benchmarks' splits that are neither a GEMM, the routed experts nor the attention.
MISC_OPS = ("norm", "rope_q", "kv_store", "embed", "router", "sample")
TARGET_GEMM_OPS = ("q_a+kv_a", "q_b", "kv_b_absorb_k", "kv_b_absorb_v", "o_proj", "mlp_gate_up", "mlp_down",
                   "shared_gate_up", "shared_down", "lm_head")
ENGINE_KERNEL_OPS = {"gemm q_a+kv_a": "q_a+kv_a", "gemm q_b": "q_b", "gemm kv_b absorb k": "kv_b_absorb_k",
                     "gemm kv_b absorb v": "kv_b_absorb_v", "gemm o_proj": "o_proj",
                     "gemm dense gate_up+silu": "mlp_gate_up", "gemm dense down": "mlp_down",
                     "gemm shared gate_up+silu": "shared_gate_up", "gemm shared down": "shared_down",
                     "gemm lm_head": "lm_head"}
TARGET_LAYERS = 4  # the k2-layers benchmark models: 1 dense + 3 MoE layers
KIMI_DRAFTER = "Kimi-K2.5-DFlash"


# Per-operation splits time each launch alone between CUDA events: a few microseconds more per launch than the same
# kernels replayed back to back, which the curves fit as their own per-call term ("eager").
EAGER_SOURCES = ("engine AR split", "verify split", "drafter split")


def _held(i: int) -> bool:
    """One point in three, on a diagonal: the tables cycle through three budgets (or row counts), and every third
    row alone would hold out the largest of them only."""
    return (i + i // 3) % 3 == 2


def _target_split(points: list[dict], split: dict, streams: int, rows: int, context: int, active: float | None,
                  held: bool, source: str) -> None:
    """The component points of one target forward's per-operation split (ms summed over the 4 layers); no routed
    experts point where the benchmark did not record how many experts its rows touched."""
    calls = {"mlp_gate_up": 1, "mlp_down": 1, "shared_gate_up": 3, "shared_down": 3, "lm_head": 1}
    for op in TARGET_GEMM_OPS:
        points.append({"kind": "gemm", "op": op, "rows": rows,
                       "calls": calls.get(op, TARGET_LAYERS), "ms": split[op], "held_out": held, "source": source})
    if active is not None:
        points.append({"kind": "moe", "rows": rows, "active": active, "layers": TARGET_LAYERS - 1,
                       "ms": split["routed_experts"], "held_out": held, "source": source})
    points.append({"kind": "attention", "streams": streams, "rows": rows, "context": context,
                   "layers": TARGET_LAYERS, "ms": split["attention"], "held_out": held, "source": source})
    points.append({"kind": "misc", "rows": rows, "layers": TARGET_LAYERS,
                   "ms": sum(split.get(op, 0.0) for op in MISC_OPS), "held_out": held, "source": source})


def collect() -> list[dict]:
    points: list[dict] = []
    engine = json.loads((RESULTS / "engine" / "engine.json").read_text())
    for i, k in enumerate(engine["kernels"]):
        if k["kernel"] in ENGINE_KERNEL_OPS:
            points.append({"kind": "gemm", "op": ENGINE_KERNEL_OPS[k["kernel"]], "rows": k["rows"], "calls": 1,
                           "ms": k["ms"], "held_out": _held(i), "source": "engine kernels"})
        elif k["kernel"] in ("mla_attention ctx 1024", "mla_attention ctx 8192"):
            points.append({"kind": "attention", "streams": k["rows"], "rows": k["rows"],
                           "context": int(k["kernel"].split()[-1]), "layers": 1, "ms": k["ms"],
                           "held_out": _held(i), "source": "engine kernels"})
    for i, e in enumerate(engine["engine"]):
        held = _held(i)
        s, ctx = e["streams"], e["context"]
        _target_split(points, e["breakdown_ms"], s, s, ctx, None, held, "engine AR split")
        points.append({"kind": "ar", "streams": s, "context": ctx, "ms": e["step_ms"], "held_out": True,
                       "source": "engine AR step"})

    verify = json.loads((RESULTS / "verify" / "verify.json").read_text())
    for i, v in enumerate(verify["verify"]):
        held = _held(i)
        active = v["active_experts"] / (TARGET_LAYERS - 1)
        _target_split(points, v["breakdown_ms"], v["streams"], v["rows"], v["context"], active, held, "verify split")
        points.append({"kind": "verify", "streams": v["streams"], "budget": v["budget"], "context": v["context"],
                       "rows": v["rows"], "active": active, "ms": v["ms"], "held_out": held,
                       "source": "verify forward"})
        points.append({"kind": "routing", "streams": v["streams"], "nodes": v["budget"] + 1, "active": active,
                       "held_out": held, "source": "verify routing"})
    t = verify["tree_attention"]
    points.append({"kind": "attention", "streams": t["streams"], "rows": t["rows"], "context": t["context"],
                   "layers": 1, "ms": t["ms"], "held_out": False, "source": "verify tree attention"})

    moe = json.loads((RESULTS / "moe" / "moe.json").read_text())
    for i, r in enumerate(moe["rows"]):
        points.append({"kind": "moe", "rows": r["m"], "active": r["active_experts"], "layers": 1,
                       "ms": r["ms_per_call"], "held_out": _held(i), "source": "moe"})

    drafter = json.loads((RESULTS / "drafter" / "drafter.json").read_text())
    for i, d in enumerate(drafter["results"]):
        held = _held(i)
        s, layers, ops = d["streams"], d["layers"], d["ops_ms"]
        block = s * 8
        for op, rows, calls in (("block.qkv", block, layers), ("block.o_proj", block, layers),
                                ("block.gate_up", block, layers), ("block.down", block, layers),
                                ("append.fc", block, 1), ("append.kv_proj", block, layers),
                                ("lm_head", s * 7, 1)):
            points.append({"kind": "gemm", "op": op, "rows": rows, "calls": calls, "ms": ops[op], "held_out": held,
                           "source": "drafter split"})
        points.append({"kind": "draft_attention", "streams": s, "rows": block, "context": d["context"],
                       "layers": layers, "ms": ops["block.attention"], "held_out": held, "source": "drafter split"})
        points.append({"kind": "draft_misc", "rows": block, "layers": layers,
                       "ms": sum(v for k, v in ops.items() if k in ("block.norm", "block.qk_norm_rope",
                                                                    "append.kv_store", "block.embed", "append.norm",
                                                                    "lm_head.gather")),
                       "held_out": held, "source": "drafter split"})
        points.append({"kind": "draft", "streams": s, "context": d["context"], "layers": layers,
                       "append_rows": block, "ms": d["draft_ms"], "held_out": held, "source": "drafter draft"})

    tree = json.loads((RESULTS / "tree" / "tree.json").read_text())
    for r in tree["results"]:
        points.append({"kind": "tree", "budget": r["budget"], "streams": r["streams"],
                       "ms": (r["gpu_build_us"] + r["gpu_accept_us"] + r["gpu_commit_taps_us"]) / 1000,
                       "held_out": False, "source": "tree kernels"})

    ddtree = json.loads((RESULTS / "ddtree" / "ddtree.json").read_text())
    # Mean context of a run: the prompt plus half the new tokens.
    context = ddtree["prompt"] + ddtree["new_tokens"] // 2
    for r in ddtree["rounds"]:
        if r["model"].startswith(KIMI_DRAFTER):
            points.append({"kind": "round_stages", "streams": 1, "budget": r["budget"], "context": context,
                           "stage_ms": r["stage_ms"], "ms": r["round_ms"], "held_out": True,
                           "source": "ddtree round stages"})
    for i, r in enumerate(ddtree["throughput"]):
        points.append({"kind": "round", "streams": r["streams"], "budget": r["budget"], "context": context,
                       "mean_accept": r["mean_accept"], "ms": r["round_ms"],
                       "tokens_per_s": r["ddtree_tokens_per_s"], "held_out": _held(i), "source": "ddtree oracle"})
    for p in points:
        p["eager"] = p["source"] in EAGER_SOURCES
    return points


# The acceptance the projections show: Kimi-K2.5-DFlash's published chain acceptance at block 8 (MT-Bench 3.7,
# GSM8K / HumanEval 5.3; its model card).
PROFILE_ACCEPTS = (3.7, 5.3)
PROFILE_STREAMS = (1, 16)
PROFILE_BUDGETS = (8, 32)
PROFILE_CONTEXT = 1024


def _summary(checks: list) -> list[dict]:
    out = []
    for table in dict.fromkeys(c.table for c in checks):
        errors = np.array([c.error for c in checks if c.table == table])
        out.append({"table": table, "points": len(errors), "rms": float(np.sqrt(np.mean(errors ** 2))),
                    "max_abs": float(np.abs(errors).max()), "within_15": int((np.abs(errors) <= 0.15).sum())})
    return out


def _latency_only(gpu: GpuSpec) -> GpuSpec:
    """`gpu` with unbounded bandwidth and tensor rate: what is left of a round is its latency- and SM-bound part."""
    return replace(gpu, spec_bytes_per_s=1e30, spec_tensor_flops=1e30, nvlink_bytes_per_s=1e30)


def _projections() -> list[dict]:
    rows = []
    for key, gpu in GPUS.items():
        for streams in PROFILE_STREAMS:
            for budget in PROFILE_BUDGETS:
                lay = Layout(gpu, 8, 61)
                latency = fitted().round(Layout(_latency_only(gpu), 8, 61), streams, budget, PROFILE_CONTEXT,
                                         PROFILE_ACCEPTS[0]).total
                for accept in PROFILE_ACCEPTS:
                    p = project(lay, PROFILE_CONTEXT, streams, budget, accept)
                    rows.append({**p.as_dict(), "gpu_key": key, "latency_bound_ms": latency})
    return rows


def _one_gpu() -> list[dict]:
    """The measured 4-layer model on one GPU of each kind: where the memory-bound part shrinks with bandwidth."""
    rows = []
    for gpu in GPUS.values():
        for streams, budget in ((1, 8), (16, 64)):
            lay = Layout(gpu, 1, 4)
            latency = fitted().round(Layout(_latency_only(gpu), 1, 4), streams, budget, 176, PROFILE_ACCEPTS[1]).total
            p = project(lay, 176, streams, budget, PROFILE_ACCEPTS[1])
            rows.append({**p.as_dict(), "latency_bound_ms": latency})
    return rows


def _curves() -> list[dict]:
    m = fitted()
    names = {"dense GEMMs": ["us per call", "us per call, eager excess", "x weight-byte time (1/efficiency)",
                             "x 1-16 row FLOP time", "x 17-32 row FLOP time", "x per-64-row-pass weight FLOPs (SM)",
                             "x >32-row FLOPs (SM)", "x kv_b absorb >32-row FLOPs (SM)", "us per 64-row pass"],
             "routed experts": ["us per layer", "us per layer, eager excess", "x expert-byte time",
                                "x token-expert FLOP time"],
             "MLA attention": ["us per layer", "us per layer, eager excess", "x stream KV byte time",
                               "x row-key FLOP time"],
             "small ops": ["us per layer", "us per layer-row"],
             "drafter attention": ["us per layer", "us per layer, eager excess", "x draft KV byte time",
                                   "x row-key FLOP time"],
             "drafter small ops": ["us per layer", "us per layer-row"]}
    out = []
    for curve in (m.gemm, m.moe, m.attention, m.small_ops, m.draft_attention, m.draft_small_ops):
        out.append({"name": curve.name, "held_out_rms": curve.sigma,
                    "terms": dict(zip(names[curve.name], map(float, curve.coef)))})
    out.append({"name": "routing", "held_out_rms": m.routing.sigma,
                "terms": {"a": m.routing.a, "streams exponent": m.routing.g, "nodes exponent": m.routing.b}})
    out.append({"name": "round", "held_out_rms": float("nan"),
                "terms": dict(zip(["k (graph / kernels)", "ms per round", "ms per draft row"],
                                  map(float, m.round_coef)))})
    return out


def _markdown(report: dict) -> list[str]:
    lines = ["# Cost model: held-out accuracy and projections", "",
             "A per-round cost model (`py/ddtree/estimate`, `ddtree-run estimate`) fitted to the committed H200 "
             "reports (engine, verify, moe, drafter, tree, ddtree; K2 dimensions, 4 layers, random weights). "
             "One point in three of each table (on a diagonal, so every budget and stream count has some) is "
             "held out of the validation fit; the AR step totals are never fitted (only their per-op splits). Errors are (predicted - measured) / measured.", "",
             "## Held-out accuracy", "", "| table | points | RMS | max abs | within 15% |", "|---|---:|---:|---:|---:|"]
    for s in report["summary"]:
        lines.append(f"| {s['table']} | {s['points']} | {s['rms']:.1%} | {s['max_abs']:.1%} | "
                     f"{s['within_15']} / {s['points']} |")
    lines += ["", "| table | configuration | measured ms | predicted ms | error |", "|---|---|---:|---:|---:|"]
    for c in report["checks"]:
        lines.append(f"| {c['table']} | {c['config']} | {c['measured_ms']:.2f} | {c['predicted_ms']:.2f} | "
                     f"{c['error']:+.1%} |")
    lines += ["", "## Component curves (fitted on every point)", "",
              "Held-out RMS: the same curve fitted without one point in three, on those points (per operation "
              "and per configuration, so larger than the error of their sums).", "",
              "| component | held-out RMS | fitted terms |", "|---|---:|---|"]
    for c in report["curves"]:
        terms = ", ".join(f"{k} {v:.3g}" for k, v in c["terms"].items())
        rms_text = "-" if c["held_out_rms"] != c["held_out_rms"] else f"{c['held_out_rms']:.1%}"
        lines.append(f"| {c['name']} | {rms_text} | {terms} |")
    lines += ["", f"## Projections: full K2 (61 layers) on 8 GPUs, context {PROFILE_CONTEXT}", "",
              "Layout: the runtime's: attention heads, dense MLP, shared expert and lm_head split 8 ways, 48 routed "
              "experts per GPU, the drafter whole on every GPU; every rank's partial sums gathered after each "
              "attention and MLP (modelled from NVLink bandwidth and a 10 us latency, not measured). accept: "
              "tokens committed per round per stream; 3.7 and 5.3 are Kimi-K2.5-DFlash's published chain "
              "acceptance (MT-Bench, GSM8K). Latency+SM-bound ms: the same round with "
              "unbounded bandwidth and tensor rate: launch and pass latencies and the GEMM's shared-memory-bound "
              "row terms (which scale with the SM count only), what no faster memory removes. ± is one sigma.", "",
              "| GPU | streams | budget | accept | round ms | DDTree tok/s | AR tok/s | speedup | "
              "latency+SM-bound ms | collectives ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in report["projections"]:
        lines.append(f"| {p['gpu']} | {p['streams']} | {p['budget']} | {p['mean_accept']} | "
                     f"{p['round_ms']:.1f} ± {p['round_ms'] * p['round_sigma']:.1f} | "
                     f"{p['tokens_per_s']:.0f} ± {p['tokens_per_s'] * p['round_sigma']:.0f} | "
                     f"{p['ar_tokens_per_s']:.0f} ± {p['ar_tokens_per_s'] * p['ar_sigma']:.0f} | "
                     f"{p['speedup']:.2f} | {p['latency_bound_ms']:.1f} ({p['latency_bound_ms'] / p['round_ms']:.0%}) "
                     f"| {p['collectives_ms']:.1f} |")
    lines += ["", "## One GPU, the measured 4-layer model (context 176, accept 5.3)", "",
              "| GPU | streams | budget | round ms | DDTree tok/s | latency+SM-bound ms |",
              "|---|---:|---:|---:|---:|---:|"]
    for p in report["one_gpu"]:
        lines.append(f"| {p['gpu']} | {p['streams']} | {p['budget']} | "
                     f"{p['round_ms']:.2f} ± {p['round_ms'] * p['round_sigma']:.2f} | "
                     f"{p['tokens_per_s']:.0f} ± {p['tokens_per_s'] * p['round_sigma']:.0f} | "
                     f"{p['latency_bound_ms']:.2f} ({p['latency_bound_ms'] / p['round_ms']:.0%}) |")
    return lines


def _plot(plt, checks: list, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 6))
    for table in dict.fromkeys(c.table for c in checks):
        pts = [c for c in checks if c.table == table]
        ax.loglog([c.measured_ms for c in pts], [c.predicted_ms for c in pts], "o", label=table)
    lo, hi = 0.5, 100
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="0.9")
    ax.set_xlabel("measured ms (held out)")
    ax.set_ylabel("predicted ms")
    ax.legend(fontsize=7)
    fig.savefig(out / "estimate.png", dpi=120, bbox_inches="tight")


def main() -> int:
    points = collect()
    POINTS_FILE.write_text(json.dumps({"device": "NVIDIA H200 (bench/results, K2 dims, random weights)",
                                       "points": points}, indent=1) + "\n")
    checks = list(validation.checks())
    report = {"model": "cost model fitted to the H200 reports", "summary": _summary(checks),
              "checks": [{**asdict(c), "error": c.error} for c in checks], "curves": _curves(),
              "projections": _projections(), "one_gpu": _one_gpu()}
    out = RESULTS / "estimate"
    out.mkdir(parents=True, exist_ok=True)
    (out / "estimate.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "estimate.md").write_text("\n".join(_markdown(report)) + "\n")
    plt = pyplot()
    if plt is not None:
        _plot(plt, checks, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
