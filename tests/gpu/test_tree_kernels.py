"""GPU tree build, accept walk and commit against ddtree.reference.tree, array for array and bit for bit.

The fuzz tests check 100,000 build inputs (each built tree then also walked from target choices that follow it)
and 100,000 accept inputs with random, cyclic, self-looping and out-of-range links. The reference runs in worker
processes so the fuzz takes seconds (in the sanitizer mode, conftest.sanitizing: 2,000 of each, checked in this
process). The tests named *memcheck are small versions of each that run under
`compute-sanitizer --tool memcheck` (with PYTORCH_NO_CUDA_MEMORY_CACHING=1, so every array is its own
allocation and an overrun is seen).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")
kernels = pytest.importorskip("ddtree._native", exc_type=ImportError).kernels
from conftest import sanitizing, trimmed  # noqa: E402
from ddtree.reference.tree import accept_tree, accept_walk, build_tree, commit_rows  # noqa: E402

PAD = -1
SENTINEL = 0x5A5A5A5A  # what the outputs hold before a launch: an unwritten entry shows as a mismatch
FUZZ_CASES = trimmed(100_000, 2_000)
NODE_ARRAYS = ("tokens", "parents", "depths", "first_child", "next_sibling", "positions")


# ---- inputs -----------------------------------------------------------------------------------------------------

def candidates(rng: np.random.Generator, streams: int, depth: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-depth top-K log-probs fp32 [streams, depth, width] (descending, <= 0) and distinct token ids.

    Styles per stream: wide-ranging random gaps (rounding order matters), dyadic gaps with many zeros (exact
    ties of log-probs and of path scores, -0.0 included) and a dyadic row repeated at every depth."""
    style = rng.integers(0, 3, streams)
    scale = np.exp(rng.uniform(-6, 1.5, (streams, 1, 1)))
    gaps = rng.exponential(1.0, (streams, depth, width)) * scale
    dyadic = rng.choice(np.array([0.0, 0.0, 0.0, 0.125, 0.25, 0.5]), (streams, depth, width))
    gaps = np.where((style > 0)[:, None, None], dyadic, gaps)
    gaps[style == 2] = gaps[style == 2][:, :1, :]
    gaps[:, :, 0] *= rng.random((streams, depth)) < 0.7  # a top log-prob of exactly -0.0 now and then
    log_probs = (-np.cumsum(gaps, axis=-1)).astype(np.float32)
    ids = np.argsort(rng.random((streams, depth, width)), axis=-1) + rng.integers(0, 160_000, (streams, 1, 1))
    return log_probs, ids.astype(np.int32)


def fuzz_budget(rng: np.random.Generator) -> int:
    tier = rng.choice(4, p=[0.45, 0.30, 0.17, 0.08])
    low, high = ((0, 32), (33, 128), (129, 400), (401, 1024))[tier]
    return int(rng.integers(low, high + 1))


def fuzz_width(rng: np.random.Generator, budget: int) -> int:
    kind = rng.integers(0, 3)
    if kind == 0:
        return max(1, min(budget, 1024))  # as the engine sizes it: K = min(budget, vocab)
    if kind == 1:
        return int(rng.integers(1, 1025))
    return int(rng.integers(1, max(1, budget) + 1))  # K smaller than the budget


# ---- the kernels through torch ----------------------------------------------------------------------------------

