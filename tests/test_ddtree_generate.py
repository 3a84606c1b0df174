"""DDTree generation on the reference: greedy output equals autoregressive, token for token, for every budget;
sampled output has the autoregressive distribution."""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from ddtree.drafter import drafter_config_for, make_drafter, random_drafter_tensors
from ddtree.errors import RequestError
from ddtree.presets import preset_config, random_tensors
from ddtree.reference import ReferenceModel, generate
from ddtree.reference.drafter import ReferenceDrafter
from ddtree.reference.tree import commit_rows

# `ddtree.reference.generate` is the function (exported by the package); the module is reached by its path.
generate_module = importlib.import_module("ddtree.reference.generate")
BUDGETS = (1, 2, 4, 8, 16, 32, 64)
PROMPTS = ([1, 17, 300, 5, 42], [1, 99], [7, 7, 7, 7, 7, 7, 7, 7, 200, 11, 480])
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[ReferenceModel, ReferenceDrafter]:
    """The tiny target and a matching drafter, both read back from disk as make-model writes them."""
    drafter_dir = tmp_path_factory.mktemp("tiny_drafter")
    model = ReferenceModel.load(tiny_model_dir)
    make_drafter(model.config, drafter_dir, seed=1, preset="tiny")
    return model, ReferenceDrafter.for_model(drafter_dir, model)


@pytest.fixture(scope="module")
def ar_greedy(tiny) -> dict[int, list[int]]:
    model, _ = tiny
    return {i: generate(model, None, p, NEW_TOKENS).tokens for i, p in enumerate(PROMPTS)}


def _check_accounting(result) -> None:
    """Round r emits accept_lengths[r] tokens (accepted nodes after the root, plus the new bonus)."""
    produced = 1 + sum(result.accept_lengths)
    assert produced - result.accept_lengths[-1] < len(result.tokens) <= produced
    assert all(1 <= a for a in result.accept_lengths)


@pytest.mark.parametrize("budget", BUDGETS)
def test_greedy_ddtree_equals_autoregressive(tiny, ar_greedy, budget):
    model, drafter = tiny
    for i, prompt in enumerate(PROMPTS):
        result = generate(model, drafter, prompt, NEW_TOKENS, method="ddtree", budget=budget)
        assert result.tokens == ar_greedy[i], f"prompt {i}, budget {budget}"
        _check_accounting(result)
        print(f"budget {budget:2d} prompt {i}: acceptance lengths {result.accept_lengths}")
        assert max(result.accept_lengths) <= min(budget, drafter.config.block_size - 1) + 1


class OracleDrafter:
    """Test drafter that knows the greedy continuation and puts its tokens at chosen ranks of the real drafter's
    logits, so trees accept deep paths and paths through non-zero ranks (non-contiguous commits)."""

    def __init__(self, inner: ReferenceDrafter, continuation: list[int], prompt_length: int, seed: int) -> None:
        self.inner, self.config = inner, inner.config
        self.continuation, self.prompt_length = continuation, prompt_length
        self.rng = np.random.default_rng(seed)

    def new_cache(self, window=None):
        return self.inner.new_cache(window)

    def draft(self, cache, context, bonus_token, start):
        logits = self.inner.draft(cache, context, bonus_token, start)
        for depth in range(1, logits.shape[0] + 1):
            index = start - self.prompt_length + depth
            if index >= len(self.continuation):
                break
            rank = self.rng.choice([0, 1, 2, -1], p=[0.6, 0.2, 0.1, 0.1])  # -1: leave the token where it is
            if rank < 0:
                continue
            row, token = logits[depth - 1], self.continuation[index]
            row[token] = -np.inf
            ranked = [int(t) for t in np.argsort(-row, kind="stable")[:2]]
            ranked.insert(rank, token)
            # Three confident candidates (probabilities near 0.6 / 0.25 / 0.1): trees grow deep, not wide.
            row[ranked[:3]] = row.max() + np.array([12.0, 11.1, 10.2], dtype=np.float32)
        return logits


