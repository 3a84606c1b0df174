"""The cost model's measured points and its validation report.

  python tools/estimate_report.py            # rewrite py/ddtree/estimate/h200_points.json from bench/results/*,
                                             # then bench/results/estimate/estimate.{json,md} (+ .png with matplotlib)

Points come from the committed H200 reports: engine (dense GEMMs at 1/16/64 rows, decode attention, the AR step and
its per-op split), verify (the tree-verify forward and its per-op split), moe (routed experts vs rows), drafter
(the draft and its per-op split), tree (build, accept, commit), ddtree (rounds and tokens/s with oracle acceptance).
Every third point of each table is held out: the validation fit never sees it, and the report shows how well it is
predicted. The package's model fits on every point.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "py"))
sys.path.insert(0, str(ROOT / "tools"))

from bench_report import pyplot  # noqa: E402

from ddtree.estimate.measurements import POINTS_FILE  # noqa: E402

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
    return i % 3 == 2


def _target_split(points: list[dict], split: dict, streams: int, rows: int, context: int, active: float | None,
                  held: bool, source: str) -> None:
    """The component points of one target forward's per-operation split (ms summed over the 4 layers); no routed
    experts point where the benchmark did not record how many experts its rows touched."""
    calls = {"mlp_gate_up": 1, "mlp_down": 1, "shared_gate_up": 3, "shared_down": 3, "lm_head": 1}
    for op in TARGET_GEMM_OPS:
        points.append({"kind": "gemm", "op": op, "rows": rows if op != "lm_head" else rows,
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


def main() -> int:
    points = collect()
    POINTS_FILE.write_text(json.dumps({"device": "NVIDIA H200 (bench/results, K2 dims, random weights)",
                                       "points": points}, indent=1) + "\n")
    from ddtree.estimate.report import write_report

    write_report(RESULTS / "estimate", pyplot())
    return 0


if __name__ == "__main__":
    sys.exit(main())
