"""Generation requests on the reference: every bad request is refused before any forward runs, with the argument
named, and the good requests around it get exactly the tokens they get alone; non-finite logits raise."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from ddtree.checkpoint import Checkpoint, open_checkpoint
from ddtree.drafter import drafter_config_for, random_drafter_tensors
from ddtree.errors import NonFiniteError, RequestError, check_token_ids
from ddtree.limits import MAX_TREE_BUDGET, positions_needed, reference_verify_bytes
from ddtree.reference import ReferenceModel, generate
from ddtree.reference.drafter import ReferenceDrafter
from ddtree.request import ArgumentNames, check_request, check_seed

GOOD = ([1, 17, 300, 5], [7, 7, 200], [42])
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[ReferenceModel, ReferenceDrafter]:
    """The tiny target from disk and its drafter in memory (random tiny-preset weights)."""
    model = ReferenceModel.load(tiny_model_dir)
    cfg = drafter_config_for(model.config, "tiny")
    return model, ReferenceDrafter(cfg, random_drafter_tensors(cfg, seed=1), model.embedding_table(), model.lm_head())


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir: Path) -> Checkpoint:
    return open_checkpoint(tiny_model_dir)


@pytest.fixture(scope="module")
def alone(tiny, tiny_model_dir: Path) -> dict[tuple[str, int], list[int]]:
    """Each good request's tokens from a fresh model, before any bad request was seen."""
    _, drafter = tiny
    fresh = ReferenceModel.load(tiny_model_dir)
    return {(method, i): generate(fresh, drafter, prompt, NEW_TOKENS, method=method).tokens
            for method in ("ar", "ddtree") for i, prompt in enumerate(GOOD)}


BAD_REQUESTS = [
    ({"prompt_ids": [1, 10**6]}, "prompt_ids: token id 1000000 at position 1 is outside the vocabulary"),
    ({"prompt_ids": [1, 2**70]}, "token id 1180591620717411303424 at position 1"),
    ({"prompt_ids": [[1, 2], [3]]}, "prompt_ids: token ids must be a flat sequence"),
    ({"prompt_ids": [True]}, "token ids must be integers"),
    ({"prompt_ids": []}, "non-empty"),
    ({"prompt_ids": [1] * 1000, "max_new_tokens": 30}, "prompt_ids \\(1000 ids\\) and max_new_tokens 30 need 1030 "
                                                      "positions, more than max_position_embeddings 1024"),
    ({"max_new_tokens": -1}, "max_new_tokens must be a non-negative integer"),
    ({"max_new_tokens": 2.0}, "max_new_tokens"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "0.7"}, "temperature"),
    ({"seed": -1}, "seed must be an integer in \\[0, 2\\*\\*64\\), got -1"),
    ({"seed": 2**64}, "seed"),
    ({"method": "beam"}, "method must be one of 'ar', 'ddtree'"),
    ({"method": "ar", "budget": 4}, "budget applies to method 'ddtree' only"),
    ({"method": "ddtree", "budget": MAX_TREE_BUDGET + 1}, "budget 1025 is more than the maximum tree budget 1024"),
    ({"method": "ddtree", "budget": -2}, "budget must be a non-negative integer"),
    ({"method": "ddtree", "budget": 10**400}, "is more than the maximum tree budget 1024: one round would verify"),
    ({"method": "ddtree", "prompt_ids": [1] * 1000, "max_new_tokens": 20},
     "need 1026 positions \\(6 of them for the last draft block of block_size 8\\)"),
    ({"method": "ddtree", "drafter": None}, "method 'ddtree' needs a drafter"),
    ({"stop_token_ids": [2, 10**6]}, "stop_token_ids: token id 1000000 at position 1"),
    ({"stop_token_ids": ["2"]}, "stop_token_ids: token ids must be integers"),
]


