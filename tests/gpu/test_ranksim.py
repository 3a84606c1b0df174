"""The target split over G ranks on one GPU (runtime/rank_simulation.h): with every rank held, the ranks' logits
slices, each layer's partials summed in rank order, equal the whole engine's within bf16 rounding; a row's logits
are bitwise the same whatever the batch, and a tree node's those of its autoregressive path; the cross-rank pick is
the single-GPU token choice; DDTree rounds give the split engine's autoregressive tokens. With one rank held (its peers
simulated, as tools/bench_ranksim.py times it) AR decoding runs in captured graphs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import ddtree
from ddtree.presets import preset_config
from ddtree.reference.model import ReferenceModel
from ddtree.reference.sampling import target_choices
from ddtree.shard import Shard
from engine_models import TINY_FUSED, model_config, reference_on_engine_routing


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=n).tolist() for n in lengths]


def _prompt_rows(engine: ddtree.Engine, prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The prompt's rows forwarded on stream 0 from position 0: logits [rows, vocab], routing [moe layers, rows,
    topk]."""
    return engine.native.forward_logits(prompt, [0] * len(prompt), list(range(len(prompt))), True)


def _relative_error(logits: np.ndarray, reference: np.ndarray) -> float:
    return float((np.abs(logits - reference).max(axis=1) / np.abs(reference).max(axis=1)).max())


