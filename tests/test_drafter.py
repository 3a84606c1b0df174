"""DFlash drafter: config parsing, checkpoint round trip, and the numpy forward against a torch/transformers one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from ddtree import bf16
from ddtree.config import RopeConfig, load_config
from ddtree.drafter import (
    DrafterConfig,
    default_target_layer_ids,
    drafter_config_for,
    drafter_tensor_specs,
    load_drafter_config,
    make_drafter,
    open_drafter,
    parse_drafter_config,
)
from ddtree.errors import CheckpointError, ConfigError
from ddtree.reference.drafter import ReferenceDrafter, draft_top_k


def qwen3_8b_dflash_config() -> dict:
    """The z-lab Qwen3-8B-DFlash-b16 drafter config (published values)."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "max_position_embeddings": 40960, "hidden_act": "silu", "attention_bias": False, "block_size": 16,
        "num_target_layers": 36, "tie_word_embeddings": False,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    }


SMALL = DrafterConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=37, rms_norm_eps=1e-6, rope=RopeConfig(10000.0),
                      rope_attention_factor=1.0, max_position_embeddings=4096, block_size=6, mask_token_id=36,
                      num_target_layers=5, target_layer_ids=(1, 3))


def test_real_zlab_config_parses():
    cfg = parse_drafter_config(qwen3_8b_dflash_config())
    assert cfg.block_size == 16 and cfg.mask_token_id == 151669 and cfg.target_layer_ids == (1, 9, 17, 25, 33)
    assert cfg.context_width == 5 * 4096
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    params = sum(int(np.prod(s.shape)) for s in drafter_tensor_specs(cfg).values())
    assert 0.9e9 < params < 1.2e9  # about 1.05 B, as published


def test_config_round_trip():
    assert parse_drafter_config(json.loads(json.dumps(SMALL.to_dict()))) == SMALL


@pytest.mark.parametrize(("edit", "field"), [
    (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda c: c["dflash_config"].update(mask_token_id=10**7), "mask_token_id"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 35]), "target_layer_ids"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 1]), "target_layer_ids"),
    (lambda c: c["dflash_config"].update(target_layer_ids="1,2"), "target_layer_ids"),
    (lambda c: c.update(architectures=["DFlash2DraftModel"]), "architectures"),
    (lambda c: c.update(num_key_value_heads=5), "num_key_value_heads"),
    (lambda c: c.update(block_size=1), "block_size"),
    (lambda c: c.update(use_sliding_window=True), "use_sliding_window"),
    (lambda c: c.update(layer_types=["sliding_attention"] * 5), "layer_types"),
    (lambda c: c.update(rope_scaling=[64.0]), "rope_scaling"),
    (lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 4.0}), "rope_type"),
    (lambda c: c.update(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}), "rope_type"),
    (lambda c: c.update(rope_scaling={"type": "dynamic", "factor": 4.0}), "type"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "type": "linear", "factor": 4.0,
                                      "original_max_position_embeddings": 4096}), "type"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "original_max_position_embeddings"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "original_max_position_embeddings": 4096}), "factor"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 0.5,
                                      "original_max_position_embeddings": 4096}), "factor"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                                      "beta_fast": 0.0}), "beta_fast"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                                      "mscale": 1.0, "mscale_all_dim": 0.707}), "mscale_all_dim"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                                      "attention_factor": -1.0}), "attention_factor"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                                      "truncate": False}), "truncate"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                                      "low_freq_factor": 1.0}), "low_freq_factor"),
    (lambda c: c.update(rope_scaling={"rope_type": "default", "factor": 4.0}), "factor"),
    (lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": -1.0}), "rope_theta"),
    (lambda c: c.update(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(hidden_size="4096"), "hidden_size"),
    (lambda c: c.pop("intermediate_size"), "intermediate_size"),
    (lambda c: c.update(final_logit_softcapping=30.0), "final_logit_softcapping"),
])
def test_bad_config_names_the_field(edit, field):
    raw = qwen3_8b_dflash_config()
    edit(raw)
    with pytest.raises(ConfigError, match=f"'{field}'"):
        parse_drafter_config(raw)


def test_config_checked_against_target(tiny_model_dir: Path):
    target = load_config(tiny_model_dir)
    raw = drafter_config_for(target, "tiny").to_dict()
    raw["hidden_size"] += 8
    with pytest.raises(ConfigError, match="'hidden_size'.*target"):
        parse_drafter_config(raw, target=target)


