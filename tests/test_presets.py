"""Synthetic checkpoints: valid in the real format, INT4 exact to the absmax/7 recipe, not degenerate."""

from __future__ import annotations

import numpy as np
import pytest

from ddtree import bf16
from ddtree.checkpoint import expected_tensors, open_checkpoint
from ddtree.config import parse_config
from ddtree.errors import ConfigError
from ddtree.presets import PRESETS, _ExpertSampler, make_model, preset_config, random_tensors
from ddtree.reference import ReferenceModel, int4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_model("tiny", path, seed=0)
    return path


def test_tiny_checkpoint_opens_and_round_trips_its_config(tiny_dir):
    checkpoint = open_checkpoint(tiny_dir)
    cfg = preset_config("tiny")
    assert checkpoint.config == cfg
    assert parse_config(cfg.to_dict()) == cfg
    assert set(checkpoint) == set(expected_tensors(cfg))
    assert checkpoint.dtype_of("model.layers.1.mlp.gate.e_score_correction_bias") == "F32"
    assert checkpoint.dtype_of("model.layers.1.mlp.experts.0.up_proj.weight_packed") == "I32"
    assert checkpoint.dtype_of("lm_head.weight") == "BF16"


def test_tiny_has_every_mechanism():
    cfg = preset_config("tiny")
    assert cfg.first_k_dense_replace == 1 < cfg.num_hidden_layers
    assert cfg.num_experts_per_tok < cfg.n_routed_experts and cfg.n_shared_experts == 1
    assert cfg.rope.kind == "yarn" and cfg.rope.mscale != cfg.rope.mscale_all_dim
    assert 256 <= cfg.vocab_size <= 1024


def test_same_seed_same_bytes_other_seed_differs(tiny_dir, tmp_path):
    make_model("tiny", tmp_path / "again", seed=0)
    make_model("tiny", tmp_path / "other", seed=1)
    a, b, c = (open_checkpoint(p) for p in (tiny_dir, tmp_path / "again", tmp_path / "other"))
    name = "model.layers.2.mlp.experts.5.down_proj.weight_packed"
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert not np.array_equal(a[name], c[name])


def test_int4_round_trip_equals_quantization_of_source_floats():
    rng = np.random.default_rng(7)
    w = bf16.round_float32(rng.standard_normal((24, 96), dtype=np.float32))
    w[3, 32:64] = 0.0  # an all-zero group
    tensors = int4.quantize_linear(w, 32)
    assert tensors["weight_packed"].dtype == np.int32 and tensors["weight_packed"].shape == (24, 12)
    assert tensors["weight_scale"].dtype == np.uint16 and tensors["weight_scale"].shape == (24, 3)
    assert tensors["weight_shape"].tolist() == [24, 96]

    # Quantization done independently here: scale = bf16(absmax / 7), q = clip(round(w / scale), -8, 7).
    groups = w.reshape(24, 3, 32)
    absmax = np.abs(groups).max(axis=-1)
    scale = bf16.round_float32(np.where(absmax > 0, absmax / 7, 1).astype(np.float32))
    q = np.clip(np.rint(groups / scale[..., None]), -8, 7)
    assert np.array_equal(bf16.to_float32(tensors["weight_scale"]), scale)
    assert np.array_equal(int4.unpack(tensors["weight_packed"]), q.reshape(24, 96))
    assert np.array_equal(int4.dequantize(tensors["weight_packed"], tensors["weight_scale"]),
                          (q * scale[..., None]).reshape(24, 96).astype(np.float32))
    assert np.abs(q).max() == 7  # absmax/7: the largest weight of each group lands on +-7


def test_pack_layout_is_lsb_first_with_offset_8():
    codes = np.array([[-8, -7, 0, 1, 2, 3, 6, 7]], dtype=np.int8)
    word = int(int4.pack(codes).view(np.uint32)[0, 0])
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [0, 1, 8, 9, 10, 11, 14, 15]


def test_tiny_expert_dequantizes_close_to_a_gaussian_linear(tiny_dir):
    checkpoint = open_checkpoint(tiny_dir)
    cfg = checkpoint.config
    prefix = "model.layers.1.mlp.experts.2.gate_proj"
    w = int4.dequantize(checkpoint[f"{prefix}.weight_packed"], checkpoint[f"{prefix}.weight_scale"])
    assert w.shape == (cfg.moe_intermediate_size, cfg.hidden_size)
    assert 0.8 < w.std() * np.sqrt(cfg.hidden_size) < 1.2


