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


def test_ddtree_generate_reaches_the_runtime() -> None:
    """Engine.generate(method="ddtree") up to the runtime's generate_ddtree (a stand-in: no GPU), fixed budget and
    budget="auto": the keyword arguments get through."""
    from types import SimpleNamespace

    from ddtree.engine import Engine

    calls = []

    def generate_ddtree(prompts, n, temperature, seed, budget, stop_ids, profile, **kwargs):
        calls.append((budget, kwargs))
        return {"tokens": [[5] * n for _ in prompts], "accept_lengths": [[2] * n for _ in prompts],
                "prefill_seconds": 0.0, "decode_seconds": 1.0, "stages": [], "budgets": [budget] * n,
                "cost_streams": [1] if kwargs.get("auto_budgets") and n > 1 else [],
                "cost_seconds": [[1.0] * len(kwargs["auto_budgets"])] if kwargs.get("auto_budgets") and n > 1 else []}

    engine = object.__new__(Engine)
    engine.model_dir, engine.streams, engine.max_context, engine.budget = None, 2, 64, 16
    engine.config = SimpleNamespace(vocab_size=100, eos_token_ids=())
    engine.drafter_config = SimpleNamespace(block_size=8)
    engine._native = SimpleNamespace(generate_ddtree=generate_ddtree)
    fixed = engine.generate([[1, 2], [3]], 4, budget=8)
    assert [r.tokens for r in fixed] == [[5] * 4] * 2 and fixed[0].budgets == [8] * 4
    auto = engine.generate([[1, 2], [3]], 4, budget="auto")
    assert calls == [(8, {"auto_budgets": []}), (16, {"auto_budgets": [8, 16]})]
    assert auto[0].budgets == [16] * 4 and engine.last_costs.streams == (1,)
    engine.generate([[1, 2], [3]], 1, budget="auto")  # one new token: no round, no round times (runtime: none)
    assert engine.last_costs is None
