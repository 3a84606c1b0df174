"""Tree verify in the GPU engine: every node's logits are bitwise those of an autoregressive forward of its
root-to-node path from the same prefix, whatever else shares the forward; node logits and taps against the numpy
reference's forward with tree visibility; trees the engine must refuse."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import ddtree  # noqa: E402
from ddtree import bf16  # noqa: E402
from ddtree.errors import RequestError  # noqa: E402
from ddtree.presets import preset_config  # noqa: E402
from ddtree.reference.model import ReferenceModel  # noqa: E402
from conftest import sanitizing, trimmed  # noqa: E402
from engine_models import TINY_FUSED, TINY_LONG, model_config, reference_on_engine_routing  # noqa: E402

BUDGETS = (1, 7, 32, 64, 255)



def _random_tree(rng: np.random.Generator, nodes: int, vocab: int) -> tuple[list[int], list[int]]:
    """Tokens and parents (parent < child) of a tree of `nodes` rows, the root first: mostly random parents, with
    chains mixed in so that deep paths occur too."""
    parents = [-1] + [int(rng.integers(0, i)) if rng.random() < 0.6 else i - 1 for i in range(1, nodes)]
    return rng.integers(0, vocab, nodes).tolist(), parents


def _paths(parents: list[int]) -> list[list[int]]:
    """Each node's ancestors-and-self, root first."""
    paths: list[list[int]] = []
    for i, parent in enumerate(parents):
        paths.append([i] if parent < 0 else paths[parent] + [i])
    return paths


def _ar_logits(native, stream: int, start: int, tokens: list[int], parents: list[int],
               lengths_run: set[int] | None) -> tuple[np.ndarray, list[int]]:
    """Each node's logits from forwards of root-to-leaf paths at positions start.. over the stream's prefix: the
    rows an autoregressive decode of that path runs (prefill rows equal decode rows bitwise, test_engine); and the
    nodes those paths cover: every node, or in the sanitizer mode (`lengths_run` given: the path lengths already
    run in the other streams of the forward) those on one leaf's path per path length not yet run, whose lengths
    are then added to `lengths_run`."""
    paths = _paths(parents)
    leaves = sorted(set(range(len(parents))) - set(parents))
    if lengths_run is not None:
        by_length = {len(paths[leaf]): leaf for leaf in reversed(leaves)}
        leaves = sorted(leaf for length, leaf in by_length.items() if length not in lengths_run)
        lengths_run.update(by_length)
    out = np.empty((len(parents), 0), dtype=np.float32)
    for leaf in leaves:
        path = paths[leaf]
        logits = native.forward_logits([tokens[p] for p in path], [stream] * len(path),
                                       list(range(start, start + len(path))))
        if out.shape[1] == 0:
            out = np.empty((len(parents), logits.shape[1]), dtype=np.float32)
        out[path] = logits
    return out, sorted({node for leaf in leaves for node in paths[leaf]})


def _prefill(native, vocab: int, starts: list[int], rng: np.random.Generator) -> list[int]:
    """Prefixes of `starts` tokens in streams 0..; returns each stream's first sampled token (the roots)."""
    return native.prefill([rng.integers(0, vocab, n).tolist() for n in starts], 0.0, 0)


def _engine(model: str, model_dirs: dict[str, Path], streams: int, max_context: int, budget: int):
    if model.startswith("k2-layers"):
        return ddtree.Engine.random(preset_config("k2-layers", 2), streams, max_context, budget=budget, seed=1)
    return ddtree.Engine(model_dirs[model], streams=streams, max_context=max_context, budget=budget)


