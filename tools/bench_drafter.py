#!/usr/bin/env python3
"""Benchmark the GPU DFlash drafter at the Kimi-K2.5-DFlash shape (6 layers) and at 2 layers.

Reports, from one run on one GPU, for streams {1, 4, 16} x context {1k, 8k} (8 context rows appended per stream, a
fully accepted block of the previous round):
- device time per stage (the context append, the block forward, the LM head over the B - 1 rows; eager, one launch
  at a time, per-operation CUDA events) and of the whole draft launched back to back, against the byte floor:
  every drafter weight byte, the LM head and the draft KV read once, over the copy bandwidth measured here;
- a torch peer in the same run: the same math in torch bf16 (cuBLAS matmuls, F.rms_norm, rotate-half RoPE, SDPA
  with GQA over a cache with room for the block's rows, torch.topk over log_softmax), per stage.
The per-depth top-K is the lead's kernel (kernels/topk.cuh): its stage is the hook DrafterModel::block_forward
names, reported here for the torch peer only. Weights and the cache are random. Writes drafter.json, drafter.md
and drafter.png to --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ddtree import Engine
from ddtree.device import device_info
from ddtree.drafter import parse_drafter_config
from ddtree.drafter_engine import GpuDrafter
from ddtree.presets import preset_config

from bench_engine import median_ms
from bench_report import pyplot, start_report
from cuda_timing import copy_bandwidth

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from drafter_replica import kimi_dflash_config_json  # noqa: E402

STREAMS = (1, 4, 16)
CONTEXTS = (1024, 8192)
LAYERS = (6, 2)
APPENDED = 8  # context rows per stream per round
TOP_K = 32
STAGES = ("append", "block", "lm_head", "top_k")


def drafter_config(layers: int):
    raw = kimi_dflash_config_json("real")
    raw.update(num_hidden_layers=layers, layer_types=["full_attention"] * layers, max_window_layers=layers)
    return parse_drafter_config(raw)


def floor_bytes(cfg, streams: int, context: int) -> dict[str, float]:
    """Bytes each stage must read at least: the append its fc and every layer's k/v rows, the block every layer's
    weights and each stream's cached KV, the LM head its table, the top-K the fp32 logits."""
    h, q, kv, inter = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, \
        cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    layer = 2 * h * (q + 2 * kv + q + 3 * inter)
    cache = cfg.num_hidden_layers * streams * context * kv * 2 * 2
    logits = 4 * streams * (cfg.block_size - 1) * cfg.vocab_size
    out = {"append": 2 * h * cfg.context_width + cfg.num_hidden_layers * 2 * h * 2 * kv,
           "block": cfg.num_hidden_layers * layer + cache, "lm_head": 2 * cfg.vocab_size * h, "top_k": logits}
    out["draft"] = sum(out.values())
    return out


def gqa_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA with grouped KV heads: torch's own GQA path where it has one (torch >= 2.5), else repeated heads."""
    try:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    except TypeError:
        group = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))


def stage_of(op: str) -> str:
    return op.split(".")[0]