@pytest.mark.parametrize("preset, ranks", [("tiny", 2), ("tiny", 4), ("small", 2), (TINY_FUSED, 2)])
def test_every_rank_held_equals_the_whole_engine(preset: str, ranks: int, model_dirs: dict[str, Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Within bf16 rounding, measured as the flash-attention tests do: the split engine's distance to the fp32
    reference is at most twice the whole engine's (+1e-3), each against the reference run on its own expert choices
    (each rank rounds its partial sums to bf16 before the rank-order sum, so a near-tie may route differently)."""
    cfg = model_config(preset)
    prompt = _prompts(cfg.vocab_size, [40], seed=ranks)[0]
    reference = ReferenceModel.load(model_dirs[preset])
    errors = {}
    for name, kwargs in (("whole", {}), ("split", {"shard": Shard(0, ranks), "all_ranks": True})):
        engine = ddtree.Engine(model_dirs[preset], streams=1, max_context=64, **kwargs)
        logits, routing = _prompt_rows(engine, prompt)
        del engine
        expected, far_from_tie = reference_on_engine_routing(reference, prompt, routing, monkeypatch)
        assert not far_from_tie, f"{name}: " + "; ".join(far_from_tie[:3])
        errors[name] = _relative_error(logits, expected.logits)
    assert errors["split"] <= 2 * errors["whole"] + 1e-3, errors


def test_split_row_is_batch_invariant(model_dirs: dict[str, Path]) -> None:
    cfg = model_config("small")
    engine = ddtree.Engine(model_dirs["small"], streams=16, max_context=300, shard=Shard(0, 2), all_ranks=True)
    prompts = _prompts(cfg.vocab_size, [3 + 17 * i for i in range(16)], seed=5)
    native = engine.native
    native.prefill(prompts, 0.0, 0)
    ids = [p[0] for p in prompts]
    positions = [len(p) for p in prompts]
    together = native.forward_logits(ids, list(range(16)), positions)
    for s in (0, 9, 15):
        alone = native.forward_logits([ids[s]], [s], [positions[s]])
        assert np.array_equal(alone[0], together[s]), s
    four = native.forward_logits(ids[4:8], list(range(4, 8)), positions[4:8])
    assert np.array_equal(four, together[4:8])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cross_rank_pick_is_the_token_choice(temperature: float, model_dirs: dict[str, Path]) -> None:
    cfg = model_config("tiny")
    engine = ddtree.Engine(model_dirs["tiny"], streams=4, max_context=64, shard=Shard(0, 4), all_ranks=True)
    prompts = _prompts(cfg.vocab_size, [2, 5, 11, 30], seed=9)
    native = engine.native
    first = native.prefill(prompts, temperature, 123)
    logits = native.forward_logits([p[-1] for p in prompts], list(range(4)), [len(p) - 1 for p in prompts])
    for s, prompt in enumerate(prompts):
        assert first[s] == target_choices(logits[s:s + 1], temperature, 123, s, [len(prompt) - 1])[0], s


def test_split_greedy_generation_follows_its_own_logits(model_dirs: dict[str, Path]) -> None:
    cfg = model_config("tiny")
    engine = ddtree.Engine(model_dirs["tiny"], streams=2, max_context=64, shard=Shard(0, 2), all_ranks=True)
    prompts = _prompts(cfg.vocab_size, [3, 8], seed=2)
    results = engine.generate(prompts, 6, stop_token_ids=())
    assert [g.name for g in engine.graphs()] and all(g.kind == "ar" for g in engine.graphs())
    for s, (prompt, result) in enumerate(zip(prompts, results)):
        seq = prompt + result.tokens
        check = ddtree.Engine(model_dirs["tiny"], streams=1, max_context=64, shard=Shard(0, 2), all_ranks=True)
        logits = check.native.forward_logits(seq[:-1], [0] * (len(seq) - 1), list(range(len(seq) - 1)))
        assert result.tokens == np.argmax(logits[len(prompt) - 1:], axis=1).tolist(), s


def test_one_rank_with_simulated_peers_decodes_in_graphs() -> None:
    cfg = dataclasses.replace(preset_config("small"), num_hidden_layers=3)
    engine = ddtree.Engine.random(cfg, streams=4, max_context=256, shard=Shard(3, 4))
    assert engine.native.held_ranks == [3]
    results = engine.generate(_prompts(cfg.vocab_size, [5, 6, 7, 8], seed=1), 8, temperature=1.0,
                              stop_token_ids=())
    assert all(len(r.tokens) == 8 and all(0 <= t < cfg.vocab_size for t in r.tokens) for r in results)
    name = engine.graphs()[0].name
    assert engine.replay(name, 5) > 0
    # the stand-ins and sums of one forward, timed apart: what a real transport would replace in that step
    assert 0 < engine.native.time_collectives(4, 5) < engine.replay(name, 5)
    with pytest.raises(ValueError, match="rows 0"):
        engine.native.time_collectives(0, 5)
    # its logits: its own quarter of the vocabulary, the peers' columns (never written on this GPU) 0
    logits = engine.native.forward_logits([1, 2, 3], [0, 0, 0], [0, 1, 2])
    own = 3 * cfg.vocab_size // 4
    assert not logits[:, :own].any() and np.isfinite(logits[:, own:]).all() and logits[:, own:].any()
    whole = ddtree.Engine.random(cfg, streams=1, max_context=64)
    with pytest.raises(ValueError, match="not split"):
        whole.native.time_collectives(1, 5)


@pytest.mark.parametrize("preset", ["tiny", TINY_FUSED])
def test_split_tree_nodes_equal_autoregressive_paths(preset: str, model_dirs: dict[str, Path]) -> None:
    """Tree verify on the split engine: every node's logits bitwise those of an autoregressive forward of its path."""
    from test_verify import _check_trees_equal_ar

    engine = ddtree.Engine(model_dirs[preset], streams=3, max_context=1024, budget=32, shard=Shard(0, 2),
                           all_ranks=True)
    _check_trees_equal_ar(engine, model_config(preset).vocab_size, [3, 500, 260], 32, seed=4)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_split_ddtree_equals_split_ar(temperature: float, model_dirs: dict[str, Path],
                                      tmp_path: Path) -> None:
    """DDTree rounds on every rank held (the drafter whole, with the target's whole lm_head of its own): its tokens
    are bitwise the split engine's autoregressive tokens, greedy and sampled, with the drafter's candidates and an
    oracle's."""
    from ddtree.drafter import make_drafter
    from test_ddtree_round import _check_round_equals_ar

    make_drafter(model_config("tiny"), tmp_path, seed=5, preset="tiny")
    engine = ddtree.Engine(model_dirs["tiny"], tmp_path, streams=3, max_context=512, budget=16, shard=Shard(0, 2),
                           all_ranks=True)
    _check_round_equals_ar(engine, 3, 16, temperature, None, seed=7)
    _check_round_equals_ar(engine, 3, 8, temperature, 0.8, seed=8)
