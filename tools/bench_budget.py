#!/usr/bin/env python3
"""Benchmark the cost-aware budget per round (budget="auto") against every fixed budget on the same workloads.

Workloads, greedy, -n 128 per stream, no stop tokens, at 1 and 4 streams:
- the built-in demo pair (trained target and drafter of block 16) on eval_demo's held-out prompts
  (bench/results/demo/held_out_prompts.json, cut to 128 tokens), the drafter's own candidates;
- K2 dims with random weights, the target of 4 layers: the Kimi-K2.5-DFlash drafter shape (6 layers, block 8) and
  a drafter of block 16 (the published reference loop's: 2 layers), each with ORACLE candidates (the drafter's
  forward and top-K run, then candidates that hold the target's own continuation at rank 0 with a set probability
  per depth replace them) at low, middle and high mean accept lengths.
Every configuration runs twice and the second run is timed (the first captures the graphs; under auto it also times
each (stream count, candidate) round graph once by replays, the round times auto chooses by). tokens/s: all
streams' tokens after the prefill's over the decode phase's device time, summed over the workload's prompt groups.
Every DDTree run's tokens must equal AR's (checked). Writes budget.json, budget.md and budget.png to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PROMPTS_FILE = ROOT / "bench" / "results" / "demo" / "held_out_prompts.json"
PROMPT = 128
NEW_TOKENS = 128
FIXED = (8, 16, 32, 64)
STREAMS = (1, 4)
GROUPS = 2  # prompt groups per stream count (1 stream: 2 prompts one after the other; 4 streams: 8 prompts)
# Oracle profiles: mean tokens per round (accepted nodes + the bonus token) per drafter depth.
PROFILES = {7: (2.0, 4.0, 6.5), 15: (2.0, 5.0, 10.0)}


def held_out_prompts(count: int) -> list[list[int]]:
    prompts = json.loads(PROMPTS_FILE.read_text())
    return [p["ids"][:PROMPT] for p in prompts[:count]]


@dataclasses.dataclass
class Tally:
    """One configuration's runs over the prompt groups: tokens, device seconds, rounds per budget, accepts."""

    tokens: int = 0
    seconds: float = 0.0
    accepts: list[int] = dataclasses.field(default_factory=list)
    budgets: dict[int, int] = dataclasses.field(default_factory=dict)
    exact: bool = True

    def add(self, run, ar_tokens) -> None:
        self.tokens += sum(len(t) - 1 for t in run.tokens)
        self.seconds += run.decode_seconds
        self.accepts += [a for s in run.accept_lengths for a in s]
        for b, n in run.budget_counts.items():
            self.budgets[b] = self.budgets.get(b, 0) + n
        self.exact = self.exact and run.tokens == ar_tokens

    def row(self, **key) -> dict:
        return {**key, "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
                "mean_accept": float(np.mean(self.accepts)) if self.accepts else 1.0,
                "budget_rounds": {str(b): n for b, n in sorted(self.budgets.items())}, "exact": self.exact}


