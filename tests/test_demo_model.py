"""The built-in demo pair (ddtree/demo, trained by tools/train_demo.py): installed with the package, read by the
ordinary loaders, and generating code as text on the reference backend, with greedy DDTree emitting the greedy
autoregressive tokens and its trained drafter accepting several tokens per round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ddtree
from ddtree import cli
from ddtree.checkpoint import open_checkpoint
from ddtree.drafter import open_drafter
from ddtree.reference import ReferenceModel, generate
from ddtree.reference.drafter import ReferenceDrafter

PROMPT = "def fibonacci(n):"
SHIPPED_LIMIT_BYTES = 16 << 20


@pytest.fixture(scope="module")
def pair() -> tuple[ReferenceModel, ReferenceDrafter]:
    model = ReferenceModel.load(cli.DEFAULT_MODEL_DIR)
    return model, ReferenceDrafter.for_model(cli.DEFAULT_MODEL_DIR / cli.DRAFTER_SUBDIR, model)


def test_the_pair_is_package_data_in_the_real_formats() -> None:
    assert cli.DEFAULT_MODEL_DIR.parent == Path(ddtree.__file__).resolve().parent
    files = [f for f in cli.DEFAULT_MODEL_DIR.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= SHIPPED_LIMIT_BYTES
    checkpoint = open_checkpoint(cli.DEFAULT_MODEL_DIR)
    cfg = checkpoint.config
    assert cfg.rope.kind == "yarn" and cfg.first_k_dense_replace == 1 and cfg.n_shared_experts == 1
    assert checkpoint.dtype_of("model.layers.1.mlp.experts.0.gate_proj.weight_packed") == "I32"
    drafter_cfg, _ = open_drafter(cli.DEFAULT_MODEL_DIR / cli.DRAFTER_SUBDIR, cfg)
    assert (cli.DEFAULT_MODEL_DIR / "tokenizer.json").is_file() and drafter_cfg.block_size == 16


def test_greedy_ddtree_emits_the_autoregressive_text(pair: tuple[ReferenceModel, ReferenceDrafter]) -> None:
    model, drafter = pair
    ar = generate(model, None, PROMPT, 48)
    assert ar.text is not None and ar.text.strip()
    for budget in (15, 32):
        tree = generate(model, drafter, PROMPT, 48, method="ddtree", budget=budget)
        assert tree.tokens == ar.tokens and tree.text == ar.text
        # a trained drafter: the random drafters of make-model accept about one token per round
        assert sum(tree.accept_lengths) / len(tree.accept_lengths) > 2


def test_generate_without_model_runs_the_pair_as_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "--prompt", PROMPT, "-n", "24", "--method", "ddtree", "--budget", "16",
                     "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    [stream] = result["streams"]
    assert result["backend"] == "reference" and stream["prompt"] == PROMPT and stream["text"].strip()
    assert len(stream["accept_lengths"]) < len(stream["tokens"])  # more than one token per round
