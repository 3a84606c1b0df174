"""Model configuration: parse and validate an HF config.json of a DeepSeek-V3 / Kimi-K2 model.

Every value the engine uses is read from config.json; anything unknown or outside what ddtree implements is
rejected with the field named, so a checkpoint is never run under assumptions it does not meet.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree.errors import ConfigError, printable

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
# HF transformers and DeepSeek's code build q_a_layernorm and kv_a_layernorm with the RMSNorm default eps,
# not config.rms_norm_eps.
LORA_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """RoPE parameters; `kind` is "default" or "yarn" (DeepSeek's YaRN with mscale)."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """compressed-tensors pack-quantized INT4 for the routed experts (the only scheme ddtree runs)."""

    num_bits: int
    group_size: int
    symmetric: bool
    ignore: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    rope_interleave: bool
    quantization: QuantConfig
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Prefix of every text-model tensor name: "" for K2, "language_model." for multimodal K2.5+ checkpoints.
    weight_prefix: str = ""
    # Multi-token-prediction layers stored after the decoder layers (DeepSeek-V3 ships one as layer 61); ddtree
    # does not run them, and their tensors are expected in the checkpoint rather than flagged.
    num_nextn_predict_layers: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        """Attention logit scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN."""
        scale = self.qk_head_dim**-0.5
        if self.rope.kind == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def to_dict(self) -> dict[str, Any]:
        """The HF config.json this config was (or would be) read from."""
        rope_scaling: dict[str, Any] | None = None
        if self.rope.kind == "yarn":
            rope_scaling = {
                "type": "yarn",
                "factor": self.rope.factor,
                "original_max_position_embeddings": self.rope.original_max_position_embeddings,
                "beta_fast": self.rope.beta_fast,
                "beta_slow": self.rope.beta_slow,
                "mscale": self.rope.mscale,
                "mscale_all_dim": self.rope.mscale_all_dim,
            }
        q = self.quantization
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": 1,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": rope_scaling,
            "rope_interleave": self.rope_interleave,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": "bfloat16",
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {
                            "type": "int",
                            "num_bits": q.num_bits,
                            "group_size": q.group_size,
                            "strategy": "group",
                            "symmetric": q.symmetric,
                            "dynamic": False,
                            "actorder": None,
                        },
                        "input_activations": None,
                        "output_activations": None,
                    }
                },
                "ignore": list(q.ignore),
            },
        }


# Modules K2 keeps in bf16; everything matching `mlp.experts.*` is INT4.
DEFAULT_QUANT_IGNORE = (
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
)


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN attention-magnitude correction."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


class Fields:
    """Typed access to one JSON object; every error names the field with its path."""

    def __init__(self, data: dict[str, Any], where: str) -> None:
        self.data = data
        self.where = where

    def fail(self, key: str, why: str) -> ConfigError:
        return ConfigError(f"{self.where}: field '{printable(key)}' {why}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        if key not in self.data or self.data[key] is None:
            if default is ...:
                raise self.fail(key, "is missing")
            return default
        value = self.data[key]
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise self.fail(key, f"must be {_kind_name(kind)}, got {value!r}")
        if kind is float and isinstance(value, int):
            value = float(value)
        if not isinstance(value, kind):
            raise self.fail(key, f"must be {_kind_name(kind)}, got {value!r}")
        # Python's json reads NaN, Infinity and overflowing literals such as 1e999; no field may be non-finite.
        if isinstance(value, float) and not math.isfinite(value):
            raise self.fail(key, f"must be a finite number, got {value!r}")
        return value

    def non_negative(self, key: str, default: Any = ...) -> int:
        value = self.get(key, int, default)
        if value < 0:
            raise self.fail(key, f"must be a non-negative integer, got {value}")
        return value

    def positive(self, key: str, default: Any = ...) -> int:
        value = self.get(key, int, default)
        if value <= 0:
            raise self.fail(key, f"must be a positive integer, got {value}")
        return value

    def expect(self, key: str, allowed: tuple[Any, ...], default: Any = ...) -> Any:
        if key not in self.data and default is ...:
            raise self.fail(key, "is missing")
        value = self.data.get(key, default)
        if value not in allowed or type(value) is not type(allowed[0]):
            raise self._unsupported(key, value, allowed)
        return value

    def reject_unless(self, key: str, allowed: tuple[Any, ...]) -> None:
        """A key that may be absent, whose value when present must equal one of `allowed` (1 == 1.0 passes)."""
        if key in self.data and self.data[key] not in allowed:
            raise self._unsupported(key, self.data[key], allowed)

    def _unsupported(self, key: str, value: Any, allowed: tuple[Any, ...]) -> ConfigError:
        return self.fail(key, f"is {value!r}; ddtree supports {', '.join(repr(a) for a in allowed)}")


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "an integer", float: "a number", bool: "a boolean", str: "a string",
                        list: "a list", dict: "an object"}.get(k, k.__name__) for k in kinds)


