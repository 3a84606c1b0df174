#!/usr/bin/env python3
"""Rank simulation: one rank of full Kimi-K2 split over 8 GPUs, timed on one GPU, and an 8 x H200 projection.

The engine holds rank 7 of 8 (ddtree.shard: 8 of 64 heads, 48 of 384 routed experts per layer, an eighth of the
dense MLP, shared experts and lm_head; 61 layers; random weights filled on the device) with its peers simulated
(runtime/rank_simulation.h): same-size device copies of its own partial sums stand for the all-gather, then the
rank-order sum runs, so a step is one rank's work with local collectives. Beside it, whole on the rank, a drafter of
the Kimi-K2.5-DFlash shape (6 layers, block 8, taps 1 12 24 35 47 58) holding the whole lm_head. Reports, at 1 / 4 /
16 streams and 1k context:
- the per-rank AR step (CUDA graph replay, tokens sampled at T = 1 so the routing stays that of diverse tokens),
  and the routed experts per layer a step's rows choose (all, and this rank's);
- the local collectives' time: the eager step's sum_partials operations (the stand-in copies and the sums), and
  one forward's collectives captured apart in a graph and replayed (Engine.time_collectives), at the step's and at
  each round's verify rows;
- the per-rank DDTree round at budgets 8 and 32 with ORACLE candidates at --mean-accept (greedy; the drafter's
  forward and top-K run, then the oracle's candidates replace its top-K: random weights accept nothing);
- ddtree.estimate's model of the same rank (fitted on 4-layer engines, so these are held out), step and rounds;
- an 8 x H200 projection: the measured step and round less their in-graph local collectives, plus the modelled
  NCCL all-gathers of the runtime's design (ddtree.estimate's gathered_collectives_ms: latency + bytes over NVLink,
  not measured).
Writes ranksim.json and ranksim.md to --out. About 3-5 minutes on one H200; --from-json projects a committed
ranksim.json again with the current model, on any machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ddtree import Engine
from ddtree.bench.oracle import decode_ar, decode_ddtree, hit_for, random_prompts
from ddtree.device import device_info, has_cuda_device
from ddtree.drafter import DrafterConfig, drafter_config_for
from ddtree.engine import engine_dims
from ddtree.estimate import GPUS, Layout
from ddtree.estimate.round_cost import fitted
from ddtree.presets import preset_config
from ddtree.shard import Shard, shard_layout

from bench_report import start_report
from cuda_timing import copy_bandwidth

K2_LAYERS = 61
RANKS, RANK = 8, 7  # the last rank: a full share of every split dimension, like every other
STREAMS = (1, 4, 16)
CONTEXT = 1024
BUDGETS = (8, 32)
SAMPLE_TEMPERATURE = 1.0
KIMI_DFLASH_TAPS = (1, 12, 24, 35, 47, 58)
NEW_TOKENS = 32


def kimi_dflash(cfg) -> DrafterConfig:
    """The Kimi-K2.5-DFlash shape (DESIGN.md): 6 layers, 64 query / 8 KV heads of 128, intermediate 18432, block 8."""
    return dataclasses.replace(drafter_config_for(cfg, "k2-layers"), num_hidden_layers=6, num_attention_heads=64,
                               num_key_value_heads=8, head_dim=128, intermediate_size=18432, block_size=8,
                               target_layer_ids=KIMI_DFLASH_TAPS)


def experts_touched(engine: Engine, n: int) -> tuple[float, float]:
    """Experts per MoE layer that one step's rows route to (the mean over layers), of all and of this rank's: an
    eager forward of n random tokens at the step's positions (the timed steps sample theirs at T = 1)."""
    ids = np.random.default_rng(n).integers(0, engine.config.vocab_size, n).tolist()
    _, routing = engine.native.forward_logits(ids, list(range(n)), [CONTEXT - 1] * n, with_routing=True)
    layout = shard_layout(engine.config, engine.shard)
    touched = [np.unique(layer) for layer in routing]
    local = [np.count_nonzero((t >= layout.first_expert) & (t < layout.first_expert + layout.experts))
             for t in touched]
    return float(np.mean([len(t) for t in touched])), float(np.mean(local))


