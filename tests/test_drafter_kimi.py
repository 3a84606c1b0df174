"""The z-lab/Kimi-K2.5-DFlash drafter format: its config parses unmodified, its YaRN (frequencies as transformers
computes them, the plain amplitude 0.1 ln(factor) + 1), and the tiny replica end to end on the reference."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from drafter_replica import KIMI_DFLASH_CONFIG, kimi_dflash_config_json, write_kimi_dflash_replica
from test_drafter import _random_drafter, _torch_draft

from ddtree.config import yarn_mscale
from ddtree.drafter import drafter_tensor_specs, load_drafter_config, open_drafter, parse_drafter_config, write_drafter
from ddtree.presets import preset_config
from ddtree.reference import ReferenceModel, generate
from ddtree.reference.drafter import ReferenceDrafter
from ddtree.reference.rope import Rope

PLAIN_AMPLITUDE_64 = 1.0 + 0.1 * math.log(64.0)  # about 1.4159


def test_published_config_parses_unmodified():
    cfg = parse_drafter_config(json.loads(KIMI_DFLASH_CONFIG.read_text()))
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (6, 7168, 64, 8, 128, 18432, 163840)
    assert (cfg.block_size, cfg.mask_token_id, cfg.num_target_layers) == (8, 163838, 61)
    assert cfg.target_layer_ids == (1, 12, 24, 35, 47, 58)
    assert cfg.max_position_embeddings == 262144
    r = cfg.rope
    assert (r.kind, r.theta, r.factor, r.original_max_position_embeddings) == ("yarn", 50000.0, 64.0, 4096)
    assert (r.beta_fast, r.beta_slow, r.mscale, r.mscale_all_dim) == (32.0, 1.0, 1.0, 1.0)
    params = sum(math.prod(s.shape) for s in drafter_tensor_specs(cfg).values())
    assert 6.4 < params * 2 / 2**30 < 6.6  # the published 6.48 GiB of bf16


def test_published_config_fits_a_k2_target():
    target = preset_config("k2-layers", layers=61)
    assert parse_drafter_config(kimi_dflash_config_json("real"), target=target).num_target_layers == 61


def test_config_round_trips_and_reads_the_transformers5_form():
    raw = kimi_dflash_config_json("real")
    cfg = parse_drafter_config(raw)
    assert parse_drafter_config(json.loads(json.dumps(cfg.to_dict()))) == cfg
    v5 = dict(raw)  # transformers 5 folds rope_theta into rope_parameters and drops rope_scaling
    v5["rope_parameters"] = {**v5.pop("rope_scaling"), "rope_theta": v5.pop("rope_theta")}
    assert parse_drafter_config(v5) == cfg


def test_yarn_amplitude_is_the_plain_rule_not_the_mscale_ratio():
    cfg = parse_drafter_config(kimi_dflash_config_json("real"))
    assert cfg.rope_attention_factor == pytest.approx(PLAIN_AMPLITUDE_64, abs=1e-12)
    assert cfg.rope_attention_factor == yarn_mscale(64.0, 1.0)
    # The target's rule for the very same YaRN parameters is the mscale ratio: 1.0.
    target = preset_config("k2-layers", layers=1)
    assert (target.rope.factor, target.rope.mscale, target.rope.mscale_all_dim) == (64.0, 1.0, 1.0)
    assert Rope.from_config(target).attention_factor == 1.0
    # An explicit attention_factor wins.
    raw = kimi_dflash_config_json("real")
    raw["rope_scaling"]["attention_factor"] = 1.0
    assert parse_drafter_config(raw).rope_attention_factor == 1.0


def test_yarn_frequencies_match_transformers_and_only_the_amplitude_departs():
    """transformers' Qwen3 rotary on the published config: the same frequencies, but amplitude 1.0 (the mscale
    ratio), which is what this drafter must not run with (ddtree.drafter._parse_rope says why)."""
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    from transformers import Qwen3Config

    raw = kimi_dflash_config_json("real")
    fields = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
              "rope_theta", "rope_scaling")
    rotary = qwen3.Qwen3RotaryEmbedding(Qwen3Config(**{k: raw[k] for k in fields}))
    rope = Rope.from_drafter_config(parse_drafter_config(raw))
    np.testing.assert_allclose(rope.inv_freq, rotary.inv_freq.numpy(), rtol=1e-6)
    assert rotary.attention_scaling == 1.0 and rope.attention_factor == pytest.approx(PLAIN_AMPLITUDE_64)


def test_tiny_replica_is_written_with_its_config_verbatim(tmp_path: Path):
    cfg = write_kimi_dflash_replica(tmp_path / "a", seed=3)
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == kimi_dflash_config_json("tiny")
    target = preset_config("tiny")
    assert load_drafter_config(tmp_path / "a", target) == cfg
    assert cfg.rope_attention_factor == pytest.approx(PLAIN_AMPLITUDE_64) and cfg.block_size == 8
    _, ckpt = open_drafter(tmp_path / "a", target)
    write_kimi_dflash_replica(tmp_path / "b", seed=3)
    _, again = open_drafter(tmp_path / "b", target)
    assert all(np.array_equal(ckpt[n], again[n]) for n in ckpt), "same seed, same tensors"


def test_write_drafter_refuses_a_config_json_of_another_drafter(tmp_path: Path):
    cfg = parse_drafter_config(kimi_dflash_config_json("tiny"))
    other = kimi_dflash_config_json("tiny")
    other["rope_scaling"]["attention_factor"] = 1.0
    with pytest.raises(ValueError, match="config_json"):
        write_drafter(tmp_path, cfg, {}, config_json=other)


@pytest.mark.parametrize(("rows", "window"), [(7, None), (4200, 9)])
def test_tiny_replica_forward_matches_torch(rows, window):
    """Against transformers' YaRN rotary and torch SDPA, near position 0 and past the 4096 original positions
    (there with a window, so only the last rows take part)."""
    drafter = _random_drafter(parse_drafter_config(kimi_dflash_config_json("tiny")), seed=1)
    context = np.random.default_rng(2).standard_normal((rows, drafter.config.context_width)).astype(np.float32)
    logits = drafter.draft(drafter.new_cache(window), context, bonus_token=5, start=rows)
    visible = context if window is None else context[-window:]
    np.testing.assert_allclose(logits, _torch_draft(drafter, visible, 5, rows), rtol=2e-4, atol=2e-4)


def test_tiny_replica_ddtree_equals_autoregressive(tiny_model_dir: Path, tmp_path: Path):
    model = ReferenceModel.load(tiny_model_dir)
    write_kimi_dflash_replica(tmp_path, seed=5)
    drafter = ReferenceDrafter.for_model(tmp_path, model)
    prompt = [1, 17, 300, 5, 42, 9, 9, 480]
    expected = generate(model, None, prompt, 20).tokens
    for window in (None, 4):
        result = generate(model, drafter, prompt, 20, method="ddtree", budget=8, draft_window=window)
        assert result.tokens == expected, f"draft_window {window}"
        assert max(result.accept_lengths) <= drafter.config.block_size
