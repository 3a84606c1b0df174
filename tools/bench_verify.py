#!/usr/bin/env python3
"""Benchmark the tree-verify forward of the target at K2 dims (k2-layers, 4 layers by default: 1 dense + 3 MoE).

Reports, from one run on one GPU:
- the verify forward for (streams, budget) in {1, 4, 16} x {8, 32, 64} at 1k and 8k committed context: device time
  split by operation (eager, one launch at a time), next to its byte floor (every weight byte read once, the routed
  experts the verify's routing activates, each stream's KV read once; over the copy bandwidth measured here) and
  next to a torch peer timed in the same run: cuBLAS (torch.matmul) for every projection at the same row count,
  SDPA with the dense tree mask for attention, and our MoE on the same routing (torch has no INT4 grouped GEMM);
- tree attention alone (16 streams x 8k x 33 rows per stream, K2 attention dims) against its floors: the bytes its
  rows read (each row its own keys, the definition of the decode-attention target), the bytes of each stream's KV
  read once, and its FLOPs at the measured tensor rate of the MMA shape it issues; beside the same rows with
  contiguous keys (the cost of the key indirection) and torch SDPA with the tree mask.
Trees come from the reference best-first build over random peaked draft distributions of depth 7 (the
Kimi-K2.5-DFlash drafter's block of 8). Weights are random; the KV cache is random. Writes verify.json, verify.md and
verify.png to --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ddtree import Engine
from ddtree._native import kernels
from ddtree.device import device_info
from ddtree.presets import preset_config
from ddtree.reference.tree import build_tree

from bench_engine import median_ms
from bench_report import pyplot, start_report
from cuda_timing import copy_bandwidth

DEPTH = 7
STREAMS = (1, 4, 16)
BUDGETS = (8, 32, 64)
CONTEXTS = (1024, 8192)
# wgmma m64n64k16 (the attention's score and P.V shape) in bench/results/mma on this kind of card
WGMMA_64_TFLOPS = 972.0


def random_tree(rng: np.random.Generator, budget: int, vocab: int) -> tuple[list[int], list[int]]:
    """Tokens and parents (root first) of the reference's best-first tree over random peaked top-K draft
    log-probs; the root token is random."""
    width = min(budget, 64)
    logits = rng.standard_normal((DEPTH, 4 * width)) * 2.5
    log_z = np.log(np.exp(logits).sum(-1, keepdims=True))
    order = np.argsort(-logits, axis=-1)[:, :width]
    log_probs = (np.take_along_axis(logits, order, -1) - log_z).astype(np.float32)
    ids = rng.choice(vocab, size=(DEPTH, width), replace=False) if vocab >= DEPTH * width else order
    tree = build_tree(log_probs, ids, budget)
    return [int(rng.integers(0, vocab))] + tree.tokens.tolist(), tree.parents.tolist()


def weight_bytes(cfg) -> dict[str, int]:
    """Bytes of every non-expert weight one forward reads, by operation (the embedding's rows are negligible)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    attn = {"q_a+kv_a": h * (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim),
            "q_b": cfg.q_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
            "kv_b_absorb_k": heads * cfg.kv_lora_rank * cfg.qk_nope_head_dim,
            "kv_b_absorb_v": heads * cfg.kv_lora_rank * cfg.v_head_dim,
            "o_proj": heads * cfg.v_head_dim * h}
    out = {k: 0 for k in attn} | {"mlp_gate_up": 0, "mlp_down": 0, "shared_gate_up": 0, "shared_down": 0,
                                  "router": 0, "lm_head": cfg.vocab_size * h * 2}
    for layer in range(cfg.num_hidden_layers):
        for k, v in attn.items():
            out[k] += 2 * v
        if cfg.is_moe_layer(layer):
            out["shared_gate_up"] += 2 * 2 * cfg.moe_intermediate_size * h
            out["shared_down"] += 2 * cfg.moe_intermediate_size * h
            out["router"] += 2 * cfg.n_routed_experts * h
        else:
            out["mlp_gate_up"] += 2 * 2 * cfg.intermediate_size * h
            out["mlp_down"] += 2 * cfg.intermediate_size * h
    return out