def test_greedy_ddtree_with_deep_and_non_contiguous_accepts(tiny, ar_greedy, monkeypatch):
    model, drafter = tiny
    accepted_paths = []
    walk = generate_module.accept_tree

    def recording_walk(tree, choices):
        accepted, bonus = walk(tree, choices)
        accepted_paths.append(accepted.tolist())
        return accepted, bonus

    monkeypatch.setattr(generate_module, "accept_tree", recording_walk)
    for budget in (4, 16, 64):
        for i, prompt in enumerate(PROMPTS):
            oracle = OracleDrafter(drafter, ar_greedy[i], len(prompt), seed=budget + i)
            result = generate(model, oracle, prompt, NEW_TOKENS, method="ddtree", budget=budget)
            assert result.tokens == ar_greedy[i], f"prompt {i}, budget {budget}"
            _check_accounting(result)
            print(f"oracle budget {budget:2d} prompt {i}: acceptance lengths {result.accept_lengths}")
    assert max(len(p) for p in accepted_paths) >= 5, "some round accepted a deep path"
    assert any(p != list(range(len(p))) for p in accepted_paths), "some commit moved non-contiguous rows"


def test_sampled_ddtree_equals_sampled_autoregressive(tiny):
    """Each position's Gumbel noise is keyed by (seed, stream, position), so a node on the accepted path draws what
    AR draws there: the same tokens, round after round, also through deep accepts from the oracle drafter."""
    model, drafter = tiny
    for i, prompt in enumerate(PROMPTS):
        for seed, stream in ((3, 0), (4, 5)):
            ar = generate(model, None, prompt, NEW_TOKENS, temperature=0.9, seed=seed, stream=stream).tokens
            oracle = OracleDrafter(drafter, ar, len(prompt), seed)
            for d in (drafter, oracle):
                result = generate(model, d, prompt, NEW_TOKENS, method="ddtree", budget=8, temperature=0.9,
                                  seed=seed, stream=stream)
                assert result.tokens == ar, f"prompt {i}, seed {seed}, stream {stream}"
            assert max(result.accept_lengths) >= 3  # the oracle's deep accepts ran
        other = generate(model, None, prompt, NEW_TOKENS, temperature=0.9, seed=3, stream=1).tokens
        assert other != generate(model, None, prompt, NEW_TOKENS, temperature=0.9, seed=3).tokens


def test_stop_token_ends_both_methods_at_the_same_place(tiny, ar_greedy):
    model, drafter = tiny
    stop = ar_greedy[0][9]
    first = ar_greedy[0].index(stop)
    expected = ar_greedy[0][: first + 1]
    assert generate(model, None, PROMPTS[0], NEW_TOKENS, stop_token_ids=[stop]).tokens == expected
    result = generate(model, drafter, PROMPTS[0], NEW_TOKENS, method="ddtree", budget=8, stop_token_ids=[stop])
    assert result.tokens == expected


def test_generate_rejects_bad_requests(tiny):
    model, drafter = tiny
    with pytest.raises(RequestError, match="method"):
        generate(model, drafter, [1, 2], 4, method="beam")
    with pytest.raises(RequestError, match="drafter"):
        generate(model, None, [1, 2], 4, method="ddtree")
    with pytest.raises(RequestError, match="budget"):
        generate(model, drafter, [1, 2], 4, method="ddtree", budget=-1)
    with pytest.raises(RequestError, match="temperature"):
        generate(model, drafter, [1, 2], 4, method="ddtree", temperature=-1.0)
    with pytest.raises(RequestError, match="vocabulary"):
        generate(model, drafter, [1, 10**6], 4, method="ddtree")
    assert generate(model, drafter, [1, 2], 0, method="ddtree").tokens == []


# ---- T > 0: DDTree's output distribution is the autoregressive one -------------------------------------------

VOCAB = 8
SAMPLED_TOKENS = 4
TEMPERATURE = 0.7


def _exact_ar_distribution(model: ReferenceModel, prompt: list[int], temperature: float) -> dict[tuple, float]:
    """P(t1..tm) of autoregressive sampling, by enumerating every prefix (float64 softmax of logits / T)."""
    probs: dict[tuple, float] = {(): 1.0}
    for _ in range(SAMPLED_TOKENS):
        grown = {}
        for prefix, p in probs.items():
            ids = prompt + list(prefix)
            logits = model.forward(ids, np.arange(len(ids)), model.new_cache()).logits[-1].astype(np.float64)
            scaled = np.exp((logits - logits.max()) / temperature)
            for token, q in enumerate(scaled / scaled.sum()):
                grown[prefix + (token,)] = p * q
        probs = grown
    return probs


