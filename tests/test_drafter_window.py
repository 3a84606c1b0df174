"""The drafter's optional context window W: block queries attend to the last W committed rows (at their absolute
positions) and the block; the draft cache never holds more than W rows."""

from __future__ import annotations

import numpy as np
import pytest
from test_drafter import SMALL, _random_drafter

from ddtree.errors import RequestError
from ddtree.presets import preset_config
from ddtree.reference import ReferenceModel, generate
from ddtree.reference.drafter import DraftCache, ReferenceDrafter

ROUNDS = (5, 1, 3, 4, 2)  # committed rows per draft call, as prefill then DDTree rounds deliver them
BONUS = (3, 9, 11, 0, 30)


def _context(rows: int) -> np.ndarray:
    return np.random.default_rng(7).standard_normal((rows, SMALL.context_width)).astype(np.float32)


def _rounds(drafter: ReferenceDrafter, cache: DraftCache, context: np.ndarray) -> list[np.ndarray]:
    logits, start = [], 0
    for rows, bonus in zip(ROUNDS, BONUS, strict=True):
        logits.append(drafter.draft(cache, context[start:start + rows], bonus, start + rows))
        start += rows
    return logits


def _last_rows_only(drafter: ReferenceDrafter, context: np.ndarray, window: int, bonus: int) -> np.ndarray:
    """An unbounded drafter run whose context is just the last `window` rows, at their absolute positions."""
    start = context.shape[0]
    seen = min(window, start)
    cache = drafter.new_cache()
    cache.length = start - seen  # the rows before these were never appended
    return drafter.draft(cache, context[start - seen:], bonus, start)


def test_window_covering_the_context_changes_nothing():
    drafter = _random_drafter(SMALL, seed=11)
    context = _context(sum(ROUNDS))
    unbounded = _rounds(drafter, drafter.new_cache(), context)
    for window in (sum(ROUNDS), sum(ROUNDS) + 40):
        for a, b in zip(_rounds(drafter, drafter.new_cache(window), context), unbounded, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("window", [1, 3, 6])
def test_window_sees_the_last_rows_at_their_absolute_positions(window):
    drafter = _random_drafter(SMALL, seed=12)
    context = _context(sum(ROUNDS))
    cache = drafter.new_cache(window)
    start = 0
    for rows, bonus, logits in zip(ROUNDS, BONUS, _rounds(drafter, cache, context), strict=True):
        start += rows
        np.testing.assert_allclose(logits, _last_rows_only(drafter, context[:start], window, bonus),
                                   rtol=1e-5, atol=1e-5)
    assert cache.length == start
    assert all(k.shape[0] == window for k in cache.keys + cache.values), "the cache is bounded by the window"


def test_window_differs_from_unbounded_when_rows_fall_out():
    drafter = _random_drafter(SMALL, seed=13)
    context = _context(sum(ROUNDS))
    windowed = _rounds(drafter, drafter.new_cache(2), context)[-1]
    assert not np.allclose(windowed, _rounds(drafter, drafter.new_cache(), context)[-1], atol=1e-3)


@pytest.mark.parametrize("window", [0, -3, True, 2.5, "8"])
def test_bad_window_is_rejected(window):
    drafter = _random_drafter(SMALL, seed=14)
    with pytest.raises(ValueError, match="window"):
        drafter.new_cache(window)


def test_ddtree_with_a_window_stays_lossless(tiny_model_dir, tmp_path):
    from ddtree.drafter import make_drafter

    model = ReferenceModel.load(tiny_model_dir)
    make_drafter(preset_config("tiny"), tmp_path, seed=1, preset="tiny")
    drafter = ReferenceDrafter.for_model(tmp_path, model)
    prompt, new = [1, 17, 300, 5, 42, 7, 7, 200, 11], 20
    expected = generate(model, None, prompt, new).tokens
    unbounded = generate(model, drafter, prompt, new, method="ddtree", budget=8)
    covering = generate(model, drafter, prompt, new, method="ddtree", budget=8, draft_window=len(prompt) + new)
    assert covering.accept_lengths == unbounded.accept_lengths and covering.tokens == expected
    assert generate(model, drafter, prompt, new, method="ddtree", budget=8, draft_window=3).tokens == expected
    with pytest.raises(RequestError, match="draft_window"):
        generate(model, drafter, prompt, new, method="ddtree", draft_window=0)
