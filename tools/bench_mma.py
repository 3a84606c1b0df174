#!/usr/bin/env python3
"""Tensor-core rates of the MMA shapes ddtree's kernels issue, measured on this GPU (tools/mma_rates.cu).

Compiles tools/mma_rates.cu with nvcc for sm_90a (the wgmma instructions need it), runs it, and writes mma.json
and mma.md to --out: TFLOP/s and time per MMA per SM (mma.sync: per scheduler) for mma.sync m16n8k16 with one
and with eight independent accumulator chains per warp at 4, 8 and 16 warps per SM, and wgmma m64nNk16 with both
operands in shared memory (SS) or A in registers (RS) at 1, 2 and 3 warpgroups per SM. These are the measured
tensor rates the engine and MoE notes compare kernels' MMA work against.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ddtree.device import device_info

SOURCE = Path(__file__).with_name("mma_rates.cu")


def nvcc() -> str:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidate = Path(home) / "bin" / "nvcc"
    if candidate.exists():
        return str(candidate)
    raise SystemExit("bench_mma needs nvcc on PATH or under CUDA_HOME")


def measure() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "mma_rates"
        subprocess.run([nvcc(), "-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-o", str(binary),
                        str(SOURCE)], check=True)
        out = subprocess.run([str(binary)], check=True, stdout=subprocess.PIPE, text=True).stdout  # errors: stderr
    rows = []
    for line in out.splitlines():
        kind, shape, units, tflops, ns = line.split()
        rows.append({"kind": kind, "shape": shape, "units_per_sm": int(units), "tflops": float(tflops),
                     "ns_per_mma": float(ns)})
    return rows


def write_reports(out: Path, rows: list[dict], device: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "mma.json").write_text(json.dumps({"device": device, "rates": rows}, indent=2) + "\n")
    best = max(r["tflops"] for r in rows)
    lines = ["# Tensor-core rates (tools/mma_rates.cu)", "", f"Device: {device}", "",
             "bf16 inputs, fp32 accumulators; every SM runs one CTA of independent MMA chains on fixed operands. "
             "Units: warps per SM for mma.sync, warpgroups per SM for wgmma. Time per MMA: per SM for wgmma, per "
             "warp scheduler for mma.sync. Fraction: of the best rate measured here.", "",
             "| kind | shape | units / SM | TFLOP/s | ns per MMA | of best |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['shape']} | {r['units_per_sm']} | {r['tflops']:.0f} | "
                     f"{r['ns_per_mma']:.2f} | {r['tflops'] / best:.0%} |")
    (out / "mma.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    info = device_info()
    if not info.devices or info.devices[0].compute_capability != (9, 0):
        print(f"bench_mma needs an sm_90 GPU as device 0; found: {info}", file=sys.stderr)
        return 2
    rows = measure()
    for r in rows:
        print(f"{r['kind']:18s} {r['shape']:10s} x{r['units_per_sm']:<2d} {r['tflops']:7.1f} TFLOP/s "
              f"{r['ns_per_mma']:6.2f} ns", flush=True)
    write_reports(args.out, rows, str(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
