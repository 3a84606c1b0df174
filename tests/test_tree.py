"""Properties of the reference DDTree build, verify inputs, accept walk and commit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.reference.sampling import gumbel_noise, target_choices, uniform_from_hash
from ddtree.reference.tree import (
    Tree,
    accept_tree,
    accept_walk,
    build_tree,
    commit_rows,
    is_contiguous_prefix,
    verify_inputs,
)


def _top_k(rng: np.random.Generator, depth: int, width: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    logits = rng.normal(size=(depth, vocab)) * 3
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    order = np.argsort(-log_probs, axis=1, kind="stable")[:, :width]
    return np.take_along_axis(log_probs, order, axis=1).astype(np.float32), order.astype(np.int64)


@st.composite
def dyadic_top_k(draw, max_depth: int = 4, max_width: int = 4):
    """Log-probs that are multiples of 1/8: float64 sums are exact, so ties are real and frequent."""
    depth = draw(st.integers(1, max_depth))
    width = draw(st.integers(1, max_width))
    eighths = draw(st.lists(st.integers(-24, 0), min_size=depth * width, max_size=depth * width))
    log_probs = -np.sort(-np.asarray(eighths, dtype=np.float32).reshape(depth, width) / 8, axis=1)
    ids = np.stack([draw(st.permutations(range(width + 3)))[:width] for _ in range(depth)]).astype(np.int64)
    budget = draw(st.integers(0, 2 * width**depth))
    return log_probs, ids, budget


def _path_ranks(tree: Tree, node: int) -> tuple[int, ...]:
    ranks = []
    while node > 0:
        ranks.append(int(tree.ranks[node - 1]))
        node = int(tree.parents[node])
    return tuple(reversed(ranks))


def _brute_force_order(log_probs: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    depth_limit, width = log_probs.shape
    usable = min(budget, width)
    paths = [
        ranks
        for depth in range(1, depth_limit + 1)
        for ranks in itertools.product(range(usable), repeat=depth)
    ]
    score = {p: sum(float(log_probs[d, r]) for d, r in enumerate(p)) for p in paths}
    return sorted(paths, key=lambda p: (-score[p], p))[:budget]


def _check_structure(tree: Tree, log_probs: np.ndarray, ids: np.ndarray) -> None:
    n = tree.num_nodes
    assert tree.parents.shape == (n + 1,) and tree.parents[0] == -1
    assert np.all(tree.parents[1:] < np.arange(1, n + 1))
    assert np.all(tree.parents[1:] >= 0)
    parent_depth = np.concatenate([[0], tree.depths])[tree.parents[1:]]
    assert np.array_equal(tree.depths, parent_depth + 1), "prefix-closed: parent is one level up"
    assert np.all((tree.depths >= 1) & (tree.depths <= log_probs.shape[0]))
    assert np.all(np.diff(tree.scores) <= 0), "pop scores non-increasing"
    assert np.array_equal(tree.tokens, ids[tree.depths - 1, tree.ranks])
    for node in range(1, n + 1):
        expected = sum(float(log_probs[d, r]) for d, r in enumerate(_path_ranks(tree, node)))
        assert tree.scores[node - 1] == pytest.approx(expected, abs=1e-9)
    # LCRS links enumerate exactly the children of each node, in ascending index.
    for node in range(n + 1):
        children, child = [], int(tree.first_child[node])
        while child >= 0:
            children.append(child)
            child = int(tree.next_sibling[child])
        assert children == [c for c in range(1, n + 1) if tree.parents[c] == node]
    assert tree.next_sibling[0] == -1
    # Visibility: ancestor-or-self, packed and unpacked views agree.
    vis = tree.visibility
    assert vis.shape == (n + 1, n + 1)
    for node in range(n + 1):
        ancestors, walker = set(), node
        while walker >= 0:
            ancestors.add(walker)
            walker = int(tree.parents[walker])
        assert set(np.flatnonzero(vis[node]).tolist()) == ancestors


@settings(max_examples=300, deadline=None)
@given(dyadic_top_k())
def test_build_tree_matches_brute_force_with_ties(case):
    log_probs, ids, budget = case
    tree = build_tree(log_probs, ids, budget)
    _check_structure(tree, log_probs, ids)
    expected = _brute_force_order(log_probs, budget)
    assert [_path_ranks(tree, node) for node in range(1, tree.num_nodes + 1)] == expected


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 16), st.integers(1, 70), st.integers(0, 80))
def test_build_tree_properties_random_floats(seed, depth, width, budget):
    rng = np.random.default_rng(seed)
    log_probs, ids = _top_k(rng, depth, width, vocab=width + 5)
    tree = build_tree(log_probs, ids, budget)
    _check_structure(tree, log_probs, ids)
    usable = min(budget, width)
    reachable = sum(usable**d for d in range(1, depth + 1))
    assert tree.num_nodes == min(budget, reachable)


def test_build_tree_small_brute_force_random_floats():
    rng = np.random.default_rng(7)
    for _ in range(50):
        log_probs, ids = _top_k(rng, depth=3, width=4, vocab=9)
        budget = int(rng.integers(1, 30))
        tree = build_tree(log_probs, ids, budget)
        assert [_path_ranks(tree, node) for node in range(1, tree.num_nodes + 1)] == _brute_force_order(
            log_probs, budget
        )


def test_build_tree_chain_when_budget_one_per_depth():
    log_probs = np.log(np.array([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3]], dtype=np.float32))
    ids = np.array([[5, 6], [7, 8], [9, 10]])
    tree = build_tree(log_probs, ids, 3)
    assert tree.tokens.tolist() == [5, 7, 9]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert build_tree(log_probs, ids, 0).num_nodes == 0


@pytest.mark.parametrize(
    ("log_probs", "ids", "budget", "message"),
    [
        (np.zeros((2, 2), np.float64), np.zeros((2, 2), np.int64), 4, "float32"),
        (np.zeros((2, 2), np.float32), np.zeros((2, 3), np.int64), 4, "shape"),
        (np.array([[-1.0, -0.5]], np.float32), np.array([[1, 2]]), 4, "descending"),
        (np.array([[0.5, -0.5]], np.float32), np.array([[1, 2]]), 4, "<= 0"),
        (np.array([[np.nan, -0.5]], np.float32), np.array([[1, 2]]), 4, "finite"),
        (np.array([[-0.1, -0.5]], np.float32), np.array([[3, 3]]), 4, "distinct"),
        (np.array([[-0.1, -0.5]], np.float32), np.array([[3, -1]]), 4, "non-negative"),
        (np.array([[-0.1, -0.5]], np.float32), np.array([[1, 2]]), -1, "budget"),
    ],
)
def test_build_tree_rejects_bad_input(log_probs, ids, budget, message):
    with pytest.raises(ValueError, match=message):
        build_tree(log_probs, ids, budget)


def test_verify_inputs_positions_and_mask():
    rng = np.random.default_rng(3)
    log_probs, ids = _top_k(rng, depth=6, width=5, vocab=20)
    tree = build_tree(log_probs, ids, 40)
    verify_ids, positions, mask = verify_inputs(tree, root_token=11, start=100)
    assert verify_ids[0] == 11 and np.array_equal(verify_ids[1:], tree.tokens)
    assert positions[0] == 100 and np.array_equal(positions[1:], 100 + tree.depths)
    assert tree.visibility_bits.shape == (41, 2)
    assert np.array_equal(mask, tree.visibility)
    assert np.array_equal(np.tril(mask), mask), "a node never sees a later node"


def _oracle_walk(tree: Tree, choices: np.ndarray) -> tuple[list[int], int]:
    accepted, current = [0], 0
    while True:
        children = {int(tree.tokens[c - 1]): c for c in range(1, tree.num_nodes + 1) if tree.parents[c] == current}
        if int(choices[current]) not in children:
            return accepted, int(choices[current])
        current = children[int(choices[current])]
        accepted.append(current)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 32))
def test_accept_walk_matches_parent_oracle(seed, budget):
    rng = np.random.default_rng(seed)
    log_probs, ids = _top_k(rng, depth=5, width=3, vocab=4)
    tree = build_tree(log_probs, ids, budget)
    choices = rng.integers(0, 4, size=tree.num_nodes + 1)
    accepted, bonus = accept_tree(tree, choices)
    expected, expected_bonus = _oracle_walk(tree, choices)
    assert accepted.tolist() == expected and bonus == expected_bonus


@settings(max_examples=300, deadline=2000)
@given(st.integers(0, 2**31 - 1), st.integers(0, 40))
def test_accept_walk_terminates_on_cyclic_links(seed, n):
    rng = np.random.default_rng(seed)
    first_child = rng.integers(-2, n + 3, size=n + 1)
    next_sibling = rng.integers(-2, n + 3, size=n + 1)
    tokens = rng.integers(0, 2, size=n)  # few tokens: most scans match, so walks run long
    choices = rng.integers(0, 2, size=n + 1)
    accepted, bonus = accept_walk(first_child, next_sibling, tokens, choices)
    assert 1 <= accepted.size <= n + 1
    assert accepted[0] == 0 and np.all((accepted[1:] >= 1) & (accepted[1:] <= n))
    assert bonus == choices[accepted[-1]]


def test_accept_walk_on_a_self_loop_stops():
    # Node 1 is its own first child and matches every time: an unbounded walk would never end.
    accepted, bonus = accept_walk(np.array([1, 1]), np.array([-1, 1]), np.array([4]), np.array([4, 4]))
    assert accepted.tolist() == [0, 1] and bonus == 4


def test_accept_walk_rejects_wrong_shapes():
    with pytest.raises(ValueError, match="choices"):
        accept_walk(np.array([-1, -1]), np.array([-1, -1]), np.array([3]), np.array([1]))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 5), st.integers(1, 12))
def test_commit_rows_reads_all_then_writes(seed, past, tree_size):
    rng = np.random.default_rng(seed)
    kv = rng.normal(size=(3, past + tree_size, 4)).astype(np.float32)  # sequence on axis 1
    count = int(rng.integers(1, tree_size + 1))
    accepted = np.sort(rng.choice(tree_size, size=count, replace=False))
    accepted[0] = 0
    accepted = np.unique(accepted)
    expected = np.concatenate([kv[:, :past], kv[:, past + accepted]], axis=1)
    new_length = commit_rows(kv, past, accepted, axis=1)
    assert new_length == past + accepted.size
    assert np.array_equal(kv[:, :new_length], expected)


def test_commit_rows_any_order_and_contiguous_skip():
    kv = np.arange(6.0)[:, None] * np.ones((1, 2))
    assert commit_rows(kv, 1, np.array([4, 2, 0])) == 4  # backwards: only read-all-then-write is right
    assert kv[:4, 0].tolist() == [0.0, 5.0, 3.0, 1.0]
    assert is_contiguous_prefix(np.array([0, 1, 2])) and not is_contiguous_prefix(np.array([0, 2]))
    with pytest.raises(ValueError, match="accepted"):
        commit_rows(kv, 1, np.array([0, 9]))


def test_target_choices_argmax_and_keyed_gumbel_sampling():
    logits = np.array([[1.0, 3.0, 3.0], [0.0, -1.0, -2.0]], dtype=np.float32)
    assert target_choices(logits, 0.0, 0, 0, [0, 1]).tolist() == [1, 0]
    # One draw per (seed, stream, position): 20000 positions sample softmax(logits / T).
    probs = np.array([0.2, 0.5, 0.3])
    row = np.log(probs).astype(np.float32)[None].repeat(20000, axis=0)
    counts = np.bincount(target_choices(row, 1.0, 7, 0, np.arange(20000)), minlength=3) / 20000
    assert np.allclose(counts, probs, atol=0.02)
    half = (2 * row[:1000]).astype(np.float32)  # T = 2 on doubled logits is the same distribution
    assert target_choices(half, 2.0, 7, 0, np.arange(1000)).tolist() == \
        target_choices(row[:1000], 1.0, 7, 0, np.arange(1000)).tolist()
    # The noise is a function of (seed, stream, position) only: repeatable, and different for each of them.
    draws = target_choices(row[:64], 1.0, 7, 0, np.arange(64))
    assert draws.tolist() == target_choices(row[:64], 1.0, 7, 0, np.arange(64)).tolist()
    for seed, stream in ((8, 0), (7, 1)):
        assert draws.tolist() != target_choices(row[:64], 1.0, seed, stream, np.arange(64)).tolist()
    assert target_choices(row[5:6], 1.0, 7, 0, [5]).tolist() == draws[5:6].tolist()
    nan = np.array([[np.nan, 1.0, np.nan], [np.nan] * 3], dtype=np.float32)
    assert target_choices(nan, 0.0, 0, 0, [0, 0]).tolist() == [1, 0]
    assert target_choices(nan, 1.0, 0, 0, [0, 0]).tolist() == [1, 0]


def test_gumbel_noise_matches_the_device_hash():
    """The first values of the device's hash for (seed 1, stream 2, position 3), computed independently here with
    Python integers: splitmix64's finaliser over the Weyl sequence of the key."""
    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
        return z ^ (z >> 31)
    key = mix(1 ^ mix((2 << 32) | 3))
    want = []
    for i in range(5):
        u = np.float32(((mix((key + i * 0x9E3779B97F4A7C15) & (2**64 - 1)) >> 41) + 0.5) / 8388608.0)
        want.append(-np.log(-np.log(u)))
    assert np.array_equal(gumbel_noise(1, 2, 3, 5), np.array(want, dtype=np.float32))


def test_gumbel_uniforms_stay_below_one():
    """The extreme hashes give u strictly inside (0, 1), so no token's noise is infinite."""
    h = np.array([0, 1 << 40, (1 << 64) - 1, ((1 << 23) - 1) << 41], dtype=np.uint64)
    u = uniform_from_hash(h)
    assert (u > 0).all() and (u < 1).all()
    assert np.isfinite(-np.log(-np.log(u))).all()