@pytest.mark.parametrize("change,message", BAD_REQUESTS)
def test_bad_request_is_refused_before_any_forward(tiny, alone, change, message, monkeypatch) -> None:
    model, drafter = tiny
    request = {"drafter": drafter, "prompt_ids": GOOD[0], "max_new_tokens": NEW_TOKENS, "method": "ar", **change}
    calls = []
    with monkeypatch.context() as patch:
        patch.setattr(model, "forward", lambda *a, **k: calls.append(a))
        patch.setattr(drafter, "draft", lambda *a, **k: calls.append(a))
        with pytest.raises(RequestError, match=message):
            generate(model, request.pop("drafter"), request.pop("prompt_ids"), request.pop("max_new_tokens"),
                     **request)
    assert calls == [], "the request ran before it was refused"
    # The good requests that follow get exactly the tokens they get alone.
    for method in ("ar", "ddtree"):
        for i, prompt in enumerate(GOOD):
            assert generate(model, drafter, prompt, NEW_TOKENS, method=method).tokens == alone[method, i]


def test_budget_message_gives_the_memory_from_the_model_dims(tiny) -> None:
    model, drafter = tiny
    need = reference_verify_bytes(model.config, 100000, len(GOOD[0]) + NEW_TOKENS)
    assert need == 4 * 100001 * (model.config.num_attention_heads * (100001 + 10) + model.config.vocab_size)
    with pytest.raises(RequestError, match=f"at least {need / 2**30:.1f} GiB in the reference backend"):
        generate(model, drafter, GOOD[0], NEW_TOKENS, method="ddtree", budget=100000)
    assert f"{need / 2**30:.1f}" == "149.2"  # what the traceback of the unbounded reference said: 149. GiB


def test_largest_budget_runs(tiny) -> None:
    model, drafter = tiny
    result = generate(model, drafter, GOOD[2], 2, method="ddtree", budget=MAX_TREE_BUDGET)
    assert result.tokens == generate(model, None, GOOD[2], 2).tokens


class PeakedDrafter:
    """The real drafter with its top token at every depth made certain: best-first trees then grow a chain to the
    full depth block_size - 1 before any sibling, so every round reaches as far as a round can."""

    def __init__(self, inner: ReferenceDrafter) -> None:
        self.inner, self.config = inner, inner.config

    def new_cache(self, window=None):
        return self.inner.new_cache(window)

    def draft(self, cache, context, bonus_token, start):
        logits = self.inner.draft(cache, context, bonus_token, start)
        logits[np.arange(logits.shape[0]), logits.argmax(axis=1)] += 100.0
        return logits


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_positions_needed_cover_every_position_used(tiny, checkpoint, method, monkeypatch) -> None:
    """A model of exactly positions_needed runs the request to the end (DDTree's last round reaches the last of
    them); one position fewer is refused up front."""
    model, drafter = tiny
    prompt, new_tokens = GOOD[0], 12
    block = drafter.config.block_size if method == "ddtree" else None
    need = positions_needed(len(prompt), new_tokens, block)
    exact = ReferenceModel(dataclasses.replace(model.config, max_position_embeddings=need), checkpoint)
    used: list[int] = []
    forward = exact.forward
    monkeypatch.setattr(exact, "forward", lambda ids, positions, *a, **k: (
        used.append(int(np.max(positions))), forward(ids, positions, *a, **k))[1])
    peaked = PeakedDrafter(drafter)
    result = generate(exact, peaked, prompt, new_tokens, method=method, budget=None if block is None else 64)
    assert result.tokens == generate(model, None, prompt, new_tokens).tokens
    # Autoregressive decoding never feeds its last token (need - 2); DDTree's last block ends at need - 1.
    assert max(used) == (need - 1 if method == "ddtree" else need - 2)
    short = ReferenceModel(dataclasses.replace(model.config, max_position_embeddings=need - 1), checkpoint)
    with pytest.raises(RequestError, match=f"need {need} positions"):
        generate(short, peaked, prompt, new_tokens, method=method)