def _check_trees_equal_ar(engine, vocab: int, starts: list[int], budget: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    native = engine.native
    roots = _prefill(native, vocab, starts, rng)
    trees = []
    for root in roots:
        # full trees, and some a quarter smaller: streams of one forward need not have the same node count
        tokens, parents = _random_tree(rng, budget + 1 - int(rng.integers(0, budget // 4 + 1)), vocab)
        tokens[0] = root
        trees.append((tokens, parents))
    streams = list(range(len(starts)))
    logits, _, _ = native.verify(streams, starts, [t for t, _ in trees], [p for _, p in trees])
    first_rows = np.cumsum([0] + [len(tokens) for tokens, _ in trees])
    lengths_run: set[int] | None = set() if sanitizing() else None
    # the longest prefix first: in the sanitizer mode it takes the path lengths run once, past a chunk's keys
    for stream in sorted(streams, key=lambda s: -starts[s]):
        tokens, parents = trees[stream]
        ar, checked = _ar_logits(native, stream, starts[stream], tokens, parents, lengths_run)
        got = logits[first_rows[stream]:first_rows[stream] + len(tokens)]
        bad = [i for i in checked if not np.array_equal(got[i], ar[i])]
        assert not bad, (f"stream {stream} (start {starts[stream]}): nodes {bad[:8]} of {len(tokens)} differ from "
                         f"their autoregressive paths")


# Starts of 1, 3 and 16 streams: across a 64-key tile, the 512-key chunk edge (500 + depth), and short prefixes. In
# the sanitizer mode the 16 streams keep the shortest and the longest start (past a chunk) with fewer prefill rows
# in between.
STARTS = {1: [500], 3: [3, 500, 260], 16: [1 + trimmed(37, 7) * i for i in range(15)] + [556]}


@pytest.mark.parametrize("model", ["tiny", "small", TINY_FUSED])
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("streams", [1, 3, 16])
def test_nodes_equal_autoregressive_paths(model: str, budget: int, streams: int,
                                          model_dirs: dict[str, Path]) -> None:
    engine = _engine(model, model_dirs, streams, 1024, budget)
    _check_trees_equal_ar(engine, model_config(model).vocab_size, STARTS[streams], budget, seed=budget + streams)


@pytest.mark.parametrize("budget,streams", [(1, 3), (7, 16), (32, 3), (64, 1), (255, 1)])
def test_nodes_equal_autoregressive_paths_k2(budget: int, streams: int) -> None:
    engine = _engine("k2-layers", {}, streams, 1024, budget)
    _check_trees_equal_ar(engine, preset_config("k2-layers", 2).vocab_size, STARTS[streams], budget, seed=budget)


def test_nodes_cross_the_long_chunk_switch(model_dirs: dict[str, Path]) -> None:
    """Nodes whose paths cross 4096 -> 4097 keys, where a row's attention chunks grow from 512 to 1024 keys."""
    engine = _engine(TINY_LONG, model_dirs, 2, 4200, 32)
    _check_trees_equal_ar(engine, model_config(TINY_LONG).vocab_size, [4080, 4090], 32, seed=9)


@pytest.mark.parametrize("model", ["tiny", TINY_FUSED, "k2-layers"])
def test_node_logits_unchanged_by_other_rows(model: str, model_dirs: dict[str, Path]) -> None:
    """A node's logits do not depend on the other nodes, trees or streams in the forward."""
    vocab = preset_config("k2-layers", 2).vocab_size if model == "k2-layers" else model_config(model).vocab_size
    engine = _engine(model, model_dirs, 3, 800, 32)
    native = engine.native
    rng = np.random.default_rng(4)
    starts = [17, 400, 123]
    roots = _prefill(native, vocab, starts, rng)
    trees = [_random_tree(rng, 33, vocab) for _ in roots]
    for (tokens, _), root in zip(trees, roots):
        tokens[0] = root
    tokens, parents = [t for t, _ in trees], [p for _, p in trees]
    full, _, _ = native.verify([0, 1, 2], starts, tokens, parents)
    alone, _, _ = native.verify([1], starts[1:2], tokens[1:2], parents[1:2])
    assert np.array_equal(alone, full[33:66])
    # the first 10 nodes are a tree of their own (parents precede children)
    part, _, _ = native.verify([1], starts[1:2], [tokens[1][:10]], [parents[1][:10]])
    assert np.array_equal(part, full[33:43])
    reordered, _, _ = native.verify([2, 0], [starts[2], starts[0]], [tokens[2], tokens[0]], [parents[2], parents[0]])
    assert np.array_equal(reordered[:33], full[66:99]) and np.array_equal(reordered[33:], full[:33])


def _tree_visibility(parents: list[int]) -> np.ndarray:
    visible = np.zeros((len(parents), len(parents)), dtype=bool)
    for i, path in enumerate(_paths(parents)):
        visible[i, path] = True
    return visible


@pytest.mark.parametrize("model", ["tiny", "small", TINY_FUSED])
def test_verify_matches_reference(model: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Node logits and taps against the reference forward with tree visibility, on the engine's expert choices.
    The tolerances are the engine's own bf16 error on the same model: twice the largest error of the prefix's rows
    (verified as a chain from position 0, i.e. the autoregressive rows) against the reference, relative to each
    row's largest logit, or to each row's rms for the residual stream of each tapped layer."""
    cfg = model_config(model)
    start = 40
    engine = _engine(model, model_dirs, 1, 200, start)
    native = engine.native
    rng = np.random.default_rng(2)
    taps = list(range(cfg.num_hidden_layers))
    reference = ReferenceModel.load(model_dirs[model])
    cache = reference.new_cache()

    def errors(tokens, parents, at, visible=None):
        logits, tap_bits, routing = native.verify([0], [at], [tokens], [parents], taps, with_routing=True)
        positions = at + np.array([len(p) - 1 for p in _paths(parents)])
        ref, far = reference_on_engine_routing(reference, tokens, routing, monkeypatch, positions=positions,
                                               cache=cache, visible=visible, hidden_layers=taps)
        assert not far, far[:3]
        logit_err = (np.abs(logits - ref.logits).max(-1) / np.abs(ref.logits).max(-1)).max()
        hidden = bf16.as_float32(tap_bits.reshape(len(tokens), len(taps), cfg.hidden_size))
        hidden_err = [float((np.abs(hidden[:, t] - ref.hidden[layer]).max(-1) /
                             np.sqrt((ref.hidden[layer] ** 2).mean(-1))).max()) for t, layer in enumerate(taps)]
        return float(logit_err), hidden_err

    prefix = rng.integers(0, cfg.vocab_size, start).tolist()
    prefix_logit_err, prefix_hidden_err = errors(prefix, [-1] + list(range(start - 1)), 0)
    tokens, parents = _random_tree(rng, start + 1, cfg.vocab_size)
    logit_err, hidden_err = errors(tokens, parents, start, _tree_visibility(parents))
    assert logit_err <= 2 * prefix_logit_err, (logit_err, prefix_logit_err)
    for layer, err, tol in zip(taps, hidden_err, prefix_hidden_err):
        assert err <= 2 * tol, (layer, err, tol)


def test_taps_are_the_residual_rows(model_dirs: dict[str, Path]) -> None:
    """Taps of a subset of layers equal the same layers' columns of a tap of every layer."""
    cfg = model_config("tiny")
    engine = _engine("tiny", model_dirs, 1, 200, 8)
    native = engine.native
    rng = np.random.default_rng(5)
    root = _prefill(native, cfg.vocab_size, [30], rng)[0]
    tokens, parents = _random_tree(rng, 9, cfg.vocab_size)
    tokens[0] = root
    every = list(range(cfg.num_hidden_layers))
    _, all_taps, _ = native.verify([0], [30], [tokens], [parents], every)
    _, last, _ = native.verify([0], [30], [tokens], [parents], [every[-1]])
    h = cfg.hidden_size
    assert np.array_equal(last, all_taps[:, -h:])


def test_verify_refuses_bad_trees(model_dirs: dict[str, Path]) -> None:
    engine = _engine("tiny", model_dirs, 2, 64, 4)
    native = engine.native
    _prefill(native, 512, [5, 5], np.random.default_rng(0))
    cases = [
        (([0], [5], [[1, 2]], [[-1, 1]]), "parents\\[1\\] = 1"),
        (([0], [5], [[1, 2]], [[0, 0]]), "parents\\[0\\] = 0"),
        (([0], [5], [[1] * 6], [[-1, 0, 1, 2, 3, 4]]), "1..5 nodes"),
        (([2], [5], [[1]], [[-1]]), "stream 2"),
        (([0, 0], [5, 5], [[1], [1]], [[-1], [-1]]), "has another tree"),
        (([0], [64], [[1]], [[-1]]), "start 64"),
        (([0], [5], [[512]], [[-1]]), "token id 512"),
        (([0], [5], [[1, 2]], [[-1]]), "tokens and parents"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            native.verify(*args)
    with pytest.raises(ValueError, match="tap_layers"):
        native.verify([0], [5], [[1]], [[-1]], [1, 0])


def test_engine_budget_is_bounded(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(RequestError, match="budget must be an integer in 0..1024"):
        ddtree.Engine(model_dirs["tiny"], streams=1, max_context=64, budget=1025)
