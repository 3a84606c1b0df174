"""The DDTree round on the GPU (one captured graph per bucket, replayed): generated tokens equal the engine's own
autoregressive tokens bitwise, greedy and sampled, with draft candidates from the oracle (they hold the
autoregressive continuation at a drawn rank, so paths of every length up to the depth limit are accepted)."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import ddtree  # noqa: E402
from ddtree.presets import preset_config  # noqa: E402
from engine_models import TINY_FUSED, model_config  # noqa: E402

NEW_TOKENS = 64
DEPTH = 7  # the Kimi-K2.5-DFlash drafter's block of 8


@pytest.fixture(autouse=True)
def _release_engines():
    yield
    gc.collect()


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _engine(model: str, model_dirs: dict[str, Path], streams: int, budget: int):
    if model == "k2-layers":
        return ddtree.Engine.random(preset_config("k2-layers", 3), streams, 512, budget=budget, seed=2)
    return ddtree.Engine(model_dirs[model], streams=streams, max_context=512, budget=budget)


def _check_round_equals_ar(engine, vocab: int, streams: int, budget: int, temperature: float, hit: float,
                           seed: int) -> list[list[int]]:
    prompts = _prompts(vocab, [5 + 29 * i for i in range(streams)], seed)
    ar = [r.tokens for r in engine.generate(prompts, NEW_TOKENS, temperature=temperature, seed=seed)]
    tokens, accepts, rounds, _, _ = engine.native.generate_oracle(
        prompts, NEW_TOKENS, temperature, seed, ar, [hit] * DEPTH, seed + 1, budget, DEPTH, min(budget, 8))
    for s in range(streams):
        assert tokens[s] == ar[s], f"stream {s}: first difference at token " \
            f"{next(i for i, (a, b) in enumerate(zip(tokens[s], ar[s])) if a != b)}"
        assert sum(accepts[s]) >= NEW_TOKENS - 1 and all(1 <= a <= DEPTH + 1 for a in accepts[s]), accepts[s]
    assert rounds >= max(len(a) for a in accepts)
    return accepts


@pytest.mark.parametrize("model", ["tiny", "small", TINY_FUSED, "k2-layers"])
@pytest.mark.parametrize("streams", [1, 3, 16])
def test_greedy_round_equals_autoregressive(model: str, streams: int, model_dirs: dict[str, Path]) -> None:
    vocab = preset_config("k2-layers", 3).vocab_size if model == "k2-layers" else model_config(model).vocab_size
    engine = _engine(model, model_dirs, streams, 255)
    for budget in (1, 2, 8, 32, 64, 255):
        accepts = _check_round_equals_ar(engine, vocab, streams, budget, 0.0, 0.9, seed=budget)
        if budget >= 8:
            mean = np.mean([a for stream in accepts for a in stream])
            assert mean >= 4, (budget, mean)
            assert {DEPTH + 1} <= {a for stream in accepts for a in stream}  # whole-depth paths committed


@pytest.mark.parametrize("model", ["tiny", TINY_FUSED])
def test_sampled_round_equals_sampled_autoregressive(model: str, model_dirs: dict[str, Path]) -> None:
    """Gumbel-max noise is keyed by (seed, stream, position) in both: a node on the accepted path draws what AR
    draws at its position."""
    engine = _engine(model, model_dirs, 3, 32)
    for budget in (8, 32):
        _check_round_equals_ar(engine, model_config(model).vocab_size, 3, budget, 0.8, 0.9, seed=7 + budget)


def test_round_with_misses_and_one_token(model_dirs: dict[str, Path]) -> None:
    """A drafter that is never right (one candidate per depth, never the continuation): one token per round, still
    the AR tokens; and a single new token (no round)."""
    engine = _engine("tiny", model_dirs, 2, 8)
    prompts = _prompts(512, [5, 34], 3)
    ar = [r.tokens for r in engine.generate(prompts, NEW_TOKENS)]
    tokens, accepts, rounds, _, _ = engine.native.generate_oracle(prompts, NEW_TOKENS, 0.0, 3, ar, [0.0] * DEPTH, 4,
                                                                  1, DEPTH, 1)
    assert tokens == ar and rounds >= NEW_TOKENS - 1
    assert all(a == 1 for stream in accepts for a in stream)
    prompts = _prompts(512, [4, 9], 1)
    ar = [r.tokens for r in engine.generate(prompts, 1)]
    tokens, accepts, rounds, _, _ = engine.native.generate_oracle(prompts, 1, 0.0, 0, ar, [0.9] * DEPTH, 1, 8,
                                                                  DEPTH, 8)
    assert tokens == ar and rounds == 0


def test_round_refuses_bad_arguments(model_dirs: dict[str, Path]) -> None:
    engine = _engine("tiny", model_dirs, 1, 8)
    native = engine.native
    good = ([[1, 2]], 8, 0.0, 0, [[0] * 8], [0.5] * DEPTH, 1, 8, DEPTH, 4)
    for index, value, message in [(7, 9, "budget must be in 1..8"), (8, 16, "depth_limit"), (9, 9, "width"),
                                  (5, [0.5], "hit"), (5, [float("nan")] * DEPTH, "hit"),
                                  (4, [[0] * 8, [0] * 8], "reference"),
                                  (1, 600, "max_new_tokens")]:
        args = list(good)
        args[index] = value
        with pytest.raises(ValueError, match=message):
            native.generate_oracle(*args)
