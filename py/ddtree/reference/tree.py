"""DDTree tree build, verify inputs, accept walk and commit: the executable specification.

The GPU tree kernels are tested against these functions, so every rule that decides a bit of output is
spelled out here:

- Nodes are numbered in pop order; the root (the bonus token) is node 0 and has no token of its own here.
- Path score = sum of the per-depth log-probs along the path, accumulated in float64 with the same
  operation order as the published reference: a child's score is ``parent + lp[depth, 0]``, a sibling's is
  ``(score - lp[depth, rank]) + lp[depth, rank + 1]``.
- The heap key is ``(-score, ranks)`` where ``ranks`` is the tuple of ranks chosen at each depth; tuples
  compare lexicographically, a prefix before its extensions (Python tuple order). Two paths never share a
  rank tuple, so the key is a total order and the tree is a pure function of the inputs.
- Siblings are linked in ascending node index (= descending score); ``first_child`` is the lowest-indexed child.
- Visibility rows are packed little-endian into uint32 words: node j is visible to node i when bit ``j % 32``
  of ``visibility_bits[i, j // 32]`` is set. Row i = row parent(i) | bit i.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

VISIBILITY_WORD_BITS = 32


@dataclass(frozen=True)
class Tree:
    """A draft tree of ``n`` nodes below the root; arrays indexed by node include the root at 0."""

    tokens: np.ndarray  # int64 [n], token of node i + 1
    parents: np.ndarray  # int64 [n + 1], parents[0] == -1, parents[i] < i
    depths: np.ndarray  # int64 [n], depth of node i + 1 (1..L)
    ranks: np.ndarray  # int64 [n], top-K rank of node i + 1's token at its depth
    scores: np.ndarray  # float64 [n], path log-prob of node i + 1 (= its pop score, non-increasing)
    first_child: np.ndarray  # int64 [n + 1], -1 when none
    next_sibling: np.ndarray  # int64 [n + 1], -1 when none (always -1 for the root)
    visibility_bits: np.ndarray  # uint32 [n + 1, ceil((n + 1) / 32)], ancestor-or-self bit rows

    @property
    def num_nodes(self) -> int:
        """Number of drafted nodes, excluding the root."""
        return int(self.tokens.shape[0])

    @property
    def visibility(self) -> np.ndarray:
        """bool [n + 1, n + 1]: ``visibility[i, j]`` is true when j is i or an ancestor of i."""
        return unpack_visibility(self.visibility_bits, self.num_nodes + 1)


def _check_top_k(log_probs: np.ndarray, token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    log_probs = np.asarray(log_probs)
    token_ids = np.asarray(token_ids)
    if log_probs.ndim != 2:
        raise ValueError(f"log_probs must be [L, K], got shape {log_probs.shape}")
    if token_ids.shape != log_probs.shape:
        raise ValueError(f"token_ids shape {token_ids.shape} must equal log_probs shape {log_probs.shape}")
    if log_probs.dtype != np.float32:
        raise ValueError(f"log_probs must be float32, got {log_probs.dtype}")
    if not np.issubdtype(token_ids.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got {token_ids.dtype}")
    if not np.all(np.isfinite(log_probs)):
        raise ValueError("log_probs must be finite")
    if np.any(log_probs > 0):
        raise ValueError("log_probs must be <= 0 (log-softmax values)")
    if log_probs.shape[1] > 1 and np.any(log_probs[:, 1:] > log_probs[:, :-1]):
        raise ValueError("log_probs rows must be sorted in descending order")
    if np.any(token_ids < 0):
        raise ValueError("token_ids must be non-negative")
    ordered = np.sort(token_ids, axis=1)
    if ordered.shape[1] > 1 and np.any(ordered[:, 1:] == ordered[:, :-1]):
        raise ValueError("token_ids must be distinct within each depth (siblings are matched by token)")
    return log_probs, token_ids.astype(np.int64)


def build_tree(log_probs: np.ndarray, token_ids: np.ndarray, budget: int) -> Tree:
    """Best-first DDTree over per-depth top-K draft log-probs.

    ``log_probs`` float32 [L, K] (rows sorted descending, log-softmax at temperature 1), ``token_ids`` int
    [L, K]. Pops at most ``budget`` nodes; depth never exceeds L. Only ranks below ``min(budget, K)`` are used.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
        raise ValueError(f"budget must be a non-negative integer, got {budget!r}")
    lp, ids = _check_top_k(log_probs, token_ids)
    depth_limit, width = lp.shape
    top_k = min(int(budget), width)
    lp64 = lp.astype(np.float64)

    tokens: list[int] = []
    parents: list[int] = [-1]
    depths: list[int] = []
    ranks_out: list[int] = []
    scores: list[float] = []
    heap: list[tuple[float, tuple[int, ...], int, int, int, float]] = []
    if budget > 0 and depth_limit > 0 and width > 0:
        first = float(lp64[0, 0])
        heap.append((-first, (0,), 0, 1, 0, first))
    while heap and len(tokens) < budget:
        _, path_ranks, parent, depth, rank, score = heapq.heappop(heap)
        index = len(tokens) + 1
        tokens.append(int(ids[depth - 1, rank]))
        parents.append(parent)
        depths.append(depth)
        ranks_out.append(rank)
        scores.append(score)
        if rank + 1 < top_k:
            sibling = score - float(lp64[depth - 1, rank]) + float(lp64[depth - 1, rank + 1])
            heapq.heappush(heap, (-sibling, path_ranks[:-1] + (rank + 1,), parent, depth, rank + 1, sibling))
        if depth < depth_limit:
            child = score + float(lp64[depth, 0])
            heapq.heappush(heap, (-child, path_ranks + (0,), index, depth + 1, 0, child))

    parents_arr = np.asarray(parents, dtype=np.int64)
    first_child, next_sibling = sibling_links(parents_arr)
    return Tree(
        tokens=np.asarray(tokens, dtype=np.int64),
        parents=parents_arr,
        depths=np.asarray(depths, dtype=np.int64),
        ranks=np.asarray(ranks_out, dtype=np.int64),
        scores=np.asarray(scores, dtype=np.float64),
        first_child=first_child,
        next_sibling=next_sibling,
        visibility_bits=visibility_bits(parents_arr),
    )