def measure(engine: Engine, iters: int) -> list[dict]:
    native = engine.native
    native.randomize_cache(1)
    rows = []
    for n in STREAMS:
        positions = [CONTEXT - 1] * n
        step_s, host_s = native.time_decode(n, positions, iters, temperature=SAMPLE_TEMPERATURE)
        profile = dict(native.profile_step(n, positions, 2, temperature=SAMPLE_TEMPERATURE))
        local_ms = profile.get("sum_partials", 0.0) * 1e3
        in_graph_ms = native.time_collectives(n, iters) * 1e3
        experts, local_experts = experts_touched(engine, n)
        rows.append({"streams": n, "context": CONTEXT, "step_ms": step_s * 1e3, "host_us_per_step": host_s * 1e6,
                     "local_collectives_ms": local_ms, "local_collectives_per_step": 2 * K2_LAYERS,
                     "collectives_in_graph_ms": in_graph_ms, "experts_per_layer": experts,
                     "local_experts_per_layer": local_experts,
                     "breakdown_ms": {k: v * 1e3 for k, v in sorted(profile.items(), key=lambda kv: -kv[1])}})
        print(f"rank {RANK} of {RANKS}: {n} streams: {step_s * 1e3:.3f} ms/step, local collectives "
              f"{local_ms:.3f} ms eager, {in_graph_ms:.3f} ms in a graph, host {host_s * 1e6:.1f} us, "
              f"{experts:.1f} experts per layer ({local_experts:.1f} of this rank's)", flush=True)
    return rows


def measure_rounds(engine: Engine, cfg, mean_accept: float, iters: int) -> list[dict]:
    """Per-rank DDTree rounds with oracle candidates at `mean_accept`, prompts of CONTEXT - NEW_TOKENS tokens."""
    depth = engine.drafter_config.block_size - 1
    hit = [hit_for(mean_accept, depth)] * depth
    rows = []
    for n in STREAMS:
        prompts = random_prompts(cfg.vocab_size, n, CONTEXT - NEW_TOKENS, seed=n)
        ar = decode_ar(engine, prompts, NEW_TOKENS)
        for budget in BUDGETS:
            decode_ddtree(engine, prompts, NEW_TOKENS, budget, ar.tokens, hit)  # captures the round's graphs
            dd = decode_ddtree(engine, prompts, NEW_TOKENS, budget, ar.tokens, hit)
            exact = dd.tokens == ar.tokens
            rows.append({"streams": n, "budget": budget, "round_ms": dd.round_seconds * 1e3,
                         "mean_accept": dd.mean_accept, "exact": exact,
                         "host_us_per_round": dd.host_seconds_per_round * 1e6,
                         "collectives_in_graph_ms": engine.native.time_collectives(n * (budget + 1), iters) * 1e3})
            print(f"rank {RANK} of {RANKS}: {n} streams, budget {budget}: {dd.round_seconds * 1e3:.3f} ms/round, "
                  f"accept {dd.mean_accept:.2f}, tokens equal AR's: {exact}", flush=True)
    return rows