def expert_bytes(cfg) -> int:
    """One routed expert's INT4 weights and bf16 group-32 scales (gate, up and down)."""
    per = cfg.moe_intermediate_size * cfg.hidden_size
    return 3 * (per // 2 + per // 32 * 2)


def torch_peer_ms(cfg, m: int, trees: list[tuple[list[int], list[int]]], start: int,
                  moe_ms: float) -> dict[str, float]:
    """The verify forward's operations in torch at m rows, per forward (summed over layers): torch.matmul for the
    projections, SDPA with the dense tree mask for attention; the routed experts are ours (moe_ms)."""
    h, heads, lora, rope = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    x = torch.randn(m, h, device="cuda").bfloat16()

    def matmul_ms(n: int, k: int, batch: int = 1) -> float:
        copies = max(2, -(-(120 << 20) // (batch * n * k * 2)))
        ws = [torch.randn(batch, n, k, device="cuda").bfloat16() for _ in range(copies)]
        a = torch.randn(batch, m, k, device="cuda").bfloat16()
        it = iter(range(1 << 30))
        return median_ms(lambda: torch.matmul(a, ws[next(it) % copies].transpose(1, 2)), reps=5, replays=7)

    out: dict[str, float] = {}
    moe_layers = sum(cfg.is_moe_layer(layer) for layer in range(cfg.num_hidden_layers))
    dense_layers = cfg.num_hidden_layers - moe_layers
    layers = cfg.num_hidden_layers
    out["q_a+kv_a"] = layers * matmul_ms(cfg.q_lora_rank + lora + rope, h)
    out["q_b"] = layers * matmul_ms(heads * (cfg.qk_nope_head_dim + rope), cfg.q_lora_rank)
    out["kv_b_absorb_k"] = layers * matmul_ms(lora, cfg.qk_nope_head_dim, heads)
    out["kv_b_absorb_v"] = layers * matmul_ms(cfg.v_head_dim, lora, heads)
    out["o_proj"] = layers * matmul_ms(h, heads * cfg.v_head_dim)
    out["mlp_gate_up"] = dense_layers * matmul_ms(2 * cfg.intermediate_size, h)
    out["mlp_down"] = dense_layers * matmul_ms(h, cfg.intermediate_size)
    out["shared_gate_up"] = moe_layers * matmul_ms(2 * cfg.moe_intermediate_size, h)
    out["shared_down"] = moe_layers * matmul_ms(h, cfg.moe_intermediate_size)
    out["router"] = moe_layers * matmul_ms(cfg.n_routed_experts, h)
    out["lm_head"] = matmul_ms(cfg.vocab_size, h)
    out["attention"] = layers * sdpa_tree_ms(trees, start, heads, lora, rope)
    out["routed_experts (ours)"] = moe_ms
    norm = torch.ones(h, device="cuda").bfloat16()
    out["norm"] = (2 * layers + 1) * median_ms(lambda: torch.nn.functional.rms_norm(x, (h,), norm, 1e-6), reps=5,
                                               replays=7)
    return out


def tree_masks(trees: list[tuple[list[int], list[int]]], start: int, nodes: int) -> torch.Tensor:
    """bool [streams, 1, nodes, start + nodes]: the prefix and each node's ancestors-and-self (padding rows see
    only the prefix)."""
    mask = torch.zeros(len(trees), 1, nodes, start + nodes, dtype=torch.bool)
    mask[..., :start] = True
    for s, (_, parents) in enumerate(trees):
        for i, parent in enumerate(parents):
            mask[s, 0, i, start + i] = True
            if parent >= 0:
                mask[s, 0, i, start:] |= mask[s, 0, parent, start:]
    return mask.cuda()


def sdpa_tree_ms(trees, start: int, heads: int, lora: int, rope: int) -> float:
    """Absorbed MLA attention of every stream's nodes in torch SDPA: queries [streams, heads, nodes, lora + rope],
    the latent rows as one shared key/value head, the dense tree mask."""
    nodes = max(len(t) for t, _ in trees)
    streams = len(trees)
    q = torch.randn(streams, heads, nodes, lora + rope, device="cuda").bfloat16()
    kv = torch.randn(streams, 1, start + nodes, lora + rope, device="cuda").bfloat16()
    mask = tree_masks(trees, start, nodes)
    k = kv.expand(-1, heads, -1, -1)
    v = kv[..., :lora].expand(-1, heads, -1, -1)
    return median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask), reps=3,
                     replays=5)


def bench_verify(cfg, bw: float, iters: int) -> list[dict]:
    engine = Engine.random(cfg, streams=max(STREAMS), max_context=max(CONTEXTS) + 1, budget=max(BUDGETS))
    native = engine.native
    native.randomize_cache(1)
    rng = np.random.default_rng(0)
    results = []
    experts = expert_bytes(cfg)
    weights = weight_bytes(cfg)
    row_bytes = 2 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    for context in CONTEXTS:
        for streams in STREAMS:
            for budget in BUDGETS:
                trees = [random_tree(rng, budget, cfg.vocab_size) for _ in range(streams)]
                args = (list(range(streams)), [context] * streams, [t for t, _ in trees], [p for _, p in trees])
                _, _, routing = native.verify(*args, with_routing=True)
                profile = {k: v * 1e3 for k, v in native.profile_verify(*args, iters)}
                rows = sum(len(t) for t, _ in trees)
                active = sum(len(np.unique(layer)) for layer in routing)
                kv = cfg.num_hidden_layers * sum(context + len(t) for t, _ in trees) * row_bytes
                floor_bytes = sum(weights.values()) + active * experts + kv
                total = sum(profile.values())
                peer = torch_peer_ms(cfg, rows, trees, context, profile.get("routed_experts", 0.0))
                results.append({"streams": streams, "budget": budget, "context": context, "rows": rows,
                                "ms": total, "floor_ms": floor_bytes / bw * 1e3, "active_experts": active,
                                "of_floor": floor_bytes / bw * 1e3 / total, "peer_ms": sum(peer.values()),
                                "breakdown_ms": dict(sorted(profile.items(), key=lambda kv_: -kv_[1])),
                                "peer_breakdown_ms": peer})
                r = results[-1]
                print(f"verify {streams} x {budget} @ {context}: {total:.3f} ms ({rows} rows, {active} experts), "
                      f"floor {r['floor_ms']:.3f} ms ({100 * r['of_floor']:.0f}%), torch peer {r['peer_ms']:.3f} ms",
                      flush=True)
    return results


def bench_tree_attention(bw: float, streams: int = 16, context: int = 8192, nodes: int = 33, heads: int = 64,
                         lora: int = 512, rope: int = 64) -> dict:
    rng = np.random.default_rng(1)
    d = lora + rope
    trees = [random_tree(rng, nodes - 1, 163840) for _ in range(streams)]
    stream_rows = context + nodes
    caches = [torch.randn(streams * stream_rows, d, device="cuda").bfloat16() for _ in range(2)]
    depth_of = []
    stride = max(len(t) for t, _ in trees)
    ancestors = np.full((streams * stride, stride), -1, dtype=np.int32)
    kv_start, kv_len, key_start = [], [], []
    row = 0
    for s, (tokens, parents) in enumerate(trees):
        paths: list[list[int]] = []
        for i, parent in enumerate(parents):
            paths.append([i] if parent < 0 else paths[parent] + [i])
            ancestors[row, :len(paths[i])] = paths[i]
            kv_start.append(s * stream_rows)
            kv_len.append(context + len(paths[i]))
            key_start.append(context)
            depth_of.append(len(paths[i]) - 1)
            row += 1
    rows = row
    q = torch.randn(rows, heads, d, device="cuda").bfloat16()
    out = torch.empty(rows, heads, lora, device="cuda", dtype=torch.bfloat16)
    as_i32 = lambda v: torch.tensor(v, device="cuda", dtype=torch.int32)  # noqa: E731
    kv_start_t, kv_len_t, key_start_t = as_i32(kv_start), as_i32(kv_len), as_i32(key_start)
    nodes_t = torch.from_numpy(ancestors[:rows]).cuda()
    max_len = max(kv_len)
    ws = torch.empty(kernels.mla_workspace_floats(heads, lora, rope, rows, max_len), device="cuda")
    it = iter(range(1 << 30))
    scale = (128 + rope) ** -0.5
    tree_ms = median_ms(lambda: kernels.mla_attention(out, q, caches[next(it) % 2], kv_start_t, kv_len_t, max_len,
                                                      scale, ws, key_start_t, nodes_t))
    plain_ms = median_ms(lambda: kernels.mla_attention(out, q, caches[next(it) % 2], kv_start_t, kv_len_t, max_len,
                                                       scale, ws))
    peer_ms = sdpa_tree_ms(trees, context, heads, lora, rope)
    row_bytes = d * 2
    read_bytes = sum(kv_len) * row_bytes + q.numel() * 2 + out.numel() * 2
    unique_bytes = streams * stream_rows * row_bytes + q.numel() * 2 + out.numel() * 2
    flops = sum(kv_len) * heads * (d + lora) * 2
    return {"streams": streams, "context": context, "rows_per_stream": nodes, "rows": rows, "ms": tree_ms,
            "plain_rows_ms": plain_ms, "peer_ms": peer_ms, "read_floor_ms": read_bytes / bw * 1e3,
            "unique_kv_floor_ms": unique_bytes / bw * 1e3, "flop_floor_ms": flops / (WGMMA_64_TFLOPS * 1e12) * 1e3,
            "gflop": flops / 1e9, "tflops": flops / (tree_ms * 1e-3) / 1e12}


def write_reports(out: Path, report: dict) -> None:
    a = report["tree_attention"]
    lines = start_report(out, "verify", "Tree-verify forward", report) + [
             "Eager forward, one launch at a time (per-operation CUDA events, mean of the timed passes after a "
             "warm-up). Floor: every weight byte read once (the routed experts the verify's own routing "
             "activates), each stream's KV read once, over the copy bandwidth. Torch peer: torch.matmul (cuBLAS) "
             "for every projection at the same rows, SDPA with the dense tree mask, torch rms_norm, and our routed "
             "experts on the same routing.", "",
             "| streams | budget | context | rows | experts | ms | floor ms | of floor | torch peer ms | ours / peer |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["verify"]:
        lines.append(f"| {r['streams']} | {r['budget']} | {r['context']} | {r['rows']} | {r['active_experts']} | "
                     f"{r['ms']:.3f} | {r['floor_ms']:.3f} | {100 * r['of_floor']:.0f}% | {r['peer_ms']:.3f} | "
                     f"{r['ms'] / r['peer_ms']:.2f} |")
    lines += ["", "## Split by operation (ms per forward, summed over layers; ours | torch peer)", ""]
    for r in report["verify"]:
        peer = r["peer_breakdown_ms"]
        parts = ", ".join(f"{k} {v:.3f}" + (f" | {peer[k]:.3f}" if k in peer else "")
                          for k, v in r["breakdown_ms"].items())
        lines.append(f"- {r['streams']} x {r['budget']} @ {r['context']}: {parts}; peer attention "
                     f"{peer['attention']:.3f}")
    lines += ["", f"## Tree attention alone ({a['streams']} streams x {a['context']} keys x {a['rows_per_stream']} "
              "rows per stream, K2 dims)", "",
              "| | ms |", "|---|---|",
              f"| tree keys (ours) | {a['ms']:.3f} |",
              f"| the same rows with contiguous keys (ours) | {a['plain_rows_ms']:.3f} |",
              f"| torch SDPA, dense tree mask | {a['peer_ms']:.3f} |",
              f"| floor: bytes its rows read ({a['rows']} rows x their keys) | {a['read_floor_ms']:.3f} "
              f"({100 * a['read_floor_ms'] / a['ms']:.0f}%) |",
              f"| floor: each stream's KV read once | {a['unique_kv_floor_ms']:.3f} "
              f"({100 * a['unique_kv_floor_ms'] / a['ms']:.1f}%) |",
              f"| floor: {a['gflop']:.0f} GFLOP at {WGMMA_64_TFLOPS:.0f} TFLOP/s (wgmma m64n64k16) | "
              f"{a['flop_floor_ms']:.3f} ({100 * a['flop_floor_ms'] / a['ms']:.0f}%) |", "",
              f"Achieved {a['tflops']:.0f} TFLOP/s.", ""]
    (out / "verify.md").write_text("\n".join(lines))
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(CONTEXTS), figsize=(6 * len(CONTEXTS), 4), sharey=True)
    for ax, context in zip(np.atleast_1d(axes), CONTEXTS):
        rows = [r for r in report["verify"] if r["context"] == context]
        labels = [f"{r['streams']}x{r['budget']}" for r in rows]
        xs = np.arange(len(rows))
        ax.bar(xs - 0.27, [r["ms"] for r in rows], 0.27, label="ours")
        ax.bar(xs, [r["peer_ms"] for r in rows], 0.27, label="torch peer")
        ax.bar(xs + 0.27, [r["floor_ms"] for r in rows], 0.27, label="byte floor")
        ax.set_xticks(xs, labels, rotation=45)
        ax.set_title(f"verify forward, context {context}")
        ax.set_xlabel("streams x budget")
    np.atleast_1d(axes)[0].set_ylabel("ms per verify forward")
    np.atleast_1d(axes)[0].legend()
    fig.tight_layout()
    fig.savefig(out / "verify.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_verify needs a CUDA device", file=sys.stderr)
        return 2
    start = time.time()
    cfg = preset_config("k2-layers", args.layers)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    attention = bench_tree_attention(bw)
    print(f"tree attention: {attention}", flush=True)
    verify = bench_verify(cfg, bw, args.iters)
    report = {"model": f"k2-layers, {args.layers} layers (random weights)", "device": str(device_info()),
              "copy_bandwidth_gbs": bw / 1e9, "verify": verify, "tree_attention": attention,
              "seconds": time.time() - start}
    write_reports(args.out, report)
    print(f"wrote {args.out} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
