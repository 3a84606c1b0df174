#!/usr/bin/env python3
"""Per-row top-k of log-softmax (kernels/topk.cuh) at the drafter's shapes, beside torch and the byte floor, same run.

Rows 7 and 15 are one stream's drafter block (B - 1 rows), 112 and 240 are 16 streams of blocks 8 and 16; vocab
163840 (Kimi-K2); k over the tree budgets. Logits: random normal x 3, fp32, in a pool of distinct input sets that
together exceed the L2 cache, rotated call by call, so no call finds its row in L2 from the call before.
- ours: `kernels.topk_log_softmax`, captured `--reps` times back to back in a CUDA graph; the median over graph
  replays, divided by the calls (tools/cuda_timing.median_ms).
- torch: `torch.topk(torch.log_softmax(x, -1), k)` on the same inputs, timed the same way.
- floor: the logits read once and the k log-probs and ids written, at the device-to-device copy bandwidth
  measured in the same run (read + write bytes of a 4 GiB copy).
Writes topk.json and topk.md to --out.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from ddtree._native import kernels
from ddtree.device import device_info

from bench_report import start_report
from cuda_timing import copy_bandwidth, median_ms

ROWS = (7, 15, 112, 240)
VOCAB = 163840
KS = (8, 32, 64, 256)
POOL_BYTES = 192 << 20  # above the H200's 50 MB L2 several times over


class Inputs:
    """A pool of logit sets of `rows` x VOCAB and the outputs of both implementations; `next()` rotates."""

    def __init__(self, rows: int, k: int, generator: torch.Generator):
        count = max(2, -(-POOL_BYTES // (rows * VOCAB * 4)))
        self.logits = [torch.randn(rows, VOCAB, device="cuda", generator=generator) * 3 for _ in range(count)]
        self.log_probs = torch.empty(rows, k, device="cuda")
        self.ids = torch.empty(rows, k, dtype=torch.int32, device="cuda")
        self.k, self.turn = k, 0

    def next(self) -> torch.Tensor:
        self.turn = (self.turn + 1) % len(self.logits)
        return self.logits[self.turn]

    def ours(self) -> None:
        kernels.topk_log_softmax(self.log_probs, self.ids, self.next())

    def torch_peer(self) -> None:
        torch.topk(torch.log_softmax(self.next(), -1), self.k)

    def max_abs_diff(self) -> float:
        """Largest |ours - torch| over the log-probs of one input set (a sanity check: the values, not the ids,
        as torch orders ties its own way)."""
        x = self.logits[0]
        kernels.topk_log_softmax(self.log_probs, self.ids, x)
        peer = torch.topk(torch.log_softmax(x, -1), self.k).values
        return float((self.log_probs - peer).abs().max())


def measure(rows: int, k: int, bandwidth: float, generator: torch.Generator, args: argparse.Namespace) -> dict:
    inputs = Inputs(rows, k, generator)
    timed = lambda fn: median_ms(fn, reps=args.reps, replays=args.replays) * 1e3  # noqa: E731
    floor_bytes = rows * VOCAB * 4 + rows * k * 8
    row = {"rows": rows, "vocab": VOCAB, "k": k, "pool": len(inputs.logits), "ours_us": timed(inputs.ours),
           "torch_us": timed(inputs.torch_peer), "floor_bytes": floor_bytes,
           "floor_us": floor_bytes / bandwidth * 1e6, "max_abs_diff_vs_torch": inputs.max_abs_diff()}
    row["of_floor"] = row["floor_us"] / row["ours_us"]
    del inputs
    torch.cuda.empty_cache()
    return row


def write_report(out: Path, report: dict) -> None:
    lines = start_report(out, "topk", "Per-row top-k of log-softmax", report) + [
        f"Vocab {VOCAB}, fp32 logits (random normal x 3) rotated over a pool larger than L2. Microseconds per call: "
        f"the median over CUDA-graph replays of {report['settings']['reps']} back-to-back calls, divided by the "
        "calls. Floor: logits read once, log-probs and ids written once, at the copy bandwidth. torch: "
        "`torch.topk(torch.log_softmax(x, -1), k)`.", "",
        "| rows | k | ours us | floor us | of floor | torch us | torch / ours | max abs diff vs torch |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        lines.append(f"| {r['rows']} | {r['k']} | {r['ours_us']:.1f} | {r['floor_us']:.1f} | "
                     f"{100 * r['of_floor']:.0f}% | {r['torch_us']:.1f} | {r['torch_us'] / r['ours_us']:.1f}x | "
                     f"{r['max_abs_diff_vs_torch']:.2e} |")
    (out / "topk.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/topk"))
    parser.add_argument("--reps", type=int, default=20, help="calls per captured graph")
    parser.add_argument("--replays", type=int, default=15, help="timed graph replays per configuration")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.time()
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    results = []
    for rows in ROWS:
        for k in KS:
            row = measure(rows, k, bandwidth, generator, args)
            results.append(row)
            print(f"rows {rows} k {k}: ours {row['ours_us']:.1f} us, floor {row['floor_us']:.1f} us "
                  f"({100 * row['of_floor']:.0f}%), torch {row['torch_us']:.1f} us, max |ours - torch| "
                  f"{row['max_abs_diff_vs_torch']:.2e}", flush=True)
    report = {"model": f"Kimi-K2 drafter vocabulary {VOCAB}, random logits", "device": str(device_info()),
              "copy_bandwidth_gbs": bandwidth / 1e9,
              "settings": {"reps": args.reps, "replays": args.replays, "seed": args.seed, "pool_bytes": POOL_BYTES},
              "results": results, "seconds": time.time() - start}
    write_report(args.out, report)


if __name__ == "__main__":
    main()