def _text_config(raw: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Multimodal K2.5+ configs nest the language model under text_config; its tensors carry a prefix."""
    if "text_config" in raw and isinstance(raw["text_config"], dict):
        nested = dict(raw["text_config"])
        if "quantization_config" not in nested and "quantization_config" in raw:
            nested["quantization_config"] = raw["quantization_config"]
        return nested, "language_model."
    return raw, ""


def _parse_rope(f: Fields) -> RopeConfig:
    scaling = f.data.get("rope_scaling")
    params = f.data.get("rope_parameters")
    theta_source = f
    if scaling is None and isinstance(params, dict):
        scaling = params
        theta_source = Fields(params, f"{f.where}: rope_parameters")
    theta = theta_source.get("rope_theta", float, 10000.0)
    if theta <= 0:
        raise theta_source.fail("rope_theta", f"must be positive, got {theta}")
    if scaling is None:
        return RopeConfig(theta=theta)
    if not isinstance(scaling, dict):
        raise f.fail("rope_scaling", "must be an object")
    s = Fields(scaling, f"{f.where}: rope_scaling")
    kind = scaling.get("type", scaling.get("rope_type"))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind != "yarn":
        raise s.fail("type", f"is {kind!r}; ddtree supports 'yarn' and 'default'")
    factor = s.get("factor", float)
    if factor < 1.0:
        raise s.fail("factor", f"must be >= 1, got {factor}")
    return RopeConfig(
        theta=theta,
        kind="yarn",
        factor=factor,
        original_max_position_embeddings=s.positive("original_max_position_embeddings"),
        beta_fast=s.get("beta_fast", float, 32.0),
        beta_slow=s.get("beta_slow", float, 1.0),
        mscale=s.get("mscale", float, 1.0),
        mscale_all_dim=s.get("mscale_all_dim", float, 0.0),
    )


def _parse_quantization(f: Fields) -> QuantConfig:
    raw = f.data.get("quantization_config")
    if raw is None:
        raise f.fail("quantization_config", "is missing: ddtree runs routed experts in INT4 (compressed-tensors)")
    if not isinstance(raw, dict):
        raise f.fail("quantization_config", "must be an object")
    q = Fields(raw, f"{f.where}: quantization_config")
    q.expect("quant_method", ("compressed-tensors",))
    q.expect("format", ("pack-quantized",))
    groups = q.get("config_groups", dict)
    if len(groups) != 1:
        raise q.fail("config_groups", f"has {len(groups)} groups; ddtree supports exactly one")
    name, group = next(iter(groups.items()))
    if not isinstance(group, dict):
        raise q.fail(f"config_groups.{printable(name)}", "must be an object")
    g = Fields(group, f"{q.where}: config_groups.{printable(name)}")
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            raise g.fail(key, "is set; ddtree supports weight-only quantization (W4A16)")
    w = Fields(g.get("weights", dict), f"{g.where}: weights")
    w.expect("type", ("int",))
    w.expect("strategy", ("group",))
    w.expect("num_bits", (4,))
    w.expect("symmetric", (True,))
    if w.data.get("actorder") not in (None, False):
        raise w.fail("actorder", f"is {w.data['actorder']!r}; ddtree supports no activation ordering")
    if w.data.get("dynamic", False):
        raise w.fail("dynamic", "is true; ddtree supports static weight quantization")
    group_size = w.positive("group_size")
    if group_size != 32:
        raise w.fail("group_size", f"is {group_size}; ddtree's INT4 kernels support group 32")
    ignore = q.get("ignore", list, [])
    return QuantConfig(num_bits=4, group_size=group_size, symmetric=True, ignore=tuple(str(i) for i in ignore))


def parse_config(raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Validate an HF config dict and return the frozen ModelConfig."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a JSON object")
    text, prefix = _text_config(raw)
    f = Fields(text, where if not prefix else f"{where}: text_config")
    model_type = f.get("model_type", str, raw.get("model_type"))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise f.fail("model_type", f"is {model_type!r}; ddtree supports {', '.join(SUPPORTED_MODEL_TYPES)}")

    heads = f.positive("num_attention_heads")
    kv_heads = f.get("num_key_value_heads", int, heads)
    if kv_heads != heads:
        raise f.fail("num_key_value_heads", f"is {kv_heads}; MLA needs it equal to num_attention_heads ({heads})")
    f.expect("hidden_act", ("silu",), "silu")
    f.expect("topk_method", ("noaux_tc",), "noaux_tc")
    f.expect("scoring_func", ("sigmoid",), "sigmoid")
    f.expect("moe_layer_freq", (1,), 1)
    f.expect("attention_bias", (False,), False)
    f.expect("tie_word_embeddings", (False,), False)
    n_group = f.get("n_group", int, 1)
    topk_group = f.get("topk_group", int, n_group)
    if topk_group != n_group:
        raise f.fail("topk_group", f"is {topk_group} of n_group {n_group}; ddtree supports ungrouped routing only")
    q_lora = f.get("q_lora_rank", int, None)
    if q_lora is None:
        raise f.fail("q_lora_rank", "is missing or null; ddtree supports the low-rank query projection only")

    layers = f.positive("num_hidden_layers")
    experts = f.positive("n_routed_experts")
    topk = f.positive("num_experts_per_tok")
    if topk > experts:
        raise f.fail("num_experts_per_tok", f"is {topk}, more than n_routed_experts ({experts})")
    first_dense = f.get("first_k_dense_replace", int, 0)
    if not 0 <= first_dense <= layers:
        raise f.fail("first_k_dense_replace", f"must be in [0, num_hidden_layers={layers}], got {first_dense}")
    quant = _parse_quantization(f)
    hidden = f.positive("hidden_size")
    moe_inter = f.positive("moe_intermediate_size")
    for key, value in (("hidden_size", hidden), ("moe_intermediate_size", moe_inter)):
        if value % quant.group_size:
            raise f.fail(key, f"is {value}; INT4 experts need a multiple of group_size {quant.group_size}")
    eps = f.get("rms_norm_eps", float)
    if not 0 < eps < 1:
        raise f.fail("rms_norm_eps", f"must be in (0, 1), got {eps}")
    rope_dim = f.positive("qk_rope_head_dim")
    if rope_dim % 2:
        raise f.fail("qk_rope_head_dim", f"must be even, got {rope_dim}")
    scaling = f.get("routed_scaling_factor", float, 1.0)
    if scaling <= 0:
        raise f.fail("routed_scaling_factor", f"must be positive, got {scaling}")
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_ids):
        raise f.fail("eos_token_id", f"must be an integer or a list of integers, got {eos!r}")

    return ModelConfig(
        model_type=model_type,
        vocab_size=f.positive("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.positive("intermediate_size"),
        moe_intermediate_size=moe_inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        q_lora_rank=q_lora,
        kv_lora_rank=f.positive("kv_lora_rank"),
        qk_nope_head_dim=f.positive("qk_nope_head_dim"),
        qk_rope_head_dim=rope_dim,
        v_head_dim=f.positive("v_head_dim"),
        n_routed_experts=experts,
        n_shared_experts=f.non_negative("n_shared_experts", 0),
        num_experts_per_tok=topk,
        routed_scaling_factor=scaling,
        norm_topk_prob=f.get("norm_topk_prob", bool, True),
        first_k_dense_replace=first_dense,
        max_position_embeddings=f.positive("max_position_embeddings"),
        rms_norm_eps=eps,
        rope=_parse_rope(f),
        rope_interleave=f.get("rope_interleave", bool, True),
        quantization=quant,
        bos_token_id=f.get("bos_token_id", int, None),
        eos_token_ids=eos_ids,
        weight_prefix=prefix,
        num_nextn_predict_layers=f.non_negative("num_nextn_predict_layers", 0),
    )


def read_config_json(model_dir: str | Path) -> tuple[dict[str, Any], Path]:
    """The parsed `model_dir/config.json` and its path; a missing or malformed file raises ConfigError."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"{model_dir}: model directory does not exist")
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    try:
        return json.loads(path.read_text()), path
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read and validate `model_dir/config.json`."""
    raw, path = read_config_json(model_dir)
    return parse_config(raw, where=str(path))
