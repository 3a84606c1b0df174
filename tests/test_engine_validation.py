"""Engine request validation and the no-GPU error: everything that needs no device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ddtree
from ddtree.device import has_cuda_device
from ddtree.engine import validate_request
from ddtree.errors import RequestError
from ddtree.presets import make_model


def _check(prompts, max_new_tokens=4, temperature=0.0, streams=2, max_context=16, vocab=100):
    return validate_request(prompts, max_new_tokens, temperature, streams, max_context, vocab)


def test_valid_request_passes_through() -> None:
    assert _check([[1, 2, 3], (99,)]) == [[1, 2, 3], [99]]


@pytest.mark.parametrize("prompts,kwargs,message", [
    ([], {}, "prompts is empty"),
    ([[1], [2], [3]], {}, "3 prompts but the engine was created for 2 streams"),
    ([[1, 100]], {}, "prompt 0: token id 100 at position 1 is outside the vocabulary"),
    ([[1], [-1]], {}, "prompt 1: token id -1 at position 0"),
    ([[]], {}, "prompt 0: token ids must be a non-empty 1-D sequence"),
    ([[1.5]], {}, "prompt 0: token ids must be integers"),
    ([[2**70]], {}, "prompt 0: token id 1180591620717411303424 at position 0 is outside the vocabulary"),
    ([[1] * 13], {}, "13 tokens \\+ 4 new tokens exceed max_context 16"),
    ([[1]], {"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
    ([[1]], {"temperature": -1.0}, "temperature must be finite and >= 0"),
    ([[1]], {"temperature": float("nan")}, "temperature must be finite"),
])
def test_bad_requests_name_the_fault(prompts, kwargs, message) -> None:
    with pytest.raises(RequestError, match=message):
        _check(prompts, **kwargs)


def test_engine_is_exported_lazily() -> None:
    from ddtree.engine import Engine

    assert ddtree.Engine is Engine


@pytest.mark.skipif(has_cuda_device(), reason="checks the error raised when no CUDA device is present")
def test_engine_without_gpu_raises_clearly(tmp_path: Path) -> None:
    make_model("tiny", tmp_path, seed=0)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        ddtree.Engine(tmp_path, streams=1, max_context=32)


def test_engine_rejects_bad_sizes(tmp_path: Path) -> None:
    make_model("tiny", tmp_path, seed=0)
    with pytest.raises(RequestError, match="streams must be a positive integer"):
        ddtree.Engine(tmp_path, streams=0)
    with pytest.raises(RequestError, match="max_context 5000 exceeds the model's max_position_embeddings 1024"):
        ddtree.Engine(tmp_path, streams=1, max_context=5000)
    for budget in (-1, 1025, 2.0, True):
        with pytest.raises(RequestError, match="budget must be an integer in 0..1024"):  # ddtree.limits
            ddtree.Engine(tmp_path, streams=1, max_context=32, budget=budget)


def test_engine_rejects_a_model_without_shared_expert(tmp_path: Path) -> None:
    """The checkpoint's extra tensors do not fail the load; the engine must refuse before it sizes its GEMMs."""
    make_model("tiny", tmp_path, seed=0)
    config = json.loads((tmp_path / "config.json").read_text())
    config["n_shared_experts"] = 0
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(RequestError, match="n_shared_experts is 0; the engine runs MoE layers with exactly one"):
        ddtree.Engine(tmp_path, streams=1, max_context=32)
