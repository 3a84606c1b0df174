"""Bad requests among good ones: each is refused with an error naming what is wrong before anything runs, and the
engine then serves the next good requests exactly as before (autoregressive and DDTree, greedy and sampled). Non-finite
weights: the generation raises, naming the stream and position, instead of decoding NaN as a token."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import ddtree  # noqa: E402
from ddtree.drafter import make_drafter  # noqa: E402
from ddtree.errors import NonFiniteError, RequestError  # noqa: E402
from engine_models import model_config  # noqa: E402

MAX_CONTEXT = 96



@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("drafter-bad-requests")
    make_drafter(model_config("tiny"), path, seed=3, preset="tiny")
    return path


@pytest.fixture(scope="module")
def engine(model_dirs: dict[str, Path], drafter_dir: Path):
    return ddtree.Engine(model_dirs["tiny"], drafter_dir, streams=3, max_context=MAX_CONTEXT, budget=16)


def _good(engine) -> dict[str, list[list[int]]]:
    prompts = [np.arange(5 + 9 * i).tolist() for i in range(3)]
    out = {}
    for method in ("ar", "ddtree"):
        for temperature in (0.0, 0.8):
            results = engine.generate(prompts, 24, temperature=temperature, seed=11, method=method,
                                      stop_token_ids=())
            out[f"{method} T={temperature}"] = [r.tokens for r in results]
    return out


BAD = [
    ({"prompts": [[1, 512]]}, "prompt 0: token id 512"),
    ({"prompts": [[-1]]}, "prompt 0"),
    ({"prompts": [[]]}, "prompt 0"),
    ({"prompts": [[1] * (MAX_CONTEXT - 3)], "max_new_tokens": 8}, "exceed max_context"),
    ({"prompts": [[1]] * 4}, "4 prompts but the engine was created for 3 streams"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"seed": -1}, "seed"),
    ({"method": "beam"}, "method"),
    ({"budget": 17}, "budget"),
    ({"budget": 0}, "budget"),
    ({"stop_token_ids": [512]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids: at most 64"),
]


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_bad_requests_leave_the_engine_serving_good_ones(engine, method: str) -> None:
    before = _good(engine)
    for change, message in BAD:
        request = {"prompts": [[1, 2, 3]], "max_new_tokens": 4, "method": method, **change}
        prompts = request.pop("prompts")
        with pytest.raises(RequestError, match=message):
            engine.generate(prompts, **request)
    assert _good(engine) == before


@pytest.mark.parametrize("method", ["ar", "ddtree"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_raise_naming_stream_and_position(model_dirs: dict[str, Path], drafter_dir: Path,
                                                             method: str, temperature: float) -> None:
    poisoned = ddtree.Engine(model_dirs["tiny"], drafter_dir, streams=3, max_context=MAX_CONTEXT, budget=16)
    hidden = poisoned.config.hidden_size
    poisoned.native.upload("model.norm.weight", np.full(hidden, 0x7FC0, dtype=np.uint16))  # bf16 NaN
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    with pytest.raises(NonFiniteError, match=r"^stream 0: the target's logits at position 2 hold a NaN"):
        poisoned.generate(prompts, 8, temperature=temperature, method=method, stop_token_ids=())