def test_make_drafter_round_trip(tiny_model_dir: Path, tmp_path: Path):
    target = load_config(tiny_model_dir)
    cfg = make_drafter(target, tmp_path / "a", seed=3, preset="tiny")
    assert load_drafter_config(tmp_path / "a", target) == cfg
    _, ckpt = open_drafter(tmp_path / "a", target)
    make_drafter(target, tmp_path / "b", seed=3, preset="tiny")
    _, again = open_drafter(tmp_path / "b", target)
    assert all(np.array_equal(ckpt[n], again[n]) for n in ckpt), "same seed, same tensors"
    assert ckpt["fc.weight"].shape == (target.hidden_size, cfg.context_width)
    assert all(i < target.num_hidden_layers - 1 for i in cfg.target_layer_ids)


def test_truncated_drafter_tensor_is_named(tiny_model_dir: Path, tmp_path: Path):
    target = load_config(tiny_model_dir)
    make_drafter(target, tmp_path, seed=0, preset="tiny")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["layers.0.mlp.up_proj.weight"] = index["weight_map"]["fc.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="layers.0.mlp.up_proj.weight"):
        open_drafter(tmp_path, target)


def test_absurd_layer_count_fails_at_the_first_missing_layer(tiny_model_dir: Path, tmp_path: Path):
    """A config counting a billion layers is refused at once, naming the first layer the checkpoint lacks (the
    expected tensors are checked one by one, never listed whole first)."""
    target = load_config(tiny_model_dir)
    cfg = make_drafter(target, tmp_path, seed=0, preset="tiny")
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] = 10**9
    config.pop("layer_types", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"layers.{cfg.num_hidden_layers}.input_layernorm.weight"):
        open_drafter(tmp_path, target)


def test_k2_preset_size(tiny_model_dir: Path):
    k2_shaped = dataclasses.replace(load_config(tiny_model_dir), hidden_size=7168, vocab_size=163840,
                                    num_hidden_layers=61)
    cfg = drafter_config_for(k2_shaped, "k2-layers")
    params = sum(int(np.prod(s.shape)) for s in drafter_tensor_specs(cfg).values())
    assert cfg.num_hidden_layers == 5 and cfg.hidden_size == 7168 and 1e9 < params < 2e9
    assert cfg.target_layer_ids == default_target_layer_ids(61, 5)


def _random_drafter(cfg: DrafterConfig, seed: int) -> ReferenceDrafter:
    rng = np.random.default_rng(seed)
    weights = {}
    for name, spec in drafter_tensor_specs(cfg).items():
        scale = 0.3 if len(spec.shape) == 1 else spec.shape[1] ** -0.5
        base = 1.0 if len(spec.shape) == 1 else 0.0
        weights[name] = bf16.from_float32(base + scale * rng.standard_normal(spec.shape).astype(np.float32))
    table = lambda: bf16.from_float32(rng.standard_normal((cfg.vocab_size, cfg.hidden_size)).astype(np.float32))
    return ReferenceDrafter(cfg, weights, table(), table())


