"""config.json parsing: real K2 values are accepted, and every unsupported or malformed field is named."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from ddtree.config import load_config, parse_config
from ddtree.errors import ConfigError


def k2_config() -> dict[str, Any]:
    """A Kimi-K2 config.json as the official checkpoints ship it (values from their published config)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "n_shared_experts": 1,
        "n_routed_experts": 384,
        "routed_scaling_factor": 2.827,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc",
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 8,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096, "type": "yarn",
        },
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 163584,
        "eos_token_id": 163585,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"type": "int", "num_bits": 4, "group_size": 32, "strategy": "group",
                            "symmetric": True, "dynamic": False, "actorder": None, "observer": "minmax"},
                "input_activations": None, "output_activations": None,
            }},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
        },
    }


def test_k2_config_parses_with_real_values() -> None:
    cfg = parse_config(k2_config())
    assert (cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok) == (7168, 384, 8)
    assert cfg.qk_head_dim == 192 and cfg.rope.kind == "yarn" and cfg.rope.factor == 64.0
    assert cfg.quantization.group_size == 32 and cfg.weight_prefix == ""
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1)
    # qk_head_dim^-0.5 * (0.1 * ln(64) + 1)^2
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * (0.1 * 4.1588830833596715 + 1) ** 2)


def test_round_trip_through_to_dict() -> None:
    cfg = parse_config(k2_config())
    assert parse_config(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_multimodal_text_config_gets_prefix() -> None:
    raw = k2_config()
    quant = raw.pop("quantization_config")
    wrapped = {"model_type": "kimi_k25", "text_config": raw, "quantization_config": quant}
    cfg = parse_config(wrapped)
    assert cfg.weight_prefix == "language_model." and cfg.hidden_size == 7168


def test_transformers_rope_parameters_form() -> None:
    raw = k2_config()
    scaling = raw.pop("rope_scaling")
    raw["rope_parameters"] = {**scaling, "rope_type": "yarn", "rope_theta": raw.pop("rope_theta")}
    del raw["rope_parameters"]["type"]
    cfg = parse_config(raw)
    assert cfg.rope.kind == "yarn" and cfg.rope.theta == 50000.0


def _set(raw: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for p in parents:
        raw = raw[p]
    if value is _DELETE:
        del raw[leaf]
    else:
        raw[leaf] = value


_DELETE = object()


@pytest.mark.parametrize("path,value,named", [
    ("model_type", "llama", "model_type"),
    ("hidden_size", _DELETE, "hidden_size"),
    ("hidden_size", "7168", "hidden_size"),
    ("num_hidden_layers", 0, "num_hidden_layers"),
    ("num_key_value_heads", 8, "num_key_value_heads"),
    ("scoring_func", "softmax", "scoring_func"),
    ("topk_method", "greedy", "topk_method"),
    ("topk_group", 4, "topk_group"),
    ("q_lora_rank", None, "q_lora_rank"),
    ("num_experts_per_tok", 500, "num_experts_per_tok"),
    ("first_k_dense_replace", 99, "first_k_dense_replace"),
    ("rms_norm_eps", 0, "rms_norm_eps"),
    ("qk_rope_head_dim", 63, "qk_rope_head_dim"),
    ("tie_word_embeddings", True, "tie_word_embeddings"),
    ("eos_token_id", "x", "eos_token_id"),
    ("rope_scaling.type", "longrope", "type"),
    ("rope_scaling.factor", 0.5, "factor"),
    ("rope_scaling.original_max_position_embeddings", _DELETE, "original_max_position_embeddings"),
    ("quantization_config", _DELETE, "quantization_config"),
    ("quantization_config.quant_method", "gptq", "quant_method"),
    ("quantization_config.format", "int-quantized", "format"),
    ("quantization_config.config_groups.group_0.weights.num_bits", 8, "num_bits"),
    ("quantization_config.config_groups.group_0.weights.group_size", 128, "group_size"),
    ("quantization_config.config_groups.group_0.weights.symmetric", False, "symmetric"),
    ("quantization_config.config_groups.group_0.weights.strategy", "channel", "strategy"),
    ("quantization_config.config_groups.group_0.weights.actorder", "group", "actorder"),
    ("quantization_config.config_groups.group_0.input_activations", {"num_bits": 8}, "input_activations"),
])
def test_bad_field_is_named(path: str, value: Any, named: str) -> None:
    raw = copy.deepcopy(k2_config())
    _set(raw, path, value)
    with pytest.raises(ConfigError, match=f"'{named}'"):
        parse_config(raw)


def test_load_config_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="config.json: file not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(k2_config()))
    assert load_config(tmp_path).vocab_size == 163840
