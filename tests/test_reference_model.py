"""The reference model's own contract: KV cache semantics, incremental decode, bad requests."""

from __future__ import annotations

import numpy as np
import pytest

from ddtree.checkpoint import open_checkpoint
from ddtree.errors import CheckpointError, RequestError
from ddtree.presets import make_model
from ddtree.reference import ReferenceModel

PROMPT = [5, 100, 7, 300, 42, 9, 8, 77]
RTOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_model("tiny", path, seed=1)
    return path


@pytest.fixture(scope="module")
def model(model_dir):
    return ReferenceModel.load(model_dir)


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    return float(np.abs(a - b).max()) <= RTOL * float(np.abs(b).max())


def test_token_by_token_equals_prefill(model):
    full = model.forward(PROMPT, np.arange(len(PROMPT)), model.new_cache(), hidden_layers=[0, 2])
    cache = model.new_cache()
    for t, token in enumerate(PROMPT):
        step = model.forward([token], [t], cache, hidden_layers=[0, 2])
        assert _close(step.logits[0], full.logits[t])
        assert _close(step.hidden[2][0], full.hidden[2][t])
    assert cache.length == len(PROMPT)
    assert cache.layers[1].latent.shape == (len(PROMPT), model.config.kv_lora_rank)
    assert cache.layers[1].k_rope.shape == (len(PROMPT), model.config.qk_rope_head_dim)


def test_truncate_then_refeed_gives_the_same_logits(model):
    cache = model.new_cache()
    first = model.forward(PROMPT, np.arange(len(PROMPT)), cache).logits
    cache.truncate(5)
    again = model.forward(PROMPT[5:], np.arange(5, len(PROMPT)), cache).logits
    assert _close(again, first[5:])


def test_compact_keeps_an_accepted_tree_path_like_a_plain_decode(model):
    """Verify a tree [root, a, b, child-of-b], accept root -> b -> child: after compact the cache equals the
    cache of decoding root, b, child one after another, so the next token's logits agree."""
    prefix, root, a, b, child, nxt = PROMPT[:4], 11, 12, 13, 14, 15
    cache = model.new_cache()
    model.forward(prefix, np.arange(4), cache)
    visible = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=bool)
    model.forward([root, a, b, child], [4, 5, 5, 6], cache, visible=visible)
    cache.compact(4, [0, 2, 3])
    assert cache.length == 7

    plain = model.new_cache()
    model.forward(prefix + [root, b, child], np.arange(7), plain)
    for ours, ref in zip(cache.layers, plain.layers):
        assert _close(ours.latent, ref.latent) and _close(ours.k_rope, ref.k_rope)
    assert _close(model.forward([nxt], [7], cache).logits, model.forward([nxt], [7], plain).logits)


def test_compact_reads_all_rows_before_writing(model):
    cache = model.new_cache()
    model.forward(PROMPT, np.arange(len(PROMPT)), cache)
    before = cache.layers[0].latent.copy()
    cache.compact(2, [3, 0, 1])  # row 2+0 is read after row 2+0 is written in a naive in-place loop
    assert np.array_equal(cache.layers[0].latent, before[[0, 1, 5, 2, 3]])


def test_greedy_generate_matches_argmax_of_forward(model):
    tokens = model.greedy_generate(PROMPT, 4)
    assert len(tokens) == 4 and model.greedy_generate(PROMPT, 0) == []
    logits = model.forward(PROMPT + tokens[:3], np.arange(len(PROMPT) + 3), model.new_cache()).logits
    assert tokens == [int(i) for i in np.argmax(logits[len(PROMPT) - 1:], axis=-1)]


def test_bad_requests_name_the_culprit(model):
    with pytest.raises(RequestError, match="token id 512 at position 2"):
        model.greedy_generate([1, 2, 512], 4)
    with pytest.raises(RequestError, match="token id -1 at position 0"):
        model.forward([-1], [0], model.new_cache())
    with pytest.raises(RequestError, match="integers"):
        model.forward([1.5], [0], model.new_cache())
    with pytest.raises(RequestError, match="positions"):
        model.forward([1, 2], [0], model.new_cache())
    with pytest.raises(RequestError, match="position -3 at index 1"):
        model.forward([1, 2], [0, -3], model.new_cache())
    with pytest.raises(RequestError, match="visible"):
        model.forward([1, 2], [0, 1], model.new_cache(), visible=np.ones((3, 3), bool))
    with pytest.raises(RequestError, match=r"visible\[1, 1\]"):
        model.forward([1, 2], [0, 1], model.new_cache(), visible=np.array([[True, False], [True, False]]))
    with pytest.raises(RequestError, match="hidden_layers entry 3"):
        model.forward([1], [0], model.new_cache(), hidden_layers=[3])
    with pytest.raises(RequestError, match="max_new_tokens"):
        model.greedy_generate([1], -1)
    cache = model.new_cache()
    model.forward([1, 2, 3], [0, 1, 2], cache)
    with pytest.raises(RequestError, match="keep"):
        cache.compact(1, [0, 2])
    with pytest.raises(RequestError, match="truncate"):
        cache.truncate(4)


def test_weights_missing_a_tensor_are_named(model_dir):
    checkpoint = open_checkpoint(model_dir)
    weights = dict(checkpoint)
    del weights["model.layers.1.mlp.experts.3.up_proj.weight_scale"]
    with pytest.raises(CheckpointError, match="experts.3.up_proj.weight_scale"):
        ReferenceModel(checkpoint.config, weights)
    weights = dict(checkpoint)
    weights["model.norm.weight"] = weights["model.norm.weight"][:-1]
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        ReferenceModel(checkpoint.config, weights)