def _chi_square(counts: Counter, probs: dict[tuple, float], n: int) -> tuple[float, int]:
    """Pearson statistic with every cell of expected count < 5 pooled into one; returns (statistic, dof)."""
    big = [c for c in probs if probs[c] * n >= 5]
    observed = [counts[c] for c in big] + [n - sum(counts[c] for c in big)]
    expected = [probs[c] * n for c in big] + [n * (1.0 - sum(probs[c] for c in big))]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    return stat, len(big)


def _chi_square_critical(dof: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square(dof) by the Wilson-Hilferty approximation (z = 3.09)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def test_sampled_ddtree_matches_autoregressive_distribution():
    cfg = dataclasses.replace(preset_config("tiny"), vocab_size=VOCAB)
    model = ReferenceModel(cfg, random_tensors(cfg, seed=5))
    draft_cfg = drafter_config_for(cfg, "tiny")
    weights = random_tensors(cfg, seed=5)
    drafter = ReferenceDrafter(draft_cfg, random_drafter_tensors(draft_cfg, seed=6),
                               weights["model.embed_tokens.weight"], weights["lm_head.weight"])
    prompt = [3, 1, 4, 1, 5]
    exact = _exact_ar_distribution(model, prompt, TEMPERATURE)
    assert math.isclose(sum(exact.values()), 1.0, rel_tol=1e-9)

    runs = 1500
    counts: Counter = Counter()
    lengths: Counter = Counter()
    for seed in range(runs):
        # Budget 3 leaves most of the vocabulary out of depth 1 (frequent rejections); budget 12 > VOCAB covers
        # depth 1 entirely and reaches deeper (deep accepts). Both have the same output distribution.
        result = generate(model, drafter, prompt, SAMPLED_TOKENS, method="ddtree", budget=(3, 12)[seed % 2],
                          temperature=TEMPERATURE, seed=seed)
        counts[tuple(result.tokens)] += 1
        lengths.update(result.accept_lengths)
    print(f"acceptance lengths over {runs} runs: {dict(sorted(lengths.items()))}")
    assert lengths[1] and sum(v for k, v in lengths.items() if k >= 3), "rejections and deep accepts both occur"

    stat, dof = _chi_square(counts, exact, runs)
    print(f"chi-square {stat:.1f} on {dof} dof, 0.1% critical value {_chi_square_critical(dof):.1f}")
    assert dof >= 20
    assert stat < _chi_square_critical(dof)
    # The same samples do reject a nearby wrong distribution: the test has power.
    wrong = _exact_ar_distribution(model, prompt, TEMPERATURE * 1.4)
    wrong_stat, wrong_dof = _chi_square(counts, wrong, runs)
    assert wrong_stat > _chi_square_critical(wrong_dof)
    assert all(set(seq) <= set(range(VOCAB)) for seq in itertools.islice(counts, 10))


def test_commit_rows_agrees_with_the_model_cache_compaction(tiny):
    model, _ = tiny
    cache = model.new_cache()
    model.forward(np.arange(3, 9), np.arange(6), cache)
    model.forward(np.arange(20, 30), 6 + np.array([0, 1, 1, 2, 2, 3, 3, 3, 4, 5]), cache,
                  visible=np.tril(np.ones((10, 10), dtype=bool)))
    accepted = np.array([0, 2, 4, 7])
    expected = [(layer.latent.copy(), layer.k_rope.copy()) for layer in cache.layers]
    for latent, k_rope in expected:
        assert commit_rows(latent, 6, accepted) == commit_rows(k_rope, 6, accepted) == 10
    cache.compact(6, accepted)
    assert cache.length == 10
    for layer, (latent, k_rope) in zip(cache.layers, expected):
        assert np.array_equal(layer.latent, latent[:10]) and np.array_equal(layer.k_rope, k_rope[:10])
