#!/usr/bin/env python3
"""Benchmark the autoregressive engine and its kernels at K2 dims (k2-layers preset, 4 layers by default).

Reports, from one run on one GPU:
- copy bandwidth (device-to-device copy), the floor every kernel is measured against;
- each engine kernel at 1, 16 and 64 rows: median time, its byte floor (weights + activations + KV bytes over
  the copy bandwidth), and a torch peer where one computes the same thing (bf16 matmul for the projections);
- AR decode of the whole engine (random weights of the right scale; random KV contents) at 1, 8, 16 streams and
  1k / 8k context: tokens/s, step time, host time per replayed CUDA graph, and the step broken down by kernel.
Inputs are fresh random values; weights are rotated through enough copies to exceed the 60 MB L2.
Writes engine.json and engine.md to --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ddtree import Engine
from ddtree._native import kernels
from ddtree.device import device_info
from ddtree.presets import preset_config

from bench_report import start_report
from cuda_timing import copy_bandwidth, median_ms

L2_BYTES = 60 << 20
ROWS = (1, 16, 64)


def copies_for(nbytes: int) -> int:
    return max(2, -(-2 * L2_BYTES // max(nbytes, 1)))


def same_size_stream(nbytes: int, bw: float) -> float:
    """Fraction of the copy bandwidth that one torch elementwise kernel reading and writing `nbytes` reaches
    (rotated buffers, timed as the kernels are): a reference for the fixed cost of one call at that size, next to
    the GEMM reading the same bytes. (A graph-captured copy_ is a memcpy node, which ran a 2.3 GB copy at two
    thirds of the rate of the eager copy that defines the floor.)"""
    copies = copies_for(2 * nbytes)
    src = [torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    dst = [torch.empty_like(t) for t in src]
    it = iter(range(1 << 30))

    def stream() -> None:
        i = next(it) % copies
        torch.neg(src[i], out=dst[i])

    return 2 * nbytes / bw / (median_ms(stream) * 1e-3)


def bench_gemm(name: str, n: int, k: int, batch: int, epilogue: str, rows: int, bw: float,
               stream_fraction: float) -> dict:
    copies = copies_for(batch * n * k * 2)
    shape = (batch, n, k) if batch > 1 else (n, k)
    ws = [torch.randn(shape, device="cuda").mul_(k**-0.5).bfloat16() for _ in range(copies)]
    x = torch.randn((rows, batch, k) if batch > 1 else (rows, k), device="cuda").bfloat16()
    n_out = n // 2 if epilogue == "silu_mul" else n
    out_dtype = torch.float32 if epilogue == "f32" else torch.bfloat16
    out = torch.empty((rows, batch, n_out) if batch > 1 else (rows, n_out), device="cuda", dtype=out_dtype)
    scratch = torch.empty(max(1, kernels.gemm_workspace_floats(rows, n, k, batch)), device="cuda")
    counters = torch.zeros(kernels.gemm_counter_count(n, batch), device="cuda", dtype=torch.int32)
    it = iter(range(1 << 30))

    def ours() -> None:
        kernels.gemm(out, x, ws[next(it) % copies], epilogue, scratch, counters)

    def peer() -> None:
        w = ws[next(it) % copies]
        if batch > 1:
            torch.einsum("mbk,bnk->mbn", x, w)
        else:
            torch.matmul(x, w.T)

    bytes_moved = batch * n * k * 2 + x.numel() * 2 + out.numel() * out.element_size()
    t = median_ms(ours)
    t_peer = median_ms(peer)
    floor_ms = bytes_moved / bw * 1e3
    return {"kernel": f"gemm {name}", "rows": rows, "shape": f"{batch}x{n}x{k}" if batch > 1 else f"{n}x{k}",
            "ms": t, "floor_ms": floor_ms, "of_copy_bw": floor_ms / t, "peer": "torch bf16 matmul",
            "peer_ms": t_peer, "splits": kernels.gemm_split_count(n, k, batch),
            "same_size_stream_of_copy_bw": stream_fraction}


def bench_attention(rows: int, context: int, bw: float, heads: int = 64, lora: int = 512, rope: int = 64,
                    launch_len: int | None = None) -> dict:
    """`launch_len` (default: the context) is the key bound the launch is sized by: as many chunk CTAs per row as
    a row of up to `launch_len` keys can have, those past the context exiting at once."""
    d = lora + rope
    copies = copies_for(rows * context * d * 2)
    caches = [torch.randn(rows * context, d, device="cuda").bfloat16() for _ in range(min(copies, 4))]
    q = torch.randn(rows, heads, d, device="cuda").bfloat16()
    out = torch.empty(rows, heads, lora, device="cuda", dtype=torch.bfloat16)
    start = torch.arange(rows, device="cuda", dtype=torch.int32) * context
    length = torch.full((rows,), context, device="cuda", dtype=torch.int32)
    launch_len = launch_len or context
    ws = torch.empty(kernels.mla_workspace_floats(heads, lora, rope, rows, launch_len), device="cuda")
    it = iter(range(1 << 30))
    t = median_ms(lambda: kernels.mla_attention(out, q, caches[next(it) % len(caches)], start, length, launch_len,
                                                0.07, ws))

    def peer() -> None:
        """The same absorbed attention in torch: bf16 batched matmuls around an fp32 softmax."""
        kv = caches[next(it) % len(caches)].view(rows, context, d)
        p = torch.softmax(torch.matmul(q, kv.transpose(1, 2)).float() * 0.07, dim=-1).bfloat16()
        torch.matmul(p, kv[:, :, :lora])

    t_peer = median_ms(peer)
    bytes_moved = rows * context * d * 2 + q.numel() * 2 + out.numel() * 2
    floor_ms = bytes_moved / bw * 1e3
    name = f"mla_attention ctx {context}" + (f" (launch for {launch_len})" if launch_len != context else "")
    return {"kernel": name, "rows": rows, "shape": f"{heads}h {lora}+{rope}", "ms": t,
            "floor_ms": floor_ms, "of_copy_bw": floor_ms / t, "peer": "torch bf16 bmm+softmax", "peer_ms": t_peer,
            "splits": None}


def bench_small_kernels(rows: int, cfg, bw: float) -> list[dict]:
    h, e, vocab = cfg.hidden_size, cfg.n_routed_experts, cfg.vocab_size
    results = []

    def row(name: str, ms: float, nbytes: int, peer_ms: float | None = None, peer: str = "") -> dict:
        floor = nbytes / bw * 1e3
        return {"kernel": name, "rows": rows, "shape": "", "ms": ms, "floor_ms": floor, "of_copy_bw": floor / ms,
                "peer": peer, "peer_ms": peer_ms, "splits": None}

    x = torch.randn(rows, h, device="cuda").bfloat16()
    w = torch.ones(h, device="cuda").bfloat16()
    out = torch.empty_like(x)
    res = x.clone()
    results.append(row("add_rmsnorm", median_ms(lambda: kernels.add_rmsnorm(out, res, x, w, 1e-6, delta2=x)),
                       5 * x.numel() * 2, median_ms(lambda: torch.nn.functional.rms_norm(res + x + x, (h,), w, 1e-6)),
                       "torch add + rms_norm"))
    logits = torch.randn(rows, e, device="cuda")
    bias = torch.zeros(e, device="cuda")
    ids = torch.empty(rows, cfg.num_experts_per_tok, device="cuda", dtype=torch.int32)
    wts = torch.empty(rows, cfg.num_experts_per_tok, device="cuda")
    results.append(row("route_topk", median_ms(lambda: kernels.route_topk(ids, wts, logits, bias, True)),
                       logits.numel() * 4, median_ms(lambda: torch.topk(torch.sigmoid(logits) + bias, 8)),
                       "torch sigmoid+topk"))
    big = torch.randn(rows, vocab, device="cuda")
    tokens = torch.empty(rows, device="cuda", dtype=torch.int32)
    temp = torch.zeros(1, device="cuda")
    seed = torch.zeros(1, device="cuda", dtype=torch.int64)
    pos = torch.zeros(rows, device="cuda", dtype=torch.int32)
    results.append(row("sample (greedy)", median_ms(lambda: kernels.sample_tokens(tokens, big, temp, seed, pos, pos)),
                       big.numel() * 4, median_ms(lambda: big.argmax(-1)), "torch argmax"))
    temp_one = torch.ones(1, device="cuda")
    results.append(row("sample (T=1)", median_ms(lambda: kernels.sample_tokens(tokens, big, temp_one, seed, pos, pos)),
                       big.numel() * 4, median_ms(lambda: torch.multinomial(torch.softmax(big, -1), 1)),
                       "torch softmax+multinomial"))
    table = torch.randn(vocab, h, device="cuda").bfloat16()
    ids1 = torch.randint(0, vocab, (rows,), device="cuda", dtype=torch.int32)
    results.append(row("embed gather", median_ms(lambda: kernels.gather_rows(out, table, ids1)), 2 * x.numel() * 2,
                       median_ms(lambda: table[ids1]), "torch index"))
    return results


# AR steps and the step breakdown sample their next tokens at this temperature (see the report's AR section).
SAMPLE_TEMPERATURE = 1.0


def bench_engine(cfg, streams_list=(1, 8, 16), contexts=(1024, 8192), iters: int = 40,
                 max_context: int = 32768) -> list[dict]:
    """AR decode by graph replay in an engine of `max_context` keys per stream, longer than the contexts timed
    (as a deployment would be): the attention grid must follow the live lengths, not max_context."""
    max_streams = max(streams_list)
    engine = Engine.random(cfg, streams=max_streams, max_context=max_context)
    native = engine.native
    native.randomize_cache(1)
    results = []
    for context in contexts:
        for n in streams_list:
            positions = [context - 1] * n
            step_s, host_s = native.time_decode(n, positions, iters, temperature=SAMPLE_TEMPERATURE)
            profile = dict(native.profile_step(n, positions, 3, temperature=SAMPLE_TEMPERATURE))
            results.append({"streams": n, "context": context, "max_context": max_context, "step_ms": step_s * 1e3,
                            "tokens_per_s": n / step_s, "host_us_per_step": host_s * 1e6,
                            "breakdown_ms": {k: v * 1e3 for k, v in sorted(profile.items(), key=lambda kv: -kv[1])}})
            print(f"engine: {n} streams at {context}: {step_s * 1e3:.3f} ms/step, {n / step_s:.0f} tok/s, "
                  f"host {host_s * 1e6:.1f} us/step", flush=True)
    return results


def write_reports(out: Path, report: dict) -> None:
    lines = start_report(out, "engine", "Engine benchmark", report) + [
             "Same-size stream: the fraction of the copy bandwidth that one torch elementwise kernel reading and "
             "writing the weight's bytes reaches, timed the same way: the fixed cost of one call at that size.", "",
             "## Kernels", "",
             "| kernel | shape | rows | ms | floor ms | of copy BW | same-size stream | peer | peer ms | K splits |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["kernels"]:
        peer_ms = f"{r['peer_ms']:.4f}" if r["peer_ms"] is not None else ""
        stream = r.get("same_size_stream_of_copy_bw")
        stream = f"{100 * stream:.0f}%" if stream is not None else ""
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['rows']} | {r['ms']:.4f} | {r['floor_ms']:.4f} | "
                     f"{100 * r['of_copy_bw']:.0f}% | {stream} | {r['peer']} | {peer_ms} | "
                     f"{r['splits'] or ''} |")
    lines += ["", "## Autoregressive decode (CUDA graph replay)", "",
              (f"Tokens sampled at temperature {SAMPLE_TEMPERATURE:g} (seeded): greedy decoding of random weights can "
               "settle on a few tokens, and the routed experts' work per step would then follow tiny numeric "
               "differences between builds."), "",
              "| streams | context | engine max_context | ms/step | tokens/s | host us/step |",
              "|---|---|---|---|---|---|"]
    for r in report["engine"]:
        lines.append(f"| {r['streams']} | {r['context']} | {r['max_context']} | {r['step_ms']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {r['host_us_per_step']:.1f} |")
    lines += ["", ("### Step breakdown (eager step, one op at a time, ms summed over layers; the replayed graph runs "
                   "the shared expert beside the router and routed experts)"), ""]
    for r in report["engine"]:
        parts = ", ".join(f"{k} {v:.3f}" for k, v in r["breakdown_ms"].items())
        lines.append(f"- {r['streams']} streams @ {r['context']}: {parts}")
    lines += ["", "Targets: dense projections at <= 16 rows >= 80% of copy bandwidth; decode attention at 8k x 16 "
              "streams >= 70%; host overhead per replayed step <= 20 us.", ""]
    (out / "engine.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_engine needs a CUDA device", file=sys.stderr)
        return 2
    cfg = preset_config("k2-layers", args.layers)
    start = time.time()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    d = cfg
    gemms = [("q_a+kv_a", d.q_lora_rank + d.kv_lora_rank + d.qk_rope_head_dim, d.hidden_size, 1, "bf16"),
             ("q_b", d.num_attention_heads * d.qk_head_dim, d.q_lora_rank, 1, "bf16"),
             ("kv_b absorb k", d.kv_lora_rank, d.qk_nope_head_dim, d.num_attention_heads, "bf16"),
             ("kv_b absorb v", d.v_head_dim, d.kv_lora_rank, d.num_attention_heads, "bf16"),
             ("o_proj", d.hidden_size, d.num_attention_heads * d.v_head_dim, 1, "bf16"),
             ("dense gate_up+silu", 2 * d.intermediate_size, d.hidden_size, 1, "silu_mul"),
             ("dense down", d.hidden_size, d.intermediate_size, 1, "bf16"),
             ("shared gate_up+silu", 2 * d.moe_intermediate_size, d.hidden_size, 1, "silu_mul"),
             ("shared down", d.hidden_size, d.moe_intermediate_size, 1, "bf16"),
             ("router", d.n_routed_experts, d.hidden_size, 1, "f32"),
             ("lm_head", d.vocab_size, d.hidden_size, 1, "f32")]
    stream_fractions = {name: same_size_stream(batch * n * k * 2, bw) for name, n, k, batch, _ in gemms}
    kernel_rows = []
    for rows in ROWS:
        for name, n, k, batch, epi in gemms:
            kernel_rows.append(bench_gemm(name, n, k, batch, epi, rows, bw, stream_fractions[name]))
            r = kernel_rows[-1]
            print(f"{r['kernel']} x{rows}: {r['ms']:.4f} ms, {100 * r['of_copy_bw']:.0f}% of copy BW, "
                  f"torch {r['peer_ms']:.4f} ms", flush=True)
        # the last: a grid sized by a 32k max_context, as the engine launched it before its attention span
        for context, launch_len in ((1024, None), (8192, None), (1024, 32768)):
            kernel_rows.append(bench_attention(rows, context, bw, launch_len=launch_len))
            r = kernel_rows[-1]
            print(f"{r['kernel']} x{rows}: {r['ms']:.4f} ms, {100 * r['of_copy_bw']:.0f}% of copy BW", flush=True)
        kernel_rows += bench_small_kernels(rows, cfg, bw)
    torch.cuda.empty_cache()
    engine_rows = [] if args.skip_engine else bench_engine(cfg)
    report = {"model": f"k2-layers, {args.layers} layers (random weights)", "device": str(device_info()),
              "copy_bandwidth_gbs": bw / 1e9, "kernels": kernel_rows, "engine": engine_rows,
              "seconds": time.time() - start}
    write_reports(args.out, report)
    print(f"wrote {args.out} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