def test_drafter_for_another_target_is_named(tiny) -> None:
    model, drafter = tiny
    other = dataclasses.replace(model.config, hidden_size=model.config.hidden_size + 32)
    with pytest.raises(RequestError, match="hidden_size is 64, but hidden_size of the model's config.json is 96"):
        check_request(other, drafter.config, [1], 4, "ddtree")
    fewer = dataclasses.replace(model.config, num_hidden_layers=2)
    with pytest.raises(RequestError, match="num_target_layers is 3, but num_hidden_layers"):
        check_request(fewer, drafter.config, [1], 4, "ddtree")


def test_names_are_the_callers(tiny) -> None:
    model, _ = tiny
    names = ArgumentNames(prompt="--prompt-ids of stream 2", new_tokens="-n", model_config="m/config.json")
    with pytest.raises(RequestError, match="--prompt-ids of stream 2 \\(3 ids\\) and -n 5000 need 5003 positions, "
                                           "more than max_position_embeddings 1024 of m/config.json"):
        check_request(model.config, None, [1, 2, 3], 5000, names=names)
    assert check_seed(2**64 - 1) == 2**64 - 1


def test_token_ids_beyond_64_bits_and_of_numpy_types() -> None:
    assert check_token_ids(np.array([3, 4], dtype=np.uint64), 10).tolist() == [3, 4]
    with pytest.raises(RequestError, match="token id 18446744073709551615 at position 0"):
        check_token_ids(np.array([2**64 - 1], dtype=np.uint64), 10)
    with pytest.raises(RequestError, match="token id -1180591620717411303424 at position 1"):
        check_token_ids([0, -(2**70)], 10)
    with pytest.raises(RequestError, match="must be integers"):
        check_token_ids([1, "2"], 10)


BF16_NAN = 0x7FC0


def _with_nan(weights: dict[str, np.ndarray], suffix: str) -> dict[str, np.ndarray]:
    """The weights with every tensor named ...suffix all NaN (as bf16 bits or float32)."""
    return {name: np.full_like(w, BF16_NAN if w.dtype == np.uint16 else np.nan) if name.endswith(suffix) else w
            for name, w in weights.items()}


def test_nan_norm_weights_raise_naming_the_position(tiny, checkpoint) -> None:
    """All-NaN final norm weights used to decode every token as 0 without a word."""
    model, drafter = tiny
    broken = ReferenceModel(model.config, _with_nan(dict(checkpoint), "model.norm.weight"))
    with pytest.raises(NonFiniteError, match="the target model's logits at position 3 hold nan"):
        generate(broken, None, GOOD[0], NEW_TOKENS)
    with pytest.raises(NonFiniteError, match="the target model's logits at position 3 hold nan"):
        generate(broken, drafter, GOOD[0], NEW_TOKENS, method="ddtree")


def test_nan_in_a_later_position_is_named(tiny, checkpoint) -> None:
    """A NaN embedding row poisons only the positions that read it: the message gives the first one."""
    model, _ = tiny
    weights = dict(checkpoint)
    embed = np.array(weights["model.embed_tokens.weight"])
    prompt = GOOD[0]
    ar = generate(model, None, prompt, 3).tokens
    embed[ar[1]] = BF16_NAN
    weights["model.embed_tokens.weight"] = embed
    broken = ReferenceModel(model.config, weights)
    with pytest.raises(NonFiniteError, match=f"position {len(prompt) + 1} hold nan"):
        generate(broken, None, prompt, 3)


def test_nan_drafter_weights_raise(tiny) -> None:
    model, drafter = tiny
    broken = ReferenceDrafter(drafter.config, _with_nan(dict(drafter.weights), "norm.weight"),
                              model.embedding_table(), model.lm_head())
    with pytest.raises(NonFiniteError, match=f"the drafter's logits at position {len(GOOD[0]) + 1} hold nan"):
        generate(model, broken, GOOD[0], NEW_TOKENS, method="ddtree")