def sibling_links(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First-child / next-sibling links (siblings in ascending index) from a parent array with parent < child."""
    size = parents.shape[0]
    first_child = np.full(size, -1, dtype=np.int64)
    next_sibling = np.full(size, -1, dtype=np.int64)
    last_child = np.full(size, -1, dtype=np.int64)
    for node in range(1, size):
        parent = int(parents[node])
        if first_child[parent] < 0:
            first_child[parent] = node
        else:
            next_sibling[last_child[parent]] = node
        last_child[parent] = node
    return first_child, next_sibling


def visibility_bits(parents: np.ndarray) -> np.ndarray:
    """Packed ancestor-or-self rows: row i = row parents[i] | bit i (valid because parents[i] < i)."""
    size = parents.shape[0]
    words = (size + VISIBILITY_WORD_BITS - 1) // VISIBILITY_WORD_BITS
    bits = np.zeros((size, words), dtype=np.uint32)
    for node in range(size):
        if node > 0:
            bits[node] = bits[parents[node]]
        bits[node, node // VISIBILITY_WORD_BITS] |= np.uint32(1 << (node % VISIBILITY_WORD_BITS))
    return bits


def unpack_visibility(bits: np.ndarray, size: int) -> np.ndarray:
    """bool [size, size] view of packed visibility rows."""
    as_bytes = bits.astype("<u4").view(np.uint8).reshape(bits.shape[0], -1)
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :size].astype(bool)


def verify_inputs(tree: Tree, root_token: int, start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Target verify inputs: ids ``[root, tokens...]``, positions ``start + depth`` (root at ``start``) and
    the bool [n + 1, n + 1] ancestor-or-self mask over the tree block (every node also sees the whole prefix)."""
    ids = np.concatenate([np.asarray([root_token], dtype=np.int64), tree.tokens])
    positions = start + np.concatenate([np.zeros(1, dtype=np.int64), tree.depths])
    return ids, positions, tree.visibility


def accept_walk(
    first_child: np.ndarray, next_sibling: np.ndarray, tokens: np.ndarray, choices: np.ndarray
) -> tuple[np.ndarray, int]:
    """Follow the target's choices from the root through LCRS links.

    ``tokens`` int [n] (token of node i + 1), links int [n + 1], ``choices`` int [n + 1] (the target's token
    at each node). Returns the accepted node indices (starting with the root 0) and the next bonus token
    (the target's choice at the last accepted node). At most ``n`` links are followed in total and links
    outside ``1..n`` count as absent, so cyclic or malformed links always terminate.
    """
    n = int(np.asarray(tokens).shape[0])
    for name, array in (("first_child", first_child), ("next_sibling", next_sibling), ("choices", choices)):
        if np.asarray(array).shape != (n + 1,):
            raise ValueError(f"{name} must have shape ({n + 1},), got {np.asarray(array).shape}")
    accepted = [0]
    current = 0
    steps_left = n
    while True:
        wanted = int(choices[current])
        candidate = int(first_child[current])
        matched = -1
        while 1 <= candidate <= n and steps_left > 0:
            steps_left -= 1
            if int(tokens[candidate - 1]) == wanted:
                matched = candidate
                break
            candidate = int(next_sibling[candidate])
        if matched < 0:
            return np.asarray(accepted, dtype=np.int64), wanted
        accepted.append(matched)
        current = matched


def accept_tree(tree: Tree, choices: np.ndarray) -> tuple[np.ndarray, int]:
    """Accept walk over a built tree."""
    return accept_walk(tree.first_child, tree.next_sibling, tree.tokens, choices)


def commit_rows(kv: np.ndarray, past_length: int, accepted: np.ndarray, axis: int = 0) -> int:
    """Move the accepted tree rows ``past_length + accepted`` to ``[past_length, past_length + a)`` along
    ``axis``, in place; returns the new committed length. All rows are read before any is written, so the
    result does not depend on the order in which a parallel implementation copies them."""
    accepted = np.asarray(accepted, dtype=np.int64)
    if accepted.ndim != 1:
        raise ValueError(f"accepted must be 1-D, got shape {accepted.shape}")
    rows = kv.shape[axis]
    if accepted.size and (accepted.min() < 0 or past_length + accepted.max() >= rows):
        raise ValueError(f"accepted indices must lie in [0, {rows - past_length}) of the tree rows")
    if not is_contiguous_prefix(accepted):
        view = np.moveaxis(kv, axis, 0)
        gathered = view[past_length + accepted].copy()
        view[past_length : past_length + accepted.size] = gathered
    return past_length + int(accepted.size)


def next_context(tapped: list[np.ndarray], accepted: np.ndarray) -> np.ndarray:
    """The drafter's next context: the accepted nodes' tapped target hidden states (one [rows, hidden] array
    per tapped layer, in ``target_layer_ids`` order), concatenated along features: float32 [a, taps * hidden]."""
    return np.concatenate([np.asarray(layer, dtype=np.float32)[accepted] for layer in tapped], axis=1)


def is_contiguous_prefix(accepted: np.ndarray) -> bool:
    """True when the accepted nodes are already ``0, 1, ..., a - 1`` (commit needs no copy)."""
    accepted = np.asarray(accepted)
    return bool(np.array_equal(accepted, np.arange(accepted.size)))