def test_sampled_experts_follow_exact_quantization():
    """The k2-layers shortcut: every sampled group is one exactly quantized group of the pool."""
    sampler = _ExpertSampler(256, np.random.default_rng(0))
    drawn = sampler.sample(np.random.default_rng(1), 64)
    codes = int4.unpack(drawn["weight_packed"]).reshape(64, 8, 32)
    assert drawn["weight_scale"].shape == (64, 8)
    assert np.array_equal(np.abs(codes).max(axis=-1), np.full((64, 8), 7))
    pool = {(int(s), bytes(wd)) for s, wd in zip(sampler.scales, sampler.words.view(np.uint8).reshape(-1, 16))}
    words = drawn["weight_packed"].reshape(64, 8, 4)
    assert all((int(drawn["weight_scale"][r, g]), bytes(words[r, g].view(np.uint8))) in pool
               for r in range(64) for g in range(8))


@pytest.mark.parametrize("prompt", ([1, 2, 3], [400, 7, 99, 12, 250], [0]))
def test_tiny_greedy_continuation_is_not_degenerate(tiny_dir, prompt):
    tokens = ReferenceModel.load(tiny_dir).greedy_generate(prompt, 32)
    assert len(tokens) == 32
    assert len(set(tokens)) >= 16, tokens


def test_tiny_activations_stay_well_conditioned(tiny_dir):
    model = ReferenceModel.load(tiny_dir)
    layers = range(model.config.num_hidden_layers)
    out = model.forward(np.arange(40) * 11 % 512, np.arange(40), model.new_cache(), hidden_layers=layers)
    rms = [float(np.sqrt(np.mean(out.hidden[i] ** 2))) for i in layers]
    assert all(0.5 < r < 5 for r in rms), rms
    assert 0.5 < out.logits.std() < 3


def test_small_preset_is_a_few_hundred_mb_and_well_conditioned():
    cfg = preset_config("small")
    size = sum(np.prod(s.shape) * (4 if s.dtypes[0] in ("I32", "F32") else 2)
               for s in expected_tensors(cfg).values())
    assert 150e6 < size < 600e6
    # Its tensors as make_model writes them (without the disk; 3 of its 6 layers to keep CI fast): activations
    # stay well-conditioned and greedy decoding stays varied.
    cfg = preset_config("small", layers=3)
    model = ReferenceModel(cfg, random_tensors(cfg, seed=0))
    out = model.forward([1, 2, 3, 4], np.arange(4), model.new_cache(), hidden_layers=range(3))
    assert all(0.5 < np.sqrt(np.mean(h**2)) < 5 for h in out.hidden.values())
    tokens = model.greedy_generate([1, 2, 3], 12)
    assert len(set(tokens)) >= 9, tokens


def test_k2_layers_has_the_real_k2_dimensions():
    cfg = preset_config("k2-layers", layers=4)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok) == (4, 7168, 384, 8)
    assert (cfg.moe_intermediate_size, cfg.intermediate_size, cfg.num_attention_heads) == (2048, 18432, 64)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank) == (1536, 512)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (128, 64, 128)
    assert (cfg.vocab_size, cfg.first_k_dense_replace, cfg.n_shared_experts) == (163840, 1, 1)
    assert cfg.routed_scaling_factor == 2.827 and cfg.norm_topk_prob
    assert (cfg.rope.kind, cfg.rope.factor, cfg.rope.original_max_position_embeddings) == ("yarn", 64.0, 4096)
    specs = expected_tensors(cfg)
    assert specs["model.layers.1.mlp.experts.383.gate_proj.weight_packed"].shape == (2048, 896)
    assert specs["model.layers.1.mlp.experts.383.gate_proj.weight_scale"].shape == (2048, 224)
    assert specs["model.layers.3.mlp.experts.0.down_proj.weight_packed"].shape == (7168, 256)
    assert specs["model.layers.3.mlp.experts.0.down_proj.weight_scale"].shape == (7168, 64)
    assert specs["model.layers.0.mlp.gate_proj.weight"].shape == (18432, 7168)
    assert "model.layers.0.mlp.experts.0.up_proj.weight_packed" not in specs
    total = sum(np.prod(s.shape) * (4 if s.dtypes[0] in ("I32", "F32") else 2) for s in specs.values())
    assert 30e9 < total < 40e9


def test_unknown_preset_and_missing_layer_count_are_named():
    with pytest.raises(ConfigError, match="'huge'"):
        preset_config("huge")
    with pytest.raises(ConfigError, match="k2-layers"):
        preset_config("k2-layers")
    assert set(PRESETS) == {"tiny", "small", "k2-layers"}

