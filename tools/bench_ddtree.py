#!/usr/bin/env python3
"""Benchmark DDTree rounds on the GPU (drafter, tree kernels and verify in one replayed CUDA graph) against
autoregressive decoding of the same engine, at K2 dims with random weights.

Reports, from one run on one GPU:
- the published reference loop's model: K2 dims, 3 layers (layer 0 dense, 2 MoE, INT4 experts), a DFlash drafter
  of 2 layers (hidden 7168, 56 query / 8 KV heads of 128, intermediate 12288, block 16), prompt 128, 1 stream: AR
  ms per token and DDTree ms per round at budgets 8 / 32 / 64, each round split by stage (eager rounds, one stage
  at a time) against its byte floor, beside the published figures measured on an H200;
- the Kimi-K2.5-DFlash drafter shape (6 layers, block 8; fc over the 4 taps a 4-layer target has) on k2-layers with
  4 layers: the same per-round split;
- tokens/s of DDTree against AR of the same engine with ORACLE candidates (the drafter's forward and top-K run,
  then an oracle replaces its candidates with ones that hold the target's own continuation at rank 0 with a set
  probability per depth: random-weight drafters accept nothing) at mean accepted lengths about 1, 2, 4 and 7,
  budgets {8, 32, 64}, streams {1, 4, 16}.
Writes ddtree.json, ddtree.md and ddtree.png to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ddtree import Engine
from ddtree.bench.oracle import decode_ar, decode_ddtree, hit_for, random_prompts
from ddtree.device import device_info
from ddtree.drafter import DrafterConfig, drafter_config_for
from ddtree.presets import preset_config

from bench_report import pyplot, start_report
from bench_verify import expert_bytes, weight_bytes
from cuda_timing import copy_bandwidth

PROMPT = 128
NEW_TOKENS = 96
BUDGETS = (8, 32, 64)
STREAMS = (1, 4, 16)
MEAN_ACCEPTED = (1, 2, 4, 7)
# The published reference loop (HF transformers, bf16 experts) on an H200, same model shape.
PUBLISHED = {"ar_ms": 6.30, "round_ms": {8: 12.85, 32: 19.48, 64: 24.51}}


def drafter(cfg, layers: int, heads: int, inter: int, block: int, taps: tuple[int, ...]) -> DrafterConfig:
    base = drafter_config_for(cfg, "k2-layers")
    return dataclasses.replace(base, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
                               head_dim=128, intermediate_size=inter, block_size=block, target_layer_ids=taps)


def round_floor_bytes(cfg, dcfg: DrafterConfig, streams: int, budget: int, context: int) -> dict[str, float]:
    """Bytes a round must read at least: every target weight once (the routed experts that `streams x (budget + 1)`
    rows activate, expected under uniform top-k routing), the drafter's weights and the LM head once more for its
    block, each stream's latent KV and draft KV once."""
    rows = streams * (budget + 1)
    moe_layers = sum(cfg.is_moe_layer(layer) for layer in range(cfg.num_hidden_layers))
    active = cfg.n_routed_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** rows)
    h, q, kv, inter = dcfg.hidden_size, dcfg.num_attention_heads * dcfg.head_dim, \
        dcfg.num_key_value_heads * dcfg.head_dim, dcfg.intermediate_size
    draft_layer = 2 * h * (q + 2 * kv + q + 3 * inter)
    latent = cfg.num_hidden_layers * streams * context * 2 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    return {"target weights": float(sum(weight_bytes(cfg).values())),
            "routed experts": moe_layers * active * expert_bytes(cfg),
            "drafter weights": float(dcfg.num_hidden_layers * draft_layer + 2 * dcfg.context_width * h),
            "drafter lm_head": float(cfg.vocab_size * h * 2),
            "kv": float(latent + dcfg.num_hidden_layers * streams * context * kv * 2 * 2)}


def prompts_for(cfg, streams: int, seed: int) -> list[list[int]]:
    return random_prompts(cfg.vocab_size, streams, PROMPT, seed)


