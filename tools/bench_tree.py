#!/usr/bin/env python3
"""CPU baseline for the DDTree tree build: the numpy/heapq reference `build_tree`, one tree per stream.

This is what a host-side tree build costs per round (the serving stacks' approach, and the published
reference's); the GPU tree builder is compared against it. Inputs are the per-depth top-K of fresh random draft
distributions (depth 15 = block 16 - 1, K = min(budget, vocab)); a pool of input sets is rotated so no
repeat reuses the previous one. Reports the median over repeats after warm-up, per round (all streams, built one
after another as a host loop does) and per tree.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from ddtree.reference.tree import build_tree

DEPTH = 15
VOCAB = 4096
BUDGETS = (8, 16, 32, 64, 128, 256)
STREAMS = (1, 2, 4, 8, 16)


def draft_top_k(rng: np.random.Generator, streams: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-stream, per-depth top-K log-softmax of random logits (peaked enough to give deep trees)."""
    logits = rng.standard_normal((streams, DEPTH, VOCAB)) * 2.5
    log_z = np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    ids = np.argpartition(-logits, width - 1, axis=-1)[..., :width]
    top = np.take_along_axis(logits, ids, axis=-1)
    order = np.argsort(-top, axis=-1, kind="stable")
    ids = np.take_along_axis(ids, order, axis=-1)
    log_probs = (np.take_along_axis(top, order, axis=-1) - log_z).astype(np.float32)
    return log_probs, ids.astype(np.int64)


def time_round(log_probs: np.ndarray, ids: np.ndarray, budget: int) -> tuple[float, int]:
    begin = time.perf_counter()
    nodes = 0
    for stream in range(log_probs.shape[0]):
        nodes += build_tree(log_probs[stream], ids[stream], budget).num_nodes
    return time.perf_counter() - begin, nodes


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/tree_cpu"))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pool", type=int, default=8, help="distinct input sets rotated across repeats")
    parser.add_argument("--machine", default="", help="free-text label of the machine, stored in the report")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    rows = []
    for budget in BUDGETS:
        width = min(budget, VOCAB)
        for streams in STREAMS:
            pool = [draft_top_k(rng, streams, width) for _ in range(args.pool)]
            for i in range(args.warmup):
                time_round(*pool[i % args.pool], budget)
            samples, nodes = [], 0
            for i in range(args.repeats):
                seconds, nodes = time_round(*pool[i % args.pool], budget)
                samples.append(seconds)
            median = statistics.median(samples)
            rows.append(
                {
                    "budget": budget,
                    "streams": streams,
                    "depth": DEPTH,
                    "top_k": width,
                    "nodes_per_round": nodes,
                    "round_us_median": median * 1e6,
                    "round_us_min": min(samples) * 1e6,
                    "tree_us_median": median * 1e6 / streams,
                }
            )
            print(f"budget {budget:4d} streams {streams:2d}: {median * 1e6:10.1f} us/round "
                  f"({median * 1e6 / streams:8.1f} us/tree)")

    report = {
        "bench": "tree_cpu",
        "what": "reference build_tree (numpy + heapq), streams built sequentially on one core",
        "machine": {
            "label": args.machine,
            "cpu": cpu_name(),
            "logical_cores": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "settings": {"depth": DEPTH, "vocab": VOCAB, "repeats": args.repeats, "warmup": args.warmup,
                     "pool": args.pool, "seed": args.seed},
        "results": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tree_cpu.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")

    lines = [
        "# DDTree tree build on the CPU (reference `build_tree`)",
        "",
        (f"Machine: {args.machine or 'unlabelled'}; CPU {report['machine']['cpu']}, "
         f"{report['machine']['logical_cores']} logical cores; Python {report['machine']['python']}, "
         f"numpy {report['machine']['numpy']}."),
        (f"Depth {DEPTH}, K = min(budget, {VOCAB}), fresh random draft distributions rotated over {args.pool} "
         f"input sets; median of {args.repeats} repeats after {args.warmup} warm-up rounds. Streams are built "
         "one after another (a host loop), so a round costs streams x one tree; each build includes the input "
         "checks."),
        "",
        "Median microseconds per round (all streams):",
        "",
        "| budget | " + " | ".join(f"{s} stream{'s' if s > 1 else ''}" for s in STREAMS)
        + " | us per tree (1 stream) |",
        "|---:|" + "---:|" * (len(STREAMS) + 1),
    ]
    for budget in BUDGETS:
        cells = [r for r in rows if r["budget"] == budget]
        single = next(r for r in cells if r["streams"] == 1)
        lines.append(f"| {budget} | " + " | ".join(f"{r['round_us_median']:.0f}" for r in cells)
                     + f" | {single['tree_us_median']:.1f} |")
    (args.out / "tree_cpu.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