def project(measured: list[dict], rounds: list[dict]) -> list[dict]:
    """8 x H200 AR and DDTree from the measured rank steps and rounds (see the module's docstring), beside
    ddtree.estimate's model of the same rank (no collectives) and of the 8 x H200 layout (modelled gathers)."""
    model = fitted()
    lay = Layout(GPUS["h200"], RANKS, K2_LAYERS)
    out = []
    for m in measured:
        n = m["streams"]
        gathers = model.gathered_collectives_ms(lay, n)
        ar_model = model.ar_step(lay, n, m["context"])
        rank_ms = m["step_ms"] - m["collectives_in_graph_ms"]  # less the stand-ins' and sums' in-graph time
        row = {"streams": n, "ar_step_ms": rank_ms + gathers, "ar_tokens_per_s": n / (rank_ms + gathers) * 1e3,
               "ar_collectives_ms": gathers, "rank_step_ms": rank_ms,
               "model_rank_step_ms": ar_model.total - ar_model.collectives, "model_ar_step_ms": ar_model.total,
               "model_experts_per_layer": model.routing.active(n, 1), "ddtree": []}
        for r in (r for r in rounds if r["streams"] == n):
            b = model.round(lay, n, r["budget"], m["context"], r["mean_accept"])
            collectives = model.gathered_collectives_ms(lay, n * (r["budget"] + 1))
            rank_ms = r["round_ms"] - r["collectives_in_graph_ms"]
            round_ms = rank_ms + collectives
            row["ddtree"].append({"budget": r["budget"], "rank_round_ms": rank_ms, "round_ms": round_ms,
                                  "collectives_ms": collectives, "mean_accept": r["mean_accept"],
                                  "tokens_per_s": n * r["mean_accept"] / round_ms * 1e3,
                                  "model_rank_round_ms": b.total - b.collectives, "model_round_ms": b.total,
                                  "model_tokens_per_s": n * r["mean_accept"] / b.total * 1e3})
        out.append(row)
    return out