def measure_rounds(engine: Engine, cfg, dcfg: DrafterConfig, bw: float, label: str) -> list[dict]:
    """AR ms per token, then per budget the replayed round's ms and the eager round's stage split (1 stream)."""
    native, prompts = engine.native, prompts_for(cfg, 1, 0)
    ar = engine.generate(prompts, NEW_TOKENS, method="ar", stop_token_ids=())[0]
    ar_ms = ar.decode_seconds / (NEW_TOKENS - 1) * 1e3
    out = []
    for budget in BUDGETS:
        native.generate_ddtree(prompts, NEW_TOKENS, 0.0, 0, budget)  # every graph captured before the timed run
        replayed = native.generate_ddtree(prompts, NEW_TOKENS, 0.0, 0, budget)
        rounds = len(replayed["accept_lengths"][0])
        eager = native.generate_ddtree(prompts, NEW_TOKENS, 0.0, 0, budget, profile=True)
        eager_rounds = len(eager["accept_lengths"][0])
        stages = {k: v / eager_rounds * 1e3 for k, v in eager["stages"]}
        floor = round_floor_bytes(cfg, dcfg, 1, budget, PROMPT + NEW_TOKENS // 2)
        floor_ms = sum(floor.values()) / bw * 1e3
        round_ms = replayed["decode_seconds"] / rounds * 1e3
        out.append({"model": label, "budget": budget, "ar_ms_per_token": ar_ms, "round_ms": round_ms,
                    "eager_round_ms": sum(stages.values()), "stage_ms": stages, "floor_ms": floor_ms,
                    "floor_bytes": floor, "of_floor": floor_ms / round_ms,
                    "host_us_per_round": replayed["host_seconds_per_round"] * 1e6,
                    "mean_accept": float(np.mean(replayed["accept_lengths"][0]))})
        r = out[-1]
        print(f"{label} budget {budget}: round {round_ms:.2f} ms (eager {r['eager_round_ms']:.2f}), floor "
              f"{floor_ms:.2f} ms ({100 * r['of_floor']:.0f}%), AR {ar_ms:.2f} ms/token, host "
              f"{r['host_us_per_round']:.1f} us/round", flush=True)
    return out


def measure_throughput(engine: Engine, cfg, depth: int, streams_list=STREAMS, budgets=BUDGETS,
                       means=MEAN_ACCEPTED, new_tokens: int = NEW_TOKENS, prompts_of=None) -> list[dict]:
    """Tokens/s per stream count: AR, and DDTree with oracle candidates at each acceptance profile and budget, each
    timed on its second run (the first captures the graphs). prompts_of(streams) gives the prompts (default
    prompts_for, seeded by the stream count)."""
    out = []
    for streams in streams_list:
        prompts = prompts_of(streams) if prompts_of is not None else prompts_for(cfg, streams, streams)
        decode_ar(engine, prompts, new_tokens)
        ar = decode_ar(engine, prompts, new_tokens)
        for mean in means:
            hit = [hit_for(mean, depth)] * depth
            for budget in budgets:
                decode_ddtree(engine, prompts, new_tokens, budget, reference=ar.tokens, hit=hit)
                run = decode_ddtree(engine, prompts, new_tokens, budget, reference=ar.tokens, hit=hit)
                assert run.tokens == ar.tokens, "DDTree tokens differ from AR's"
                out.append({"streams": streams, "budget": budget, "target_mean_accept": mean,
                            "mean_accept": run.mean_accept, "ddtree_tokens_per_s": run.tokens_per_second,
                            "ar_tokens_per_s": ar.tokens_per_second,
                            "speedup": run.tokens_per_second / ar.tokens_per_second,
                            "round_ms": run.round_seconds * 1e3})
                r = out[-1]
                print(f"{streams} streams, budget {budget}, accept {r['mean_accept']:.2f}: "
                      f"{r['ddtree_tokens_per_s']:.0f} tok/s vs AR {r['ar_tokens_per_s']:.0f} ({r['speedup']:.2f}x)",
                      flush=True)
    return out


def write_reports(out: Path, report: dict) -> None:
    lines = start_report(out, "ddtree", "DDTree rounds on the GPU", report) + [
        "Random weights. A round = drafter block forward + per-depth top-K + tree build + verify forward with taps + "
        "sampling + accept + commit + drafter context append, replayed from one CUDA graph; ms per round = device "
        "time of the generation's rounds / rounds (the host keeps one round queued). Stage split: the same rounds "
        "run eagerly, each stage timed by CUDA events (so their sum exceeds the replayed round by the launch gaps). "
        "Floor: every weight byte read once per forward (the routed experts under uniform top-k routing of the "
        "round's rows), the drafter's weights and its LM head, each stream's latent and draft KV, over the copy "
        "bandwidth.", "",
        "## Per round, 1 stream, prompt 128", "",
        "| model | budget | round ms | floor ms | of floor | eager sum ms | AR ms/token | published round ms | "
        "published AR ms/token | host us/round |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rounds"]:
        published = PUBLISHED["round_ms"][r["budget"]] if r["model"] == "published reference model" else None
        lines.append(f"| {r['model']} | {r['budget']} | {r['round_ms']:.2f} | {r['floor_ms']:.2f} | "
                     f"{100 * r['of_floor']:.0f}% | {r['eager_round_ms']:.2f} | {r['ar_ms_per_token']:.2f} | "
                     f"{published if published else '-'} | "
                     f"{PUBLISHED['ar_ms'] if published else '-'} | {r['host_us_per_round']:.1f} |")
    lines += ["", "Stage split (eager, ms per round):", ""]
    for r in report["rounds"]:
        parts = ", ".join(f"{k} {v:.3f}" for k, v in sorted(r["stage_ms"].items(), key=lambda kv: -kv[1]))
        lines.append(f"- {r['model']}, budget {r['budget']}: {parts}")
    lines += ["", "## Tokens/s with ORACLE candidates (Kimi drafter shape on k2-layers 4 layers)", "",
              "The drafter's forward and top-K run; an oracle then replaces the candidates. Tokens equal AR's in "
              "every run (checked).", "",
              "| streams | budget | mean accepted (measured) | DDTree tok/s | AR tok/s | speedup | round ms |",
              "|---|---|---|---|---|---|---|"]
    for r in report["throughput"]:
        lines.append(f"| {r['streams']} | {r['budget']} | {r['mean_accept']:.2f} | {r['ddtree_tokens_per_s']:.0f} | "
                     f"{r['ar_tokens_per_s']:.0f} | {r['speedup']:.2f} | {r['round_ms']:.2f} |")
    (out / "ddtree.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(STREAMS), figsize=(5 * len(STREAMS), 4))
    for ax, streams in zip(axes, STREAMS):
        rows = [r for r in report["throughput"] if r["streams"] == streams]
        for budget in BUDGETS:
            pts = [r for r in rows if r["budget"] == budget]
            ax.plot([r["mean_accept"] for r in pts], [r["ddtree_tokens_per_s"] for r in pts], "o-",
                    label=f"DDTree budget {budget} (oracle)")
        ax.axhline(rows[0]["ar_tokens_per_s"], color="k", linestyle="--", label="AR")
        ax.set_title(f"{streams} stream(s)")
        ax.set_xlabel("mean accepted length per round")
    axes[0].set_ylabel("tokens/s (all streams)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ddtree.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ddtree needs a CUDA device", file=sys.stderr)
        return 2
    start = time.time()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    max_context = PROMPT + NEW_TOKENS + 16
    cfg3 = preset_config("k2-layers", 3)
    published = drafter(cfg3, 2, 56, 12288, 16, (0, 1))
    engine = Engine.random(cfg3, 1, max_context, budget=max(BUDGETS), drafter=published)
    rounds = measure_rounds(engine, cfg3, published, bw, "published reference model")
    del engine
    cfg4 = preset_config("k2-layers", 4)
    kimi = drafter(cfg4, 6, 64, 18432, 8, (0, 1, 2, 3))
    engine = Engine.random(cfg4, max(STREAMS), max_context, budget=max(BUDGETS), drafter=kimi)
    rounds += measure_rounds(engine, cfg4, kimi, bw, "Kimi-K2.5-DFlash shape, k2-layers 4 layers")
    throughput = measure_throughput(engine, cfg4, kimi.block_size - 1)
    report = {"model": "K2 dims, random weights", "device": str(device_info()), "copy_bandwidth_gbs": bw / 1e9,
              "prompt": PROMPT, "new_tokens": NEW_TOKENS, "published": PUBLISHED, "rounds": rounds,
              "throughput": throughput, "seconds": time.time() - start}
    write_reports(args.out, report)
    print(f"wrote {args.out} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
