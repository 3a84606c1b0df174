#!/usr/bin/env python3
"""DDTree tree build, accept walk and commit: the GPU kernels beside the CPU baseline, measured in one run.

- CPU baseline: the reference `build_tree` (numpy + heapq) and `accept_tree`, one tree per stream in a host loop,
  as the serving stacks and the published reference do each round. Median over repeats after warm-up.
- GPU: `tree_build`, `tree_accept` and `tree_commit` (ddtree._native.kernels), each captured `--reps` times in a
  CUDA graph that rotates over a pool of input sets, so no call reuses the previous one's inputs and no host launch
  cost shows (the round runs them inside its graph); the median over graph replays, divided by the calls.
- Inputs: the per-depth top-K of fresh random draft distributions (depth 15 = block 16 - 1, K = min(budget,
  vocab)). The walks follow the built trees (the target picks one of the node's children at every node, so walks
  run to a leaf). The commit moves 8 accepted rows per stream (only the root in place) in a latent cache
  allocated for K2's 61 layers at row width 576 (stream s's rows from s * max_context), KV alone and with the
  gather of the drafter's 6 taps x 7168 hidden; its peer is a torch index gather/scatter over all layers.
Without a CUDA device only the CPU baseline runs. Writes tree.json and tree.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from ddtree.reference.tree import accept_tree, build_tree

DEPTH = 15
VOCAB = 4096
BUDGETS = (8, 32, 64, 128, 256, 1024)
STREAMS = (1, 4, 16)
LAYERS = 61  # Kimi-K2
ROW_ELEMS = 576  # kv_lora 512 + rope 64
TAP_WIDTH = 6 * 7168  # the K2 drafter's 6 tapped layers of hidden 7168
ACCEPTED = 8
MAX_CONTEXT = 8192
TARGETS = {"build_us": 20.0, "accept_us": 3.0, "commit_us": 10.0}  # issue 23, H200, budget 64 x 16 streams


def draft_top_k(rng: np.random.Generator, streams: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-stream, per-depth top-K log-softmax of random logits (peaked enough to give deep trees)."""
    logits = rng.standard_normal((streams, DEPTH, VOCAB)) * 2.5
    log_z = np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    ids = np.argpartition(-logits, width - 1, axis=-1)[..., :width]
    top = np.take_along_axis(logits, ids, axis=-1)
    order = np.argsort(-top, axis=-1, kind="stable")
    ids = np.take_along_axis(ids, order, axis=-1)
    log_probs = (np.take_along_axis(top, order, axis=-1) - log_z).astype(np.float32)
    return log_probs, ids.astype(np.int32)


def leaf_choices(rng: np.random.Generator, parents: np.ndarray, tokens: np.ndarray, nodes: int) -> np.ndarray:
    """The target's choice at every row of one tree (root-first node arrays, `nodes` below the root): a random
    child's token, so the walk only stops at a leaf (where the choice is a token no child has)."""
    choice = np.full(parents.shape[0], VOCAB, dtype=np.int32)
    for node in rng.permutation(np.arange(1, nodes + 1)):
        choice[parents[node]] = tokens[node]
    return choice


def cpu_seconds(fn, inputs: list, repeats: int, warmup: int) -> float:
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    samples = []
    for i in range(repeats):
        begin = time.perf_counter()
        fn(inputs[i % len(inputs)])
        samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def measure_cpu(pool: list, budget: int, rng: np.random.Generator, args: argparse.Namespace) -> dict:
    def build(entry) -> None:
        for stream in range(entry[0].shape[0]):
            build_tree(entry[0][stream], entry[1][stream], budget)

    walks = []
    for log_probs, ids in pool:
        trees = [build_tree(log_probs[s], ids[s], budget) for s in range(log_probs.shape[0])]
        walks.append([(t, leaf_choices(rng, t.parents, np.concatenate([[0], t.tokens]), t.num_nodes))
                      for t in trees])

    def accept(entry) -> None:
        for tree, choice in entry:
            accept_tree(tree, choice)

    return {"cpu_build_us": cpu_seconds(build, pool, args.repeats, args.warmup) * 1e6,
            "cpu_accept_us": cpu_seconds(accept, walks, args.repeats, args.warmup) * 1e6,
            "nodes_per_round": sum(t.num_nodes for t, _ in walks[0])}