def _torch_draft(drafter: ReferenceDrafter, context: np.ndarray, bonus: int, start: int) -> np.ndarray:
    """DFlash forward with transformers' Qwen3 RMSNorm / rotary (YaRN included) / rotate-half and torch SDPA
    (no cache). The rope_scaling the drafter's config writes states its YaRN amplitude explicitly: left to
    itself transformers would apply the mscale ratio (ddtree.drafter._parse_rope says why the drafter does not)."""
    torch = pytest.importorskip("torch")
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    from transformers import Qwen3Config

    c, w = drafter.config, {k: torch.from_numpy(v) for k, v in drafter.weights.items()}
    hf = Qwen3Config(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                     num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                     max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope.theta,
                     rope_scaling=c.to_dict()["rope_scaling"])

    def norm(x, weight):
        module = qwen3.Qwen3RMSNorm(weight.shape[0], eps=c.rms_norm_eps)
        module.weight.data = weight
        return module(x)

    F = torch.nn.functional
    rotary = qwen3.Qwen3RotaryEmbedding(hf)
    rows = context.shape[0]
    positions = torch.arange(start - rows, start + c.block_size)[None]
    ids = torch.tensor([bonus] + [c.mask_token_id] * (c.block_size - 1))
    with torch.no_grad():
        x = torch.from_numpy(bf16.as_float32(drafter.embed_tokens))[ids][None]
        ctx = norm(F.linear(torch.from_numpy(context)[None], w["fc.weight"]), w["hidden_norm.weight"])
        cos, sin = rotary(x, positions)
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}"
            h = norm(x, w[f"{p}.input_layernorm.weight"])
            q = norm(F.linear(h, w[f"{p}.self_attn.q_proj.weight"]).view(1, c.block_size, -1, c.head_dim),
                     w[f"{p}.self_attn.q_norm.weight"]).transpose(1, 2)
            kv_in = torch.cat([ctx, h], dim=1)
            k = norm(F.linear(kv_in, w[f"{p}.self_attn.k_proj.weight"]).view(1, kv_in.shape[1], -1, c.head_dim),
                     w[f"{p}.self_attn.k_norm.weight"]).transpose(1, 2)
            v = F.linear(kv_in, w[f"{p}.self_attn.v_proj.weight"]).view(1, kv_in.shape[1], -1,
                                                                       c.head_dim).transpose(1, 2)
            q_len = q.shape[2]
            q, _ = qwen3.apply_rotary_pos_emb(q, q, cos[:, -q_len:], sin[:, -q_len:])
            k, _ = qwen3.apply_rotary_pos_emb(k, k, cos, sin)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=True)
            x = x + F.linear(attn.transpose(1, 2).reshape(1, c.block_size, -1), w[f"{p}.self_attn.o_proj.weight"])
            h = norm(x, w[f"{p}.post_attention_layernorm.weight"])
            gate = F.silu(F.linear(h, w[f"{p}.mlp.gate_proj.weight"]))
            x = x + F.linear(gate * F.linear(h, w[f"{p}.mlp.up_proj.weight"]), w[f"{p}.mlp.down_proj.weight"])
        out = norm(x[:, 1:], w["norm.weight"])
        return F.linear(out, torch.from_numpy(drafter.lm_head))[0].numpy()


def test_forward_matches_torch_reference():
    drafter = _random_drafter(SMALL, seed=1)
    rng = np.random.default_rng(2)
    context = rng.standard_normal((7, SMALL.context_width)).astype(np.float32)
    logits = drafter.draft(drafter.new_cache(), context, bonus_token=5, start=7)
    assert logits.shape == (SMALL.block_size - 1, SMALL.vocab_size) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, _torch_draft(drafter, context, 5, 7), rtol=2e-4, atol=2e-4)


def test_cache_keeps_only_committed_context():
    drafter = _random_drafter(SMALL, seed=4)
    rng = np.random.default_rng(5)
    context = rng.standard_normal((11, SMALL.context_width)).astype(np.float32)
    split = drafter.new_cache()
    drafter.draft(split, context[:6], bonus_token=3, start=6)
    assert split.length == 6 and all(k.shape[0] == 6 for k in split.keys), "no block rows cached"
    stepped = drafter.draft(split, context[6:], bonus_token=9, start=11)
    whole = drafter.draft(drafter.new_cache(), context, bonus_token=9, start=11)
    np.testing.assert_allclose(stepped, whole, rtol=1e-5, atol=1e-5)
    assert split.length == 11


def test_draft_rejects_bad_input():
    drafter = _random_drafter(SMALL, seed=6)
    cache = drafter.new_cache()
    with pytest.raises(ValueError, match="context"):
        drafter.draft(cache, np.zeros((2, 5), np.float32), 1, 2)
    with pytest.raises(ValueError, match="position 5"):
        drafter.draft(cache, np.zeros((2, SMALL.context_width), np.float32), 1, 5)
    with pytest.raises(ValueError, match="bonus_token"):
        drafter.draft(cache, np.zeros((2, SMALL.context_width), np.float32), SMALL.vocab_size, 2)
    weights = dict(drafter.weights)
    weights.pop("fc.weight")
    with pytest.raises(ValueError, match="fc.weight"):
        ReferenceDrafter(SMALL, weights, drafter.embed_tokens, drafter.lm_head)


def test_draft_top_k_log_softmax_and_ties():
    logits = np.array([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 5.0]], dtype=np.float32)
    log_probs, ids = draft_top_k(logits, 3)
    assert ids.tolist() == [[1, 2, 0], [3, 0, 1]]
    expected = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(log_probs, np.take_along_axis(expected, ids, axis=1), atol=1e-6)
    assert draft_top_k(logits, 99)[0].shape == (2, 4)
