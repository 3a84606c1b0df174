#!/usr/bin/env python3
"""Soak the GPU engine: successive generate calls of 1-16 streams with mixed prompt and output lengths, AR and
DDTree, greedy and sampled, changing stream counts, budgets and stop ids, for --minutes.

Checks every call, and fails on the first difference:
- greedy: each stream's tokens equal the same prompt generated alone on a fresh engine (batch invariance across
  calls and stream counts), and DDTree's equal AR's;
- sampled (noise keyed by seed, stream slot and position): DDTree's tokens equal AR's of the same call;
- device memory in use stops growing after the warm-up calls (the engine allocates once, at creation, and keeps a
  bounded number of captured graphs): no later peak above an earlier one. The memory is this process's own as NVML
  counts it, so other work on the GPU (a sanitizer run, say) does not move it; where NVML does not list the
  process, the whole device's, and then the soak must run alone.
Writes soak.json and soak.md to --out. Random-weight `small` target and drafter by default (`--model` for others).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import ddtree
from ddtree.device import device_info
from ddtree.drafter import make_drafter
from ddtree.presets import make_model

MAX_STREAMS = 16
MAX_PROMPT = 300
MAX_NEW = 96
FIXED_BUDGETS = (4, 8, 15, 32, 64)
BUDGETS = (*FIXED_BUDGETS, "auto")  # auto: the cost-aware budget per round among 8, 16, 32 and 64
# Enough calls for the engine's graph caches (kGraphCacheCapacity graphs each, least recently used evicted) to
# fill: after that every new capture replaces one, and device memory must stay flat.
WARMUP_CALLS = 48


def process_used_bytes() -> int | None:
    """Device memory NVML counts for this process on the current device, or None where NVML does not list it."""
    try:
        import pynvml
    except ImportError:
        return None
    import torch

    try:
        pynvml.nvmlInit()
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(
            pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device()))
    except pynvml.NVMLError:
        return None
    return next((int(p.usedGpuMemory) for p in procs if p.pid == os.getpid() and p.usedGpuMemory is not None), None)


def device_used_bytes() -> int:
    """The whole device's memory in use (every process's)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def prepare(model: Path | None, workdir: Path) -> tuple[Path, Path]:
    if model is not None:
        return model, model / "drafter"
    cfg = make_model("small", workdir / "model", seed=0)
    make_drafter(cfg, workdir / "model" / "drafter", seed=1, preset="small")
    return workdir / "model", workdir / "model" / "drafter"


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint with MODEL/drafter (default: a random small one)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.time()
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, drafter_dir = prepare(args.model, Path(tmp))
        max_context = MAX_PROMPT + MAX_NEW
        engine = ddtree.Engine(model_dir, drafter_dir, streams=MAX_STREAMS, max_context=max_context,
                               budget=max(FIXED_BUDGETS))
        alone = ddtree.Engine(model_dir, drafter_dir, streams=1, max_context=max_context, budget=max(FIXED_BUDGETS))
        vocab = engine.config.vocab_size
        per_process = process_used_bytes() is not None
        used_bytes = process_used_bytes if per_process else device_used_bytes
        calls, memory, failures = [], [], []
        while time.time() - start < args.minutes * 60 and not failures:
            streams = int(rng.integers(1, MAX_STREAMS + 1))
            prompts = [rng.integers(0, vocab, int(rng.integers(1, MAX_PROMPT + 1))).tolist() for _ in range(streams)]
            new = int(rng.integers(1, MAX_NEW + 1))
            budget = BUDGETS[int(rng.integers(0, len(BUDGETS)))]
            temperature = float(rng.choice([0.0, 0.0, 0.7, 1.0]))
            seed = int(rng.integers(0, 1 << 63))
            stops = rng.integers(0, vocab, int(rng.integers(0, 3))).tolist()
            begin = time.time()
            ar = engine.generate(prompts, new, temperature=temperature, seed=seed, method="ar", stop_token_ids=stops)
            tree = engine.generate(prompts, new, temperature=temperature, seed=seed, method="ddtree", budget=budget,
                                   stop_token_ids=stops)
            for s in range(streams):
                if tree[s].tokens != ar[s].tokens:
                    failures.append(f"call {len(calls)}: stream {s} DDTree differs from AR at token "
                                    f"{first_difference(tree[s].tokens, ar[s].tokens)}")
            if temperature == 0.0:
                s = int(rng.integers(0, streams))
                solo = alone.generate([prompts[s]], new, method="ar", stop_token_ids=stops)[0]
                if solo.tokens != ar[s].tokens:
                    failures.append(f"call {len(calls)}: stream {s} of {streams} differs from the prompt alone at "
                                    f"token {first_difference(solo.tokens, ar[s].tokens)}")
            accepts = [a for r in tree for a in r.accept_lengths]
            calls.append({"streams": streams, "new_tokens": new, "budget": budget, "temperature": temperature,
                          "stops": len(stops), "seconds": time.time() - begin,
                          "mean_accept": float(np.mean(accepts)) if accepts else 0.0,
                          "graphs": len(engine.graphs())})
            memory.append(used_bytes())
        del engine, alone
    # Replacing an evicted graph by another may take or give back one allocation granule of the driver's, so the
    # readings after the warm-up move by a granule or two either way; growth is a later peak above an earlier one.
    steady = memory[WARMUP_CALLS:] if len(memory) > WARMUP_CALLS + 1 else memory[-2:]
    half = len(steady) // 2
    early, late = max(steady[:half]), max(steady[half:])
    if late > early:
        failures.append(f"device memory grew after {WARMUP_CALLS} warm-up calls: peak {early} bytes over the first "
                        f"half of the later calls, {late} over the second")
    report = {"device": str(device_info()), "model": str(args.model or "random small + drafter"),
              "minutes": (time.time() - start) / 60, "calls": calls,
              "memory_counted": "this process's (NVML)" if per_process else "the whole device's", "used_bytes": memory,
              "failures": failures}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(report, indent=2))
    lines = [f"# Soak ({report['model']})", "", f"Device: {report['device']}", "",
             f"{len(calls)} calls in {report['minutes']:.1f} min: AR and DDTree of 1-{MAX_STREAMS} streams, prompts "
             f"1-{MAX_PROMPT}, 1-{MAX_NEW} new tokens, budgets {', '.join(map(str, BUDGETS))}, T in (0, 0.7, 1), "
             "0-2 stop ids.", "",
             f"Device memory in use after the warm-up ({report['memory_counted']}): "
             f"{min(steady) / 2**30:.3f}-{max(steady) / 2**30:.3f} GiB "
             f"(peaks {early / 2**20:.0f} and {late / 2**20:.0f} MiB over the two halves); graphs held by the "
             f"engine at the end: {calls[-1]['graphs'] if calls else 0}.", "",
             "Failures: " + ("none" if not failures else "; ".join(failures)), ""]
    (args.out / "soak.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