class GpuRound:
    """Device inputs and outputs of one (budget, streams) configuration, `pool` input sets of each."""

    def __init__(self, torch, kernels, pool: list, budget: int, rng: np.random.Generator, cache, taps_width: int):
        self.torch, self.kernels, self.budget = torch, kernels, budget
        streams, rows = pool[0][0].shape[0], budget + 1
        dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
        self.inputs = [(dev(lp), dev(ids), dev(rng.integers(0, MAX_CONTEXT // 2, streams).astype(np.int32)),
                        dev(rng.integers(0, VOCAB, streams).astype(np.int32))) for lp, ids in pool]
        self.trees = []
        for entry in self.inputs:
            tree = self.tree_arrays(streams, rows)
            self.build(tree, entry)
            self.trees.append(tree)
        self.built = self.tree_arrays(streams, rows)  # the timed builds' outputs, apart from the walked trees
        self.choices = []
        for tree in self.trees:
            parents, tokens = tree["parents"].cpu().numpy(), tree["tokens"].cpu().numpy()
            nodes = tree["node_count"].cpu().numpy()
            self.choices.append(dev(np.stack([leaf_choices(rng, parents[s], tokens[s], int(nodes[s]))
                                              for s in range(streams)])))
        self.walk = {name: torch.zeros(shape, dtype=torch.int32, device="cuda")
                     for name, shape in (("accepted", (streams, DEPTH + 1)), ("accept_len", (streams,)),
                                         ("next_bonus", (streams,)))}
        self.cache = cache
        self.stream_base = dev((np.arange(streams) * MAX_CONTEXT).astype(np.int32))
        self.paths = []
        for _ in pool:
            accepted = np.full((streams, DEPTH + 1), -1, dtype=np.int32)
            for s in range(streams):
                accepted[s, :ACCEPTED] = np.concatenate([[0], np.sort(rng.choice(np.arange(2, budget + 1),
                                                                                  ACCEPTED - 1, replace=False))])
            self.paths.append((dev(accepted), dev(np.full(streams, ACCEPTED, dtype=np.int32)),
                               dev(rng.integers(0, MAX_CONTEXT // 2, streams).astype(np.int32))))
        self.taps = torch.empty(streams * rows, taps_width, dtype=torch.bfloat16, device="cuda")
        self.context = torch.empty(streams, DEPTH + 1, taps_width, dtype=torch.bfloat16, device="cuda")
        self.turn = 0

    def tree_arrays(self, streams: int, rows: int) -> dict:
        new = lambda *shape: self.torch.empty(shape, dtype=self.torch.int32, device="cuda")  # noqa: E731
        return {"tokens": new(streams, rows), "parents": new(streams, rows), "depths": new(streams, rows),
                "first_child": new(streams, rows), "next_sibling": new(streams, rows),
                "visibility": new(streams, rows, (rows + 31) // 32), "positions": new(streams, rows),
                "ancestors": new(streams, rows, DEPTH + 1), "node_count": new(streams)}

    def next_turn(self) -> int:
        self.turn = (self.turn + 1) % len(self.inputs)
        return self.turn

    def build(self, tree: dict, entry) -> None:
        self.kernels.tree_build(tree["tokens"], tree["parents"], tree["depths"], tree["first_child"],
                                tree["next_sibling"], tree["visibility"], tree["positions"], tree["ancestors"],
                                tree["node_count"], *entry, self.budget)

    def build_next(self) -> None:
        self.build(self.built, self.inputs[self.next_turn()])

    def accept_next(self) -> None:
        i = self.next_turn()
        t = self.trees[i]
        self.kernels.tree_accept(self.walk["accepted"], self.walk["accept_len"], self.walk["next_bonus"],
                                 t["tokens"], t["first_child"], t["next_sibling"], t["node_count"], self.choices[i])

    def commit_next(self, with_taps: bool) -> None:
        accepted, accept_len, start = self.paths[self.next_turn()]
        gather = (self.taps, self.context) if with_taps else (None, None)
        self.kernels.tree_commit(self.cache, start, self.stream_base, accepted, accept_len, self.budget, *gather)


def torch_commit_peer(torch, cache, streams: int, budget: int, rng: np.random.Generator, pool: int):
    """The serving stacks' device commit: one index gather and scatter over all layers (read all, then write),
    then start += accept_len; rotated over `pool` index sets."""
    sets = []
    for _ in range(pool):
        src, dst = [], []
        for s in range(streams):
            base = s * MAX_CONTEXT + int(rng.integers(0, MAX_CONTEXT // 2))
            path = np.concatenate([[0], np.sort(rng.choice(np.arange(2, budget + 1), ACCEPTED - 1, replace=False))])
            src += list(base + path)
            dst += list(base + np.arange(ACCEPTED))
        sets.append((torch.tensor(src, device="cuda"), torch.tensor(dst, device="cuda")))
    start = torch.zeros(streams, dtype=torch.int32, device="cuda")
    lengths = torch.full((streams,), ACCEPTED, dtype=torch.int32, device="cuda")
    gathered = torch.empty(cache.shape[0], streams * ACCEPTED, cache.shape[2], dtype=cache.dtype, device="cuda")
    turn = iter(range(1 << 30))

    def commit() -> None:
        src, dst = sets[next(turn) % pool]
        torch.index_select(cache, 1, src, out=gathered)
        cache.index_copy_(1, dst, gathered)
        start.add_(lengths)

    return commit


def measure_gpu(torch, kernels, median_ms, pool: list, budget: int, rng, cache, args) -> dict:
    streams = pool[0][0].shape[0]
    gpu = GpuRound(torch, kernels, pool, budget, rng, cache, TAP_WIDTH)
    timed = lambda fn: median_ms(fn, reps=args.reps, replays=args.replays) * 1e3  # noqa: E731
    row = {"gpu_build_us": timed(gpu.build_next), "gpu_accept_us": timed(gpu.accept_next),
           "gpu_commit_us": timed(lambda: gpu.commit_next(False)),
           "gpu_commit_taps_us": timed(lambda: gpu.commit_next(True)),
           "torch_commit_us": timed(torch_commit_peer(torch, cache, streams, budget, rng, len(pool))),
           "accept_len_mean": float(gpu.walk["accept_len"].float().mean())}
    del gpu
    torch.cuda.empty_cache()
    return row


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def table(rows: list, title: str, cells) -> list[str]:
    lines = [title, "", "| budget | " + " | ".join(f"{s} stream{'s' if s > 1 else ''}" for s in STREAMS) + " |",
             "|---:|" + "---:|" * len(STREAMS)]
    for budget in BUDGETS:
        lines.append(f"| {budget} | " + " | ".join(cells(next(r for r in rows if r["budget"] == budget
                                                            and r["streams"] == s)) for s in STREAMS) + " |")
    return lines + [""]


def write_report(out: Path, rows: list, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "tree.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    m = report["machine"]
    lines = ["# DDTree tree kernels on the GPU beside the CPU baseline", "",
             f"GPU {m.get('gpu', 'none')}; CPU {m['cpu']} ({m['logical_cores']} logical cores), Python {m['python']}, "
             f"numpy {m['numpy']}. Depth {DEPTH}, K = min(budget, {VOCAB}); GPU figures are the median over CUDA-graph "
             f"replays of {report['settings']['reps']} calls on rotated inputs, per call; CPU figures the median of "
             f"{report['settings']['repeats']} host rounds (streams one after another).", ""]
    gpu = "gpu_build_us" in rows[0]
    if gpu:
        target = next(r for r in rows if r["budget"] == 64 and r["streams"] == 16)
        lines += [f"Targets at budget 64 x 16 streams: build {target['gpu_build_us']:.1f} us "
                  f"(target <= {TARGETS['build_us']:.0f}), accept {target['gpu_accept_us']:.1f} us (<= "
                  f"{TARGETS['accept_us']:.0f}), commit of 16 x {ACCEPTED} rows x {LAYERS} layers "
                  f"{target['gpu_commit_us']:.1f} us KV only, {target['gpu_commit_taps_us']:.1f} us with the taps "
                  f"(<= {TARGETS['commit_us']:.0f}).", ""]
        lines += table(rows, "Build, microseconds per round: GPU (CPU reference)",
                       lambda r: f"{r['gpu_build_us']:.1f} ({r['cpu_build_us']:.0f})")
        lines += table(rows, "Accept walk, microseconds per round: GPU (CPU reference); mean accepted length",
                       lambda r: f"{r['gpu_accept_us']:.1f} ({r['cpu_accept_us']:.0f}); {r['accept_len_mean']:.1f}")
        lines += table(rows, (f"Commit of {ACCEPTED} rows per stream over {LAYERS} layers x {ROW_ELEMS} bf16, "
                              "microseconds: KV only / with the tap gather (torch index peer, KV only)"),
                       lambda r: f"{r['gpu_commit_us']:.1f} / {r['gpu_commit_taps_us']:.1f} "
                                 f"({r['torch_commit_us']:.1f})")
    else:
        lines += table(rows, "Build, CPU microseconds per round", lambda r: f"{r['cpu_build_us']:.0f}")
        lines += table(rows, "Accept walk, CPU microseconds per round", lambda r: f"{r['cpu_accept_us']:.0f}")
    (out / "tree.md").write_text("\n".join(lines), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/tree"))
    parser.add_argument("--repeats", type=int, default=30, help="CPU rounds timed per configuration")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pool", type=int, default=8, help="distinct input sets rotated across calls")
    parser.add_argument("--reps", type=int, default=16, help="GPU calls per captured graph")
    parser.add_argument("--replays", type=int, default=20, help="timed graph replays per configuration")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    machine = {"cpu": cpu_name(), "logical_cores": os.cpu_count(), "python": platform.python_version(),
               "numpy": np.__version__}
    try:
        import torch
    except ImportError:
        torch = None
    gpu = torch is not None and torch.cuda.is_available()
    if gpu:
        from cuda_timing import median_ms

        from ddtree._native import kernels
        machine["gpu"] = torch.cuda.get_device_name()
        cache = torch.empty(LAYERS, max(STREAMS) * MAX_CONTEXT, ROW_ELEMS, dtype=torch.bfloat16, device="cuda")

    rng = np.random.default_rng(args.seed)
    rows = []
    for budget in BUDGETS:
        for streams in STREAMS:
            pool = [draft_top_k(rng, streams, min(budget, VOCAB)) for _ in range(args.pool)]
            row = {"budget": budget, "streams": streams, **measure_cpu(pool, budget, rng, args)}
            if gpu:
                row.update(measure_gpu(torch, kernels, median_ms, pool, budget, rng, cache, args))
            rows.append(row)
            print(" ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)

    report = {"bench": "tree", "machine": machine,
              "settings": {"depth": DEPTH, "vocab": VOCAB, "layers": LAYERS, "row_elems": ROW_ELEMS,
                           "tap_width": TAP_WIDTH, "accepted_rows": ACCEPTED, "max_context": MAX_CONTEXT,
                           "repeats": args.repeats, "warmup": args.warmup, "pool": args.pool, "reps": args.reps,
                           "replays": args.replays, "seed": args.seed},
              "targets": TARGETS, "results": rows}
    write_report(args.out, rows, report)


if __name__ == "__main__":
    main()