def write_reports(out: Path, report: dict) -> None:
    lines = start_report(out, "ranksim", "Rank simulation", report) + [
        f"Rank {RANK} of {RANKS} of the {K2_LAYERS}-layer K2 target, its peers simulated by local copies "
        f"(tools/bench_ranksim.py); context {CONTEXT}; weights {report['weights_gib']:.1f} GiB on this GPU.", "",
        "## Per-rank AR step (CUDA graph replay)", "",
        "| streams | ms/step | host us/step | local collectives ms (eager) | in a graph |", "|---|---|---|---|---|"]
    for m in report["measured"]:
        in_graph = m.get("collectives_in_graph_ms")
        lines.append(f"| {m['streams']} | {m['step_ms']:.3f} | {m['host_us_per_step']:.1f} | "
                     f"{m['local_collectives_ms']:.3f} | {'-' if in_graph is None else f'{in_graph:.3f}'} |")
    if all("experts_per_layer" in m for m in report["measured"]):
        experts = report["routed_experts"]
        lines += ["", "Routed experts per MoE layer that a step's rows choose (an eager forward of random tokens at "
                  "the step's positions; mean over layers), against ddtree.estimate's routing fit (4-layer engines):",
                  "",
                  f"| streams | of the {experts} | of this rank's {experts // RANKS} | model, of the {experts} |",
                  "|---|---|---|---|"]
        for m, p in zip(report["measured"], report["projection"]):
            lines.append(f"| {m['streams']} | {m['experts_per_layer']:.1f} | {m['local_experts_per_layer']:.1f} | "
                         f"{p['model_experts_per_layer']:.1f} |")
    lines += ["", f"## Per-rank DDTree rounds (oracle candidates, target mean accept {report['mean_accept']:g})", "",
              "| streams | budget | ms/round | mean accept | host us/round | tokens equal AR's |", "|---|---|---|---|---|---|"]
    for r in report["rounds"]:
        lines.append(f"| {r['streams']} | {r['budget']} | {r['round_ms']:.3f} | {r['mean_accept']:.2f} | "
                     f"{r['host_us_per_round']:.1f} | {'yes' if r['exact'] else 'NO'} |")
    lines += ["", "## ddtree.estimate's model of this rank (fitted on 4-layer engines: held out)", "",
              "The model's rank forward has no collectives. Measured: the rank's step and round less their "
              "collectives (the stand-in copies and rank-order sums) timed apart in a graph.", "",
              "| streams | budget | measured ms | model ms | model error |", "|---|---|---|---|---|"]
    for p in report["projection"]:
        lines.append(f"| {p['streams']} | AR | {p['rank_step_ms']:.2f} | {p['model_rank_step_ms']:.2f} | "
                     f"{p['model_rank_step_ms'] / p['rank_step_ms'] - 1:+.1%} |")
        for d in p["ddtree"]:
            lines.append(f"| {p['streams']} | {d['budget']} | {d['rank_round_ms']:.2f} | "
                         f"{d['model_rank_round_ms']:.2f} | {d['model_rank_round_ms'] / d['rank_round_ms'] - 1:+.1%} |")
    lines += ["", "## 8 x H200 projection", "",
              "The rank's measured step and round, less their local collectives timed in a graph, plus the "
              "modelled NCCL all-gathers of the runtime's design (not measured: ddtree.estimate's latency and "
              "NVLink bytes). DDTree at the round's measured acceptance; model: ddtree.estimate's 8 x H200 round at "
              "the same acceptance.", "",
              "| streams | AR ms | AR tok/s | gathers ms | model AR ms | "
              + " | ".join(f"DDTree b={b} ms | tok/s | model tok/s" for b in BUDGETS) + " |",
              "|---|---|---|---|---|" + "---|---|---|" * len(BUDGETS)]
    for p in report["projection"]:
        cells = " | ".join(f"{d['round_ms']:.2f} | {d['tokens_per_s']:.0f} | {d['model_tokens_per_s']:.0f}"
                           for d in p["ddtree"])
        lines.append(f"| {p['streams']} | {p['ar_step_ms']:.2f} | {p['ar_tokens_per_s']:.0f} | "
                     f"{p['ar_collectives_ms']:.3f} | {p['model_ar_step_ms']:.2f} | {cells} |")
    lines += ["", "### Step breakdown (eager step, one op at a time, ms summed over layers)", ""]
    for m in report["measured"]:
        lines.append(f"- {m['streams']} streams: " + ", ".join(f"{k} {v:.3f}" for k, v in m["breakdown_ms"].items()))
    (out / "ranksim.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="report folder")
    parser.add_argument("--iters", type=int, default=20, help="replays per timing (default 20)")
    parser.add_argument("--mean-accept", type=float, default=4.0,
                        help="the oracle's target tokens committed per round per stream (default 4)")
    parser.add_argument("--from-json", type=Path, default=None, metavar="RANKSIM_JSON",
                        help="no GPU: project a committed ranksim.json's measurements again with the current model")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        report = json.loads(args.from_json.read_text())
        report["projection"] = project(report["measured"], report["rounds"])
        write_reports(args.out, report)
        print(f"wrote {args.out}/ranksim.json, {args.out}/ranksim.md")
        return 0
    if not has_cuda_device():
        print("bench_ranksim needs a CUDA device", file=sys.stderr)
        return 2
    start = time.time()
    cfg = preset_config("k2-layers", K2_LAYERS)
    bw = copy_bandwidth()
    torch.cuda.empty_cache()  # the copy's 8 GiB back to the device before the engine's pre-flight
    engine = Engine.random(cfg, streams=max(STREAMS), max_context=2 * CONTEXT, budget=max(BUDGETS),
                           drafter=kimi_dflash(cfg), shard=Shard(RANK, RANKS))
    print(f"engine of rank {RANK} of {RANKS} ready in {time.time() - start:.0f} s", flush=True)
    measured = measure(engine, args.iters)
    rounds = measure_rounds(engine, cfg, args.mean_accept, args.iters)
    from ddtree import _native

    plan = _native.plan_memory(engine_dims(cfg), RANK, RANKS, 1, max(STREAMS), 2 * CONTEXT, 0)
    report = {"model": f"k2-layers, {K2_LAYERS} layers, rank {RANK} of {RANKS} (random weights)",
              "device": str(device_info()), "copy_bandwidth_gbs": bw / 1e9, "weights_gib": plan["weights"] / 2**30,
              "mean_accept": args.mean_accept, "routed_experts": cfg.n_routed_experts, "measured": measured,
              "rounds": rounds,
              "projection": project(measured, rounds), "seconds": time.time() - start}
    write_reports(args.out, report)
    print(f"wrote {args.out}/ranksim.json, {args.out}/ranksim.md in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