class TorchPeer:
    """The drafter's math in torch bf16 on random weights of the same shapes."""

    def __init__(self, cfg, streams: int, context: int) -> None:
        self.cfg, self.streams, self.context = cfg, streams, context
        c = cfg
        self.q_dim, self.kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        bf = dict(device="cuda", dtype=torch.bfloat16)
        rnd = lambda *shape: torch.randn(*shape, **bf) * shape[-1] ** -0.5  # noqa: E731
        self.fc = rnd(c.hidden_size, c.context_width)
        self.layers = [{"qkv": rnd(self.q_dim + 2 * self.kv_dim, c.hidden_size), "o": rnd(c.hidden_size, self.q_dim),
                        "gate_up": rnd(2 * c.intermediate_size, c.hidden_size),
                        "down": rnd(c.hidden_size, c.intermediate_size)} for _ in range(c.num_hidden_layers)]
        self.norm = torch.ones(c.hidden_size, **bf)
        self.head_norm = torch.ones(c.head_dim, **bf)
        self.lm_head = rnd(c.vocab_size, c.hidden_size)
        self.embed = rnd(c.vocab_size, c.hidden_size)
        rows = context + c.block_size  # the block's keys go after the context, as a serving cache holds them
        self.k_cache = [torch.randn(streams, c.num_key_value_heads, rows, c.head_dim, **bf)
                        for _ in range(c.num_hidden_layers)]
        self.v_cache = [torch.randn_like(k) for k in self.k_cache]
        self.features = torch.randn(streams * APPENDED, c.context_width, **bf)
        self.ids = torch.randint(0, c.vocab_size, (streams * c.block_size,), device="cuda")
        freq = 1.0 / 50000.0 ** (torch.arange(0, c.head_dim, 2, device="cuda").float() / c.head_dim)
        self.cos_sin = {}
        for name, first, n in (("ctx", context - APPENDED, APPENDED), ("block", context, c.block_size)):
            angles = torch.arange(first, first + n, device="cuda").float()[:, None] * freq[None]
            self.cos_sin[name] = (torch.cat([angles.cos()] * 2, -1).bfloat16(),
                                  torch.cat([angles.sin()] * 2, -1).bfloat16())
        self.logits = None

    def rope(self, x: torch.Tensor, which: str) -> torch.Tensor:  # x [streams, n, heads, hd]
        cos, sin = (t[None, :, None] for t in self.cos_sin[which])
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def append(self) -> None:
        c, s = self.cfg, self.streams
        ctx = F.rms_norm(self.features @ self.fc.T, (c.hidden_size,), self.norm, c.rms_norm_eps)
        for layer, w in enumerate(self.layers):
            kv = (ctx @ w["qkv"][self.q_dim:].T).view(s, APPENDED, 2, c.num_key_value_heads, c.head_dim)
            k = self.rope(F.rms_norm(kv[:, :, 0], (c.head_dim,), self.head_norm, c.rms_norm_eps), "ctx")
            at = slice(self.context - APPENDED, self.context)
            self.k_cache[layer][:, :, at] = k.transpose(1, 2)
            self.v_cache[layer][:, :, at] = kv[:, :, 1].transpose(1, 2)

    def block(self) -> None:
        c, s, b = self.cfg, self.streams, self.cfg.block_size
        x = self.embed[self.ids]
        at = slice(self.context, self.context + b)
        for layer, w in enumerate(self.layers):
            h = F.rms_norm(x, (c.hidden_size,), self.norm, c.rms_norm_eps)
            qkv = (h @ w["qkv"].T).view(s, b, -1)
            q = qkv[..., :self.q_dim].reshape(s, b, c.num_attention_heads, c.head_dim)
            k = qkv[..., self.q_dim:self.q_dim + self.kv_dim].reshape(s, b, c.num_key_value_heads, c.head_dim)
            q = self.rope(F.rms_norm(q, (c.head_dim,), self.head_norm, c.rms_norm_eps), "block")
            k = self.rope(F.rms_norm(k, (c.head_dim,), self.head_norm, c.rms_norm_eps), "block")
            self.k_cache[layer][:, :, at] = k.transpose(1, 2)
            self.v_cache[layer][:, :, at] = qkv[..., self.q_dim + self.kv_dim:].reshape(
                s, b, c.num_key_value_heads, c.head_dim).transpose(1, 2)
            o = gqa_sdpa(q.transpose(1, 2), self.k_cache[layer], self.v_cache[layer])
            x = x + o.transpose(1, 2).reshape(s * b, self.q_dim) @ w["o"].T
            h = F.rms_norm(x, (c.hidden_size,), self.norm, c.rms_norm_eps)
            gate, up = (h @ w["gate_up"].T).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ w["down"].T
        self.hidden = F.rms_norm(x.view(s, b, -1)[:, 1:], (c.hidden_size,), self.norm, c.rms_norm_eps)

    def lm_head_stage(self) -> None:
        self.logits = self.hidden.reshape(-1, self.cfg.hidden_size) @ self.lm_head.T

    def top_k(self) -> None:
        torch.topk(torch.log_softmax(self.logits.float(), -1), TOP_K, dim=-1)

    def times_ms(self) -> dict[str, float]:
        self.block()
        self.lm_head_stage()
        out = {"append": median_ms(self.append, reps=3, replays=5), "block": median_ms(self.block, reps=3, replays=5),
               "lm_head": median_ms(self.lm_head_stage, reps=3, replays=5),
               "top_k": median_ms(self.top_k, reps=3, replays=5)}
        out["draft"] = sum(out.values())
        return out


def bench(layers: int, engine: Engine, bw: float, iters: int) -> list[dict]:
    cfg = drafter_config(layers)
    drafter = GpuDrafter.random(cfg, engine, seed=layers)
    native = drafter.native
    native.randomize_cache(layers)
    rng = np.random.default_rng(layers)
    results = []
    for context in CONTEXTS:
        for streams in STREAMS:
            ids = list(range(streams))
            native.set_committed(ids, [context - APPENDED] * streams)
            features = rng.standard_normal((streams * APPENDED, cfg.context_width)).astype(np.float32)
            drafter.append(ids, np.split(features, streams))
            bonus = rng.integers(0, cfg.vocab_size, streams).tolist()
            ops = {name: s * 1e3 for name, s in native.profile_round(ids, bonus, iters, TOP_K)}
            stages = {stage: sum(v for k, v in ops.items() if stage_of(k) == stage) for stage in STAGES}
            draft_ms = native.time_round(ids, bonus, 2 * iters, TOP_K) * 1e3
            floors = {k: v / bw * 1e3 for k, v in floor_bytes(cfg, streams, context).items()}
            peer = TorchPeer(cfg, streams, context).times_ms()
            torch.cuda.empty_cache()
            results.append({"layers": layers, "streams": streams, "context": context, "draft_ms": draft_ms,
                            "stage_ms": stages, "floor_ms": floors, "of_floor": floors["draft"] / draft_ms,
                            "peer_ms": peer, "ops_ms": dict(sorted(ops.items(), key=lambda kv: -kv[1]))})
            print(f"{layers} layers, {streams} streams @ {context}: draft {draft_ms:.3f} ms, floor "
                  f"{floors['draft']:.3f} ms ({100 * floors['draft'] / draft_ms:.0f}%), stages "
                  + ", ".join(f"{k} {v:.3f}" for k, v in stages.items())
                  + f"; torch peer {peer['draft']:.3f} ms", flush=True)
    del drafter, native
    torch.cuda.empty_cache()
    return results