def run_workload(engine, label: str, groups: dict[int, list[list[list[int]]]], profiles: tuple, depth: int,
                 log) -> list[dict]:
    """Rows of one engine: per stream count and oracle profile (None: the drafter's own candidates), AR, every fixed
    budget and auto."""
    from ddtree.bench.oracle import decode_ar, decode_ddtree, hit_for

    rows = []
    for streams, prompt_groups in groups.items():
        ars = []
        ar_tally = Tally()
        for prompts in prompt_groups:
            decode_ar(engine, prompts, NEW_TOKENS)
            ar = decode_ar(engine, prompts, NEW_TOKENS)
            ars.append(ar)
            ar_tally.tokens += sum(len(t) - 1 for t in ar.tokens)
            ar_tally.seconds += ar.decode_seconds
        rows.append(ar_tally.row(workload=label, streams=streams, profile=None, budget="ar"))
        for target in profiles:
            for budget in FIXED + ("auto",):
                tally = Tally()
                for prompts, ar in zip(prompt_groups, ars):
                    oracle = {} if target is None else {"reference": ar.tokens, "hit": [hit_for(target, depth)] * depth}
                    decode_ddtree(engine, prompts, NEW_TOKENS, budget, **oracle)
                    tally.add(decode_ddtree(engine, prompts, NEW_TOKENS, budget, **oracle), ar.tokens)
                rows.append(tally.row(workload=label, streams=streams, profile=target, budget=budget))
                r = rows[-1]
                log(f"{label}, {streams} stream(s), profile {target}, budget {budget}: {r['tokens_per_s']:.0f} tok/s, "
                    f"accept {r['mean_accept']:.2f}, rounds per budget {r['budget_rounds']}, exact {r['exact']}")
                if not r["exact"]:
                    raise AssertionError(f"{label}: DDTree tokens differ from AR's at budget {budget}")
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per (workload, streams, profile): the best fixed budget and auto against it."""
    out = []
    keys = sorted({(r["workload"], r["streams"], r["profile"] if r["profile"] is not None else -1) for r in rows
                   if r["budget"] != "ar"})
    for workload, streams, profile in keys:
        profile = None if profile == -1 else profile
        same = [r for r in rows if r["workload"] == workload and r["streams"] == streams
                and r["profile"] == profile]
        fixed = [r for r in same if isinstance(r["budget"], int)]
        auto = next(r for r in same if r["budget"] == "auto")
        ar = next(r for r in rows if r["workload"] == workload and r["streams"] == streams and r["budget"] == "ar")
        best = max(fixed, key=lambda r: r["tokens_per_s"])
        out.append({"workload": workload, "streams": streams, "profile": profile, "best_fixed": best["budget"],
                    "best_fixed_tokens_per_s": best["tokens_per_s"], "auto_tokens_per_s": auto["tokens_per_s"],
                    "auto_over_best": auto["tokens_per_s"] / best["tokens_per_s"] if best["tokens_per_s"] else 0.0,
                    "auto_budget_rounds": auto["budget_rounds"], "ar_tokens_per_s": ar["tokens_per_s"],
                    "fixed_tokens_per_s": {str(r["budget"]): r["tokens_per_s"] for r in fixed}})
    return out


def write_reports(out: Path, report: dict) -> None:
    from bench_report import pyplot, start_report

    lines = start_report(out, "budget", "Cost-aware budget per round against fixed budgets", report) + [
        f"Greedy, {report['new_tokens']} new tokens per stream after a {report['prompt']}-token prompt, no stop "
        "tokens; every configuration timed on its second run. auto: each round's budget among 8, 16, 32, 64 "
        "maximising expected tokens per round (the round's probe of the tree's path probabilities, calibrated by the "
        "accept lengths seen) over the round time (each (streams, budget) round graph timed once by replays). "
        "Profile: the oracle's target mean tokens per round (none: the drafter's own candidates).", "",
        "| workload | streams | profile | AR tok/s | " + " | ".join(f"budget {b}" for b in FIXED) +
        " | best fixed | auto tok/s | auto / best | auto's rounds per budget |",
        "|---|---|---|---|" + "---|" * len(FIXED) + "---|---|---|---|"]
    for s in report["summary"]:
        fixed = " | ".join(f"{s['fixed_tokens_per_s'][str(b)]:.0f}" for b in FIXED)
        mix = ", ".join(f"{b}: {n}" for b, n in s["auto_budget_rounds"].items())
        lines.append(f"| {s['workload']} | {s['streams']} | {s['profile'] if s['profile'] is not None else '-'} | "
                     f"{s['ar_tokens_per_s']:.0f} | {fixed} | {s['best_fixed']} | {s['auto_tokens_per_s']:.0f} | "
                     f"{s['auto_over_best']:.2f} | {mix} |")
    wins = sum(s["auto_over_best"] >= 0.98 for s in report["summary"])
    lines += ["", f"auto within 2% of the best fixed budget or above it in {wins} of {len(report['summary'])} "
              "workloads.", ""]
    (out / "budget.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    if plt is None:
        return
    summary = report["summary"]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(summary)), 4))
    width = 0.8 / (len(FIXED) + 1)
    x = np.arange(len(summary))
    for i, b in enumerate(FIXED):
        ax.bar(x + i * width, [s["fixed_tokens_per_s"][str(b)] / s["best_fixed_tokens_per_s"] for s in summary],
               width, label=f"budget {b}")
    ax.bar(x + len(FIXED) * width, [s["auto_over_best"] for s in summary], width, label="auto", color="k")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(x + 0.4 - width / 2, [f"{s['workload'].split(',')[0]}\n{s['streams']} str, "
                                        f"{s['profile'] if s['profile'] is not None else 'drafter'}"
                                        for s in summary], fontsize=6)
    ax.set_ylabel("tokens/s over the best fixed budget")
    ax.legend(fontsize=7, ncol=len(FIXED) + 1)
    fig.tight_layout()
    fig.savefig(out / "budget.png", dpi=120)
    plt.close(fig)


def k2_engine(layers: int, drafter_layers: int, heads: int, inter: int, block: int, taps: tuple[int, ...]):
    from ddtree import Engine
    from ddtree.drafter import drafter_config_for
    from ddtree.presets import preset_config

    cfg = preset_config("k2-layers", layers)
    base = drafter_config_for(cfg, "k2-layers")
    dcfg = dataclasses.replace(base, num_hidden_layers=drafter_layers, num_attention_heads=heads,
                               num_key_value_heads=8, head_dim=128, intermediate_size=inter, block_size=block,
                               target_layer_ids=taps)
    return Engine.random(cfg, max(STREAMS), PROMPT + NEW_TOKENS + 16, budget=max(FIXED), drafter=dcfg), cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_budget needs a CUDA device", file=sys.stderr)
        return 2
    from cuda_timing import copy_bandwidth
    from ddtree import Engine
    from ddtree.bench.oracle import random_prompts
    from ddtree.cli import DEFAULT_MODEL_DIR
    from ddtree.device import device_info

    start = time.time()

    def log(text: str) -> None:
        print(f"[{time.time() - start:5.0f} s] {text}", flush=True)

    bw = copy_bandwidth()
    prompts = held_out_prompts(GROUPS * max(STREAMS))
    groups = {s: [prompts[g * s:(g + 1) * s] for g in range(GROUPS)] for s in STREAMS}
    engine = Engine(DEFAULT_MODEL_DIR, DEFAULT_MODEL_DIR / "drafter", streams=max(STREAMS),
                    max_context=PROMPT + NEW_TOKENS + 16, budget=max(FIXED))
    rows = run_workload(engine, "demo pair, held-out prompts", groups, (None,), 15, log)
    del engine
    for label, shape in (("K2 dims 4 layers, Kimi-K2.5-DFlash shape (block 8)", (4, 6, 64, 18432, 8, (0, 1, 2, 3))),
                         ("K2 dims 4 layers, drafter of block 16", (4, 2, 56, 12288, 16, (0, 3)))):
        engine, cfg = k2_engine(*shape)
        depth = shape[4] - 1
        k2_groups = {s: [random_prompts(cfg.vocab_size, s, PROMPT, 100 * s + g) for g in range(GROUPS)]
                     for s in STREAMS}
        rows += run_workload(engine, label, k2_groups, PROFILES[depth], depth, log)
        del engine
        torch.cuda.empty_cache()
    report = {"model": "demo pair and K2 dims with random weights", "device": str(device_info()),
              "copy_bandwidth_gbs": bw / 1e9, "prompt": PROMPT, "new_tokens": NEW_TOKENS, "fixed": list(FIXED),
              "streams": list(STREAMS), "rows": rows, "summary": summarize(rows), "seconds": time.time() - start}
    write_reports(args.out, report)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