def cuda(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def filled(*shape: int) -> torch.Tensor:
    return torch.full(shape, SENTINEL, dtype=torch.int32, device="cuda")


def gpu_build(log_probs: np.ndarray, ids: np.ndarray, start: np.ndarray, bonus: np.ndarray,
              budget: int) -> dict[str, torch.Tensor]:
    streams, depth, _ = log_probs.shape
    rows, words = budget + 1, (budget + 32) // 32
    out = {name: filled(streams, rows) for name in NODE_ARRAYS}
    out["visibility"] = filled(streams, rows, words)
    out["ancestors"] = filled(streams, rows, depth + 1)
    out["node_count"] = filled(streams)
    kernels.tree_build(out["tokens"], out["parents"], out["depths"], out["first_child"], out["next_sibling"],
                       out["visibility"], out["positions"], out["ancestors"], out["node_count"], cuda(log_probs),
                       cuda(ids), cuda(start), cuda(bonus), budget)
    return out


def gpu_accept(tokens: torch.Tensor, first_child: torch.Tensor, next_sibling: torch.Tensor,
               node_count: torch.Tensor, choice: torch.Tensor, depth: int) -> dict[str, np.ndarray]:
    streams = tokens.shape[0]
    out = {"accepted": filled(streams, depth + 1), "accept_len": filled(streams), "next_bonus": filled(streams)}
    kernels.tree_accept(out["accepted"], out["accept_len"], out["next_bonus"], tokens, first_child, next_sibling,
                        node_count, choice)
    return {k: v.cpu().numpy() for k, v in out.items()}


def host(out: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The arrays on the host; the visibility words as the uint32 they are (int32 on the device)."""
    arrays = {k: v.cpu().numpy() for k, v in out.items()}
    if "visibility" in arrays:
        arrays["visibility"] = arrays["visibility"].view(np.uint32)
    return arrays


# ---- expected arrays from the reference -------------------------------------------------------------------------

def expected_tree(log_probs: np.ndarray, ids: np.ndarray, start: int, bonus: int, budget: int):
    tree = build_tree(log_probs, ids, budget)
    n, rows, depth = tree.num_nodes, budget + 1, log_probs.shape[0]

    def padded(values) -> np.ndarray:
        a = np.full(rows, PAD, dtype=np.int64)
        a[: n + 1] = values
        return a

    depths = np.concatenate([[0], tree.depths])
    ancestors = np.full((rows, depth + 1), PAD, dtype=np.int64)
    ancestors[0, 0] = 0
    for node in range(1, n + 1):
        ancestors[node] = ancestors[tree.parents[node]]
        ancestors[node, depths[node]] = node
    visibility = np.zeros((rows, (budget + 32) // 32), dtype=np.uint32)
    visibility[: n + 1, : tree.visibility_bits.shape[1]] = tree.visibility_bits
    expect = {
        "tokens": padded(np.concatenate([[bonus], tree.tokens])),
        "parents": padded(tree.parents),
        "depths": padded(depths),
        "first_child": padded(tree.first_child),
        "next_sibling": padded(tree.next_sibling),
        "positions": padded(start + depths),
        "ancestors": ancestors,
        "visibility": visibility,
        "node_count": n,
    }
    return tree, expect


def follow_choices(rng: np.random.Generator, tokens: np.ndarray, parents: np.ndarray,
                   node_count: np.ndarray) -> np.ndarray:
    """Target choices that mostly pick one of the node's children (so walks go deep), else a random token."""
    streams, rows = tokens.shape
    choice = rng.integers(0, 170_000, (streams, rows)).astype(np.int32)
    live = (np.arange(rows)[None, :] >= 1) & (np.arange(rows)[None, :] <= node_count[:, None])
    s_idx, node = np.nonzero(live)
    order = rng.permutation(s_idx.size)  # among repeated parents, a random child's write lands last
    s_idx, node = s_idx[order], node[order]
    follow = rng.random(s_idx.size) < 0.85
    choice[s_idx[follow], parents[s_idx[follow], node[follow]]] = tokens[s_idx[follow], node[follow]]
    return choice


def walk_expectation(accepted: np.ndarray, bonus: int, choice: np.ndarray, depth: int) -> tuple[np.ndarray, int, int]:
    """The kernel's outputs for a reference walk: at most L + 1 nodes, -1 beyond, the bonus at the last kept node."""
    kept = accepted[: depth + 1]
    path = np.full(depth + 1, PAD, dtype=np.int64)
    path[: kept.size] = kept
    return path, int(kept.size), bonus if kept.size == accepted.size else int(choice[kept[-1]])


def mismatches(where: str, got: dict, expect: dict) -> list[str]:
    return [f"{where}: {name} differs" for name, value in expect.items() if not np.array_equal(got[name], value)]


def check_build_batch(task) -> list[str]:
    """Reference build (and walk, when choices are given) of every stream of one launch against the GPU's."""
    log_probs, ids, start, bonus, budget, built, choice, walked = task
    errors = []
    for s in range(log_probs.shape[0]):
        tree, expect = expected_tree(log_probs[s], ids[s], int(start[s]), int(bonus[s]), budget)
        where = f"budget {budget} L {log_probs.shape[1]} K {log_probs.shape[2]} stream {s}"
        errors += mismatches(where, {name: built[name][s] for name in expect}, expect)
        if choice is not None:
            accepted, next_bonus = accept_tree(tree, choice[s, : tree.num_nodes + 1])
            path, length, bonus_out = walk_expectation(accepted, next_bonus, choice[s], log_probs.shape[1])
            errors += mismatches(where + " accept", {k: walked[k][s] for k in ("accepted", "accept_len", "next_bonus")},
                                 {"accepted": path, "accept_len": length, "next_bonus": bonus_out})
    return errors


def check_walk_batch(task) -> list[str]:
    """Reference walk of arbitrary (malformed) links against the GPU's, for every stream of one launch."""
    tokens, first_child, next_sibling, node_count, choice, depth, walked = task
    errors = []
    budget = tokens.shape[1] - 1
    for s in range(tokens.shape[0]):
        n = min(max(int(node_count[s]), 0), budget)
        accepted, bonus = accept_walk(first_child[s, : n + 1], next_sibling[s, : n + 1], tokens[s, 1 : n + 1],
                                      choice[s, : n + 1])
        path, length, bonus_out = walk_expectation(accepted, bonus, choice[s], depth)
        errors += mismatches(f"budget {budget} L {depth} stream {s}",
                             {k: walked[k][s] for k in ("accepted", "accept_len", "next_bonus")},
                             {"accepted": path, "accept_len": length, "next_bonus": bonus_out})
    return errors


def run_checks(check, tasks, parallel: bool = True) -> None:
    """Runs `check` over the tasks, in forked worker processes (they use numpy only) when `parallel` (not under
    the sanitizer, which would follow the forks), and fails with the first mismatches."""
    errors = []
    if not parallel:
        for task in tasks:
            errors += check(task)
        assert not errors, f"{len(errors)} mismatches, first: {errors[:5]}"
        return
    workers = min(os.cpu_count() or 1, 16)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        pending = []
        for task in tasks:
            pending.append(pool.submit(check, task))
            if len(pending) >= 4 * workers:  # bounds the batches held in memory
                errors += pending.pop(0).result()
        for future in pending:
            errors += future.result()
    assert not errors, f"{len(errors)} mismatches, first: {errors[:5]}"


# ---- build ------------------------------------------------------------------------------------------------------

def build_tasks(seed: int, cases: int, max_streams: int, budgets=None):
    """Launches of several streams sharing (budget, L, K) until `cases` trees are built; yields check tasks that
    carry each launch's inputs, its GPU tree, target choices along it and the GPU walk of those."""
    rng = np.random.default_rng(seed)
    done = 0
    while done < cases:
        budget = fuzz_budget(rng) if budgets is None else int(rng.choice(budgets))
        depth, width = int(rng.integers(1, 16)), fuzz_width(rng, budget)
        streams = int(min(rng.integers(1, max_streams + 1), max(1, 30_000 // (budget + 1)), cases - done))
        log_probs, ids = candidates(rng, streams, depth, width)
        start = rng.integers(0, 1 << 20, streams).astype(np.int32)
        bonus = rng.integers(0, 170_000, streams).astype(np.int32)
        built = gpu_build(log_probs, ids, start, bonus, budget)
        node_count = built["node_count"].cpu().numpy()
        choice = follow_choices(rng, built["tokens"].cpu().numpy(), built["parents"].cpu().numpy(), node_count)
        walked = gpu_accept(built["tokens"], built["first_child"], built["next_sibling"], built["node_count"],
                            cuda(choice), depth)
        yield log_probs, ids, start, bonus, budget, host(built), choice, walked
        done += streams


def test_build_and_accept_fuzz() -> None:
    run_checks(check_build_batch, build_tasks(seed=23, cases=FUZZ_CASES, max_streams=128), parallel=not sanitizing())


def test_build_and_accept_memcheck() -> None:
    run_checks(check_build_batch, build_tasks(seed=5, cases=24, max_streams=4, budgets=[0, 1, 2, 7, 64, 1024]),
               parallel=False)


def test_build_edge_shapes() -> None:
    # budget 0 (the root alone), depth 1, width 1, and the largest launch: budget, depth and width at their limits
    rng = np.random.default_rng(1)
    for budget, depth, width in [(0, 1, 1), (0, 15, 1024), (5, 1, 1), (1, 1, 3), (1024, 15, 1024), (1024, 1, 1024),
                                 (1024, 15, 1), (300, 2, 2)]:
        log_probs, ids = candidates(rng, 3, depth, width)
        start = np.array([0, 7, 1 << 30], dtype=np.int32)
        bonus = np.array([5, 0, 163_839], dtype=np.int32)
        built = host(gpu_build(log_probs, ids, start, bonus, budget))
        errors = check_build_batch((log_probs, ids, start, bonus, budget, built, None, None))
        assert not errors, errors[:5]


def test_build_rejects_bad_shapes() -> None:
    rng = np.random.default_rng(2)
    for budget, depth, width in [(1025, 3, 4), (-1, 3, 4), (8, 16, 4)]:
        log_probs, ids = candidates(rng, 1, depth, width)
        with pytest.raises(ValueError):
            gpu_build(log_probs, ids, np.zeros(1, np.int32), np.zeros(1, np.int32), budget)
    log_probs, ids = candidates(rng, 1, 3, 1025)
    with pytest.raises(ValueError):
        gpu_build(log_probs, ids, np.zeros(1, np.int32), np.zeros(1, np.int32), 8)


# ---- accept over malformed links ---------------------------------------------------------------------------------

def malformed_tasks(seed: int, cases: int, streams: int, budgets=None):
    """Random links (out of range both ways, self loops, back edges that close cycles, int32 extremes), node counts
    outside 0..N, few distinct tokens so that choices match often."""
    rng = np.random.default_rng(seed)
    done = 0
    while done < cases:
        budget = int(rng.integers(0, 65) if rng.random() < 0.8 else rng.integers(65, 1025))
        if budgets is not None:
            budget = int(rng.choice(budgets))
        depth, rows, count = int(rng.integers(1, 16)), budget + 1, min(streams, cases - done)
        alphabet = int(rng.integers(1, 5))
        tokens = rng.integers(0, alphabet, (count, rows)).astype(np.int32)
        choice = rng.integers(0, alphabet, (count, rows)).astype(np.int32)
        links = []
        for _ in range(2):
            link = rng.integers(-3, rows + 3, (count, rows))
            node = np.broadcast_to(np.arange(rows), link.shape)
            kind = rng.random(link.shape)
            link = np.where(kind < 0.15, node, link)  # self loops
            link = np.where((kind >= 0.15) & (kind < 0.3), np.maximum(node - rng.integers(1, 4, link.shape), 0), link)
            link = np.where((kind >= 0.3) & (kind < 0.33), rng.choice([-(2**31), 2**31 - 1], link.shape), link)
            links.append(link.astype(np.int32))
        node_count = rng.integers(-2, rows + 3, count).astype(np.int32)
        walked = gpu_accept(cuda(tokens), cuda(links[0]), cuda(links[1]), cuda(node_count), cuda(choice), depth)
        yield tokens, links[0], links[1], node_count, choice, depth, walked
        done += count


def test_accept_malformed_fuzz() -> None:
    run_checks(check_walk_batch, malformed_tasks(seed=29, cases=FUZZ_CASES, streams=trimmed(1000, 100)),
               parallel=not sanitizing())


def test_accept_malformed_memcheck() -> None:
    run_checks(check_walk_batch, malformed_tasks(seed=3, cases=300, streams=100, budgets=[0, 1, 5, 64, 1024]),
               parallel=False)


# ---- commit -----------------------------------------------------------------------------------------------------

def commit_case(rng: np.random.Generator, layers: int, streams: int, budget: int, depth: int, row_elems: int,
                tap_width: int, max_context: int):
    cache = rng.integers(-(2**15), 2**15, (layers, streams * max_context, row_elems)).astype(np.int16)
    start = rng.integers(0, max_context - budget, streams).astype(np.int32)
    stream_base = (np.arange(streams) * max_context).astype(np.int32)
    accepted = np.full((streams, depth + 1), PAD, dtype=np.int32)
    accept_len = np.zeros(streams, dtype=np.int32)
    for s in range(streams):
        length = int(rng.integers(1, min(depth, budget) + 2))
        kind = rng.integers(0, 3)
        if kind == 0:  # already in place: nothing moves
            path = np.arange(length)
        elif kind == 1:  # one skipped node: every later row lands on a row that another one is read from
            path = np.concatenate([[0], np.arange(2, length + 1)])[:length] if length <= budget else np.arange(length)
        else:
            path = np.concatenate([[0], np.sort(rng.choice(np.arange(1, budget + 1), length - 1, replace=False))])
        accepted[s, :length], accept_len[s] = path, length
    taps = rng.integers(-(2**15), 2**15, (streams * (budget + 1), tap_width)).astype(np.int16)
    return cache, start, stream_base, accepted, accept_len, taps


def bf16(a: np.ndarray) -> torch.Tensor:
    return cuda(a).view(torch.bfloat16)


@pytest.mark.parametrize("layers,streams,budget,depth,row_elems,tap_width", [
    (3, 4, 16, 7, 576, 8216), (61, 2, 8, 15, 576, 0), (2, 5, 1024, 15, 1536, 8), (4, 3, 1, 1, 8, 16)])
def test_commit_equals_reference_compaction(layers: int, streams: int, budget: int, depth: int, row_elems: int,
                                            tap_width: int) -> None:
    check_commit(np.random.default_rng(layers * budget), layers, streams, budget, depth, row_elems, tap_width)


def test_commit_memcheck() -> None:
    check_commit(np.random.default_rng(4), 2, 3, 16, 7, 576, 64)


def check_commit(rng, layers, streams, budget, depth, row_elems, tap_width) -> None:
    max_context = budget + 40
    cache, start, stream_base, accepted, accept_len, taps = commit_case(rng, layers, streams, budget, depth,
                                                                        row_elems, max(tap_width, 8), max_context)
    context = rng.integers(-(2**15), 2**15, (streams, depth + 1, max(tap_width, 8))).astype(np.int16)
    cache_d, start_d, context_d = bf16(cache), cuda(start), bf16(context)
    gather = (bf16(taps), context_d) if tap_width else (None, None)
    kernels.tree_commit(cache_d, start_d, cuda(stream_base), cuda(accepted), cuda(accept_len), budget, *gather)

    expect = cache.copy()
    expect_context = context.copy()
    for s in range(streams):
        path = accepted[s, : accept_len[s]].astype(np.int64)
        rows = slice(stream_base[s], stream_base[s] + max_context)
        for layer in range(layers):
            commit_rows(expect[layer, rows], int(start[s]), path)
        if tap_width:
            expect_context[s, : path.size] = taps[s * (budget + 1) + path]
    assert np.array_equal(cache_d.view(torch.int16).cpu().numpy(), expect)
    assert np.array_equal(context_d.view(torch.int16).cpu().numpy(), expect_context)
    assert np.array_equal(start_d.cpu().numpy(), start + accept_len)


def test_commit_rejects_unaligned_rows() -> None:
    cache = torch.zeros(1, 16, 12, dtype=torch.bfloat16, device="cuda")
    one = torch.zeros(1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError):
        kernels.tree_commit(cache, one, one, torch.zeros(1, 2, dtype=torch.int32, device="cuda"), one + 1, 4)


# ---- one round's tree kernels inside a CUDA graph ---------------------------------------------------------------

def test_tree_kernels_replay_in_a_cuda_graph() -> None:
    rng = np.random.default_rng(9)
    streams, budget, depth, layers, row_elems, max_context = 4, 64, 7, 3, 576, 256
    log_probs, ids = candidates(rng, streams, depth, 64)
    start0 = rng.integers(0, 100, streams).astype(np.int32)
    bonus = cuda(rng.integers(0, 1000, streams).astype(np.int32))
    lp_d, ids_d = cuda(log_probs), cuda(ids)
    cache0 = rng.integers(-(2**15), 2**15, (layers, streams * max_context, row_elems)).astype(np.int16)
    stream_base = cuda((np.arange(streams) * max_context).astype(np.int32))

    def round_outputs():
        return {"tree": {name: filled(streams, budget + 1) for name in NODE_ARRAYS},
                "visibility": filled(streams, budget + 1, 3), "ancestors": filled(streams, budget + 1, depth + 1),
                "node_count": filled(streams), "accepted": filled(streams, depth + 1), "accept_len": filled(streams),
                "next_bonus": filled(streams), "start": cuda(start0), "cache": bf16(cache0)}

    def run_round(o, choice):
        t = o["tree"]
        kernels.tree_build(t["tokens"], t["parents"], t["depths"], t["first_child"], t["next_sibling"],
                           o["visibility"], t["positions"], o["ancestors"], o["node_count"], lp_d, ids_d, o["start"],
                           bonus, budget)
        kernels.tree_accept(o["accepted"], o["accept_len"], o["next_bonus"], t["tokens"], t["first_child"],
                            t["next_sibling"], o["node_count"], choice)
        kernels.tree_commit(o["cache"], o["start"], stream_base, o["accepted"], o["accept_len"], budget)

    eager = round_outputs()
    first = round_outputs()
    run_round(first, cuda(np.zeros((streams, budget + 1), np.int32)))
    choice = cuda(follow_choices(rng, first["tree"]["tokens"].cpu().numpy(), first["tree"]["parents"].cpu().numpy(),
                                 first["node_count"].cpu().numpy()))
    run_round(eager, choice)

    replayed = round_outputs()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    kernels.use_stream(stream.cuda_stream)
    try:
        with torch.cuda.graph(graph, stream=stream):
            run_round(replayed, choice)
    finally:
        kernels.use_stream(0)
    graph.replay()
    torch.cuda.synchronize()
    def flat(o):  # every array as integers: the cache's random bits hold NaNs, which never compare equal
        arrays = {**o["tree"], **{k: v for k, v in o.items() if k != "tree"}}
        return {k: v.view(torch.int16) if v.dtype == torch.bfloat16 else v for k, v in arrays.items()}

    for name, value in flat(eager).items():
        assert torch.equal(flat(replayed)[name], value), name
    assert int(eager["accept_len"].max()) > 1  # the walk went past the root