def write_reports(out: Path, report: dict) -> None:
    lines = start_report(out, "drafter", "GPU DFlash drafter", report) + [
             f"One draft = append of {APPENDED} context rows per stream + block forward + LM head over the B - 1 "
             f"rows + per-depth log-softmax top-K (K = {TOP_K}, on the device). `draft ms`: the launches back to "
             "back; stage ms: eager, one launch at a time (per-operation CUDA events). Floor: drafter weights, LM "
             "head and each stream's draft KV read once, and the logits once for the top-K, over the copy "
             "bandwidth. Torch peer: the same math in torch bf16 (cuBLAS, SDPA with GQA, torch.topk of log_softmax "
             f"at K = {TOP_K}), per stage, in CUDA graphs.", "",
             "| layers | streams | context | draft ms | floor ms | of floor | append | block | lm_head | top-K | "
             "torch peer ms (append / block / lm_head / top-K) | ours / peer |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        s, p = r["stage_ms"], r["peer_ms"]
        lines.append(f"| {r['layers']} | {r['streams']} | {r['context']} | {r['draft_ms']:.3f} | "
                     f"{r['floor_ms']['draft']:.3f} | {100 * r['of_floor']:.0f}% | {s['append']:.3f} | "
                     f"{s['block']:.3f} | {s['lm_head']:.3f} | {s['top_k']:.3f} | {p['draft']:.3f} ({p['append']:.3f}"
                     f" / {p['block']:.3f} / {p['lm_head']:.3f} / {p['top_k']:.3f}) | {r['draft_ms'] / p['draft']:.2f} |")
    lines += ["", "## Stage floors (ms)", "", "| layers | streams | context | append | block | lm_head | top-K |",
              "|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        f = r["floor_ms"]
        lines.append(f"| {r['layers']} | {r['streams']} | {r['context']} | {f['append']:.3f} | {f['block']:.3f} | "
                     f"{f['lm_head']:.3f} | {f['top_k']:.3f} |")
    lines += ["", "## Split by operation (ms per draft, summed over layers)", ""]
    for r in report["results"]:
        lines.append(f"- {r['layers']} layers, {r['streams']} x {r['context']}: "
                     + ", ".join(f"{k} {v:.3f}" for k, v in r["ops_ms"].items()))
    (out / "drafter.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(LAYERS), figsize=(6 * len(LAYERS), 4))
    for ax, layers in zip(np.atleast_1d(axes), LAYERS):
        rows = [r for r in report["results"] if r["layers"] == layers]
        xs = np.arange(len(rows))
        ax.bar(xs - 0.27, [r["draft_ms"] for r in rows], 0.27, label="ours")
        ax.bar(xs, [r["peer_ms"]["draft"] for r in rows], 0.27, label="torch peer")
        ax.bar(xs + 0.27, [r["floor_ms"]["draft"] for r in rows], 0.27, label="byte floor")
        ax.set_xticks(xs, [f"{r['streams']}x{r['context'] // 1024}k" for r in rows], rotation=45)
        ax.set_title(f"draft with top-K, {layers} layers")
        ax.set_ylabel("ms")
    np.atleast_1d(axes)[0].legend()
    fig.tight_layout()
    fig.savefig(out / "drafter.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_drafter needs a CUDA device", file=sys.stderr)
        return 2
    start = time.time()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    # The target only lends its embedding and LM head: one dense layer of K2 dims.
    engine = Engine.random(preset_config("k2-layers", 1), streams=max(STREAMS),
                           max_context=max(CONTEXTS) + 64, seed=1)
    results = []
    for layers in LAYERS:  # reports after each drafter, so a run cut short still leaves its figures
        results += bench(layers, engine, bw, args.iters)
        report = {"model": "Kimi-K2.5-DFlash shape (random weights)", "device": str(device_info()),
                  "copy_bandwidth_gbs": bw / 1e9, "results": results, "seconds": time.time() - start}
        write_reports(args.out, report)
    print(f"wrote {args.out} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
