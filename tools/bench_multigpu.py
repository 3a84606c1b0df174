#!/usr/bin/env python3
"""Several GPUs of one host (runtime/multi_gpu_engine.h): tokens/s of AR and DDTree on 1 GPU and on G, and what the
NCCL exchanges cost.

The model is Kimi-K2's dimensions with --layers layers (random weights filled on the device; few enough layers that
one GPU holds the whole model, so 1 and G GPUs run the same model), with a 2-layer drafter of block 8 beside it
whole on every GPU. At 1, 4 and 16 streams and --context tokens:
- AR (graph-replayed steps) and DDTree rounds at budgets 8 and 32 with ORACLE candidates at --mean-accept (greedy;
  the drafter runs, then the oracle's candidates replace its top-K, as tools/bench_ddtree.py does): tokens/s on one
  GPU and on G, DDTree's tokens checked equal to AR's on the same engine (the split engine's sums round otherwise
  than the whole one's, so its tokens are its own);
- the per-stage device time of the G-GPU DDTree round (eager, profile=True), the collectives inside its stages;
- one partial-sum exchange at each forward's row count (AR: streams rows; verify: streams x (budget + 1) rows, the
  MoE's two terms, or one): the NCCL gather then rank-order sum the runtime uses against a plain ncclAllReduce of
  the same partial sums (_native.kernels.nccl_exchange_seconds), and a forward's sum of them.
Writes multigpu.json and multigpu.md to --out. Refuses, with one line, on fewer than 2 GPUs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ddtree import Engine
from ddtree.bench.oracle import decode_ar, hit_for, random_prompts
from ddtree.device import device_info
from ddtree.nccl import nccl_library
from ddtree.presets import preset_config

from bench_ddtree import drafter, measure_throughput
from bench_report import start_report
from cuda_timing import copy_bandwidth

STREAMS = (1, 4, 16)
BUDGETS = (8, 32)
BLOCK = 8
NEW_TOKENS = 32


def throughput(engine: Engine, cfg, context: int, mean_accept: float) -> list[dict]:
    """bench_ddtree's throughput rows (warm, DDTree's tokens checked equal to AR's) at this benchmark's sizes."""
    return measure_throughput(
        engine, cfg, BLOCK - 1, STREAMS, BUDGETS, (mean_accept,), NEW_TOKENS,
        lambda streams: random_prompts(cfg.vocab_size, streams, context - NEW_TOKENS - BLOCK, seed=streams))


def stages(engine: Engine, cfg, context: int, mean_accept: float) -> dict[str, float]:
    """Device seconds per round of each stage of an eager budget-32 round at 4 streams."""
    prompts = random_prompts(cfg.vocab_size, 4, context - NEW_TOKENS - BLOCK, seed=99)
    ar = decode_ar(engine, prompts, NEW_TOKENS)
    hit = [hit_for(mean_accept, BLOCK - 1)] * (BLOCK - 1)
    out = engine.native.generate_ddtree(prompts, NEW_TOKENS, 0.0, 0, max(BUDGETS), profile=True,
                                        reference=ar.tokens, hit=hit, oracle_seed=1)
    rounds = max(len(a) for a in out["accept_lengths"])
    return {name: seconds / rounds for name, seconds in out["stages"]}


def exchanges(library: str, devices: list[int], cfg) -> list[dict]:
    """One partial-sum exchange of 1 and of 2 terms at each forward's row count, and a forward's sum of them: one
    term after each attention and dense MLP, two after each MoE MLP (the runtime's collective points; the LM
    head's pick of a few bytes a row left out)."""
    from ddtree import _native

    dense = cfg.first_k_dense_replace
    one_term, two_terms = cfg.num_hidden_layers + dense, cfg.num_hidden_layers - dense
    rows_list = sorted(set(STREAMS) | {s * (b + 1) for s in STREAMS for b in BUDGETS})
    out = []
    for rows in rows_list:
        gathered, reduced = {}, {}
        for terms in (1, 2):
            gathered[terms], reduced[terms] = _native.kernels.nccl_exchange_seconds(library, devices, terms, rows,
                                                                                    cfg.hidden_size)
        out.append({"rows": rows, "gather_sum_us": gathered[2] * 1e6, "all_reduce_us": reduced[2] * 1e6,
                    "one_term_gather_sum_us": gathered[1] * 1e6, "one_term_all_reduce_us": reduced[1] * 1e6,
                    "per_forward_gather_sum_ms": (one_term * gathered[1] + two_terms * gathered[2]) * 1e3,
                    "per_forward_all_reduce_ms": (one_term * reduced[1] + two_terms * reduced[2]) * 1e3})
    return out


def write_reports(out: Path, report: dict) -> None:
    g = report["gpus"]
    lines = start_report(out, "multigpu", f"{g} GPUs against 1", report)
    lines += [f"Oracle acceptance: mean {report['mean_accept']} tokens per round; context {report['context']}.", "",
              "| streams | GPUs | AR tok/s | " + " | ".join(f"DDTree b{b} tok/s" for b in BUDGETS) + " |",
              "|---:|---:|---:|" + "---:|" * len(BUDGETS)]
    for n_gpus, rows in (("1", report["one_gpu"]), (str(g), report["split"])):
        for streams in STREAMS:
            by_budget = {r["budget"]: r for r in rows if r["streams"] == streams}
            lines.append(f"| {streams} | {n_gpus} | {by_budget[BUDGETS[0]]['ar_tokens_per_s']:.0f} | " +
                         " | ".join(f"{by_budget[b]['ddtree_tokens_per_s']:.0f}" for b in BUDGETS) + " |")
    lines += ["", f"Stages of a {g}-GPU budget-{max(BUDGETS)} round at 4 streams (eager, device ms per round):", ""]
    lines += [f"- {name}: {seconds * 1e3:.3f}" for name, seconds in report["stages"].items()]
    lines += ["", "One partial-sum exchange (terms x rows x hidden bf16), the slowest rank's median, and a forward's "
              "(one term after each attention and dense MLP, two after each MoE MLP):", "",
              "| rows | gather + sum, 1 / 2 terms (us) | ncclAllReduce, 1 / 2 terms (us) | per forward, gather + sum / "
              "all-reduce (ms) |", "|---:|---:|---:|---:|"]
    lines += [f"| {e['rows']} | {e['one_term_gather_sum_us']:.1f} / {e['gather_sum_us']:.1f} | "
              f"{e['one_term_all_reduce_us']:.1f} / {e['all_reduce_us']:.1f} | "
              f"{e['per_forward_gather_sum_ms']:.2f} / {e['per_forward_all_reduce_ms']:.2f} |"
              for e in report["exchanges"]]
    (out / "multigpu.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/multigpu"))
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to split over (default: every GPU present)")
    parser.add_argument("--layers", type=int, default=4, help="K2 layers (default 4: one GPU holds them)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--mean-accept", type=float, default=4.0)
    args = parser.parse_args(argv)
    present = len(device_info().devices)
    gpus = args.gpus or present
    if present < 2 or not 2 <= gpus <= present:
        print(f"bench_multigpu needs 2 or more GPUs ({present} present, {gpus} asked for)", file=sys.stderr)
        return 2
    library, devices = nccl_library(), list(range(gpus))
    cfg = preset_config("k2-layers", args.layers)
    dcfg = drafter(cfg, 2, 32, 9216, BLOCK, (0, args.layers - 1))
    report = {"model": f"K2 dims, {args.layers} layers, random weights", "device": str(device_info()),
              "copy_bandwidth_gbs": copy_bandwidth() / 1e9, "gpus": gpus, "context": args.context,
              "mean_accept": args.mean_accept}
    torch.cuda.empty_cache()
    start = time.time()
    for key, kwargs in (("one_gpu", {}), ("split", {"devices": devices})):
        engine = Engine.random(cfg, streams=max(STREAMS), max_context=args.context, budget=max(BUDGETS),
                               drafter=dcfg, **kwargs)
        report[key] = throughput(engine, cfg, args.context, args.mean_accept)
        if key == "split":
            report["stages"] = stages(engine, cfg, args.context, args.mean_accept)
        del engine
        print(f"{key} measured after {time.time() - start:.0f} s", flush=True)
    report["exchanges"] = exchanges(library, devices, cfg)
    write_reports(args.out, report)
    print(f"wrote {args.out}/multigpu.json, {args.out}/multigpu.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
