"""DFlash block-diffusion drafter: config.json parsing, safetensors checkpoint reading/writing, random drafters.

The format is the z-lab DFlash one: a Qwen3-style config (``architectures: ["DFlashDraftModel"]``) whose
``dflash_config`` object carries ``target_layer_ids`` and ``mask_token_id`` (``block_size`` may sit there or at
the top level), and tensors named ``layers.{i}.*``, ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``.
The drafter has no embedding or LM head of its own: it uses the target's. RoPE is plain or YaRN (``rope_scaling``
or, as transformers 5 writes it, ``rope_parameters``), as the z-lab/Kimi-K2.5-DFlash drafter uses it. Every
unsupported option is rejected with the field named, so a drafter is never run under assumptions it does not meet.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ddtree import bf16
from ddtree.checkpoint import Checkpoint, TensorSpec, write_tensor_dir
from ddtree.config import Fields, ModelConfig, RopeConfig, read_config_json, yarn_mscale
from ddtree.errors import ConfigError

# What a YaRN rope_scaling object may hold ("rope_theta" only in the rope_parameters form); anything else is
# rejected by name rather than ignored.
YARN_FIELDS = ("rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
               "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")


@dataclass(frozen=True, slots=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig  # over the whole head_dim, rotate-half layout; its mscale fields set no amplitude here
    rope_attention_factor: float  # the cos/sin amplitude (_parse_rope says why it is not the target's rule)
    max_position_embeddings: int
    block_size: int
    mask_token_id: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]

    @property
    def context_width(self) -> int:
        """Width of the concatenated tapped target hidden states that ``fc`` projects."""
        return len(self.target_layer_ids) * self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        """The config.json this config was (or would be) read from."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": None if self.rope.kind != "yarn" else {
                "rope_type": "yarn", "factor": self.rope.factor,
                "original_max_position_embeddings": self.rope.original_max_position_embeddings,
                "beta_fast": self.rope.beta_fast, "beta_slow": self.rope.beta_slow, "mscale": self.rope.mscale,
                "mscale_all_dim": self.rope.mscale_all_dim, "attention_factor": self.rope_attention_factor},
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "torch_dtype": "bfloat16",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
        }


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default taps: the middle layer for one draft layer, else evenly from layer 1 to n_target - 3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


def parse_drafter_config(raw: Any, where: str = "config.json", target: ModelConfig | None = None) -> DrafterConfig:
    """Validate a DFlash drafter config dict (against its target when given) and return the frozen config."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a JSON object")
    f = Fields(raw, where)
    arch = raw.get("architectures")
    if arch is not None and arch != ["DFlashDraftModel"]:
        raise f.fail("architectures", f"is {arch!r}; ddtree supports ['DFlashDraftModel']")
    dflash = raw.get("dflash_config", {})
    if not isinstance(dflash, dict):
        raise f.fail("dflash_config", "must be an object")
    d = Fields(dflash, f"{where}: dflash_config")
    for key, allowed in (("hidden_act", ("silu",)), ("attention_bias", (False,)), ("use_sliding_window", (False,)),
                         ("input_embedding_scale", (1, 1.0)), ("output_multiplier", (1, 1.0)),
                         ("final_logit_softcapping", (None, 0, 0.0))):
        f.reject_unless(key, allowed)
    d.reject_unless("sample_from_anchor", (False,))
    f.reject_unless("partial_rotary_factor", (1, 1.0))

    hidden = f.positive("hidden_size")
    layers = f.positive("num_hidden_layers")
    heads = f.positive("num_attention_heads")
    kv_heads = f.positive("num_key_value_heads", heads)
    if heads % kv_heads:
        raise f.fail("num_key_value_heads", f"is {kv_heads}; it must divide num_attention_heads ({heads})")
    head_dim = f.positive("head_dim", hidden // heads if hidden % heads == 0 else ...)
    if head_dim % 2:
        raise f.fail("head_dim", f"must be even for RoPE, got {head_dim}")
    layer_types = raw.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != layers
                                    or any(t != "full_attention" for t in layer_types)):
        raise f.fail("layer_types", f"must list {layers} x 'full_attention' (no sliding window), "
                                    f"got {layer_types!r}")
    eps = f.get("rms_norm_eps", float, 1e-6)
    if not 0 < eps < 1:
        raise f.fail("rms_norm_eps", f"must be in (0, 1), got {eps}")
    rope, rope_attention_factor = _parse_rope(f)
    vocab = f.positive("vocab_size")

    # DFlash reads these from dflash_config first, then from the top level.
    block_size = d.get("block_size", int, f.get("block_size", int, 16))
    if block_size < 2:
        raise f.fail("block_size", f"must be at least 2 (bonus + one drafted token), got {block_size}")
    mask_fields = d if "mask_token_id" in dflash else f
    mask_token = mask_fields.get("mask_token_id", int)
    if not 0 <= mask_token < vocab:
        raise mask_fields.fail("mask_token_id", f"must be in [0, vocab_size={vocab}), got {mask_token}")
    n_target = f.positive("num_target_layers", target.num_hidden_layers if target else ...)
    ids_raw = dflash.get("target_layer_ids")
    if ids_raw is None:
        ids = default_target_layer_ids(n_target, layers)
    elif not isinstance(ids_raw, list) or not ids_raw or \
            any(isinstance(i, bool) or not isinstance(i, int) for i in ids_raw):
        raise d.fail("target_layer_ids", f"must be a non-empty list of integers, got {ids_raw!r}")
    else:
        ids = tuple(ids_raw)
    # HF's hidden_states[n_target] is the final-normed output, not the last layer's: only earlier layers tap.
    if any(not 0 <= i < n_target - 1 for i in ids) or len(set(ids)) != len(ids):
        raise d.fail("target_layer_ids", f"must be distinct layers in [0, {n_target - 1}) "
                                         f"(num_target_layers {n_target}), got {list(ids)}")

    if target is not None:
        checks = (("hidden_size", hidden, target.hidden_size), ("vocab_size", vocab, target.vocab_size),
                  ("num_target_layers", n_target, target.num_hidden_layers))
        for key, mine, theirs in checks:
            if mine != theirs:
                raise f.fail(key, f"is {mine} but the target model's is {theirs}")
    return DrafterConfig(
        hidden_size=hidden, intermediate_size=f.positive("intermediate_size"), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
        rms_norm_eps=eps, rope=rope, rope_attention_factor=rope_attention_factor,
        max_position_embeddings=f.positive("max_position_embeddings", 1 << 17),
        block_size=block_size, mask_token_id=mask_token, num_target_layers=n_target, target_layer_ids=ids,
    )


def _parse_rope(f: Fields) -> tuple[RopeConfig, float]:
    """The drafter's RoPE and its cos/sin amplitude, from ``rope_scaling`` (transformers 4) or, when that is
    absent, ``rope_parameters`` (transformers 5, which also carries rope_theta): plain, or YaRN with its
    frequencies computed as transformers computes them (floored/ceiled correction range).

    The YaRN amplitude is the config's ``attention_factor`` when it sets one, else 0.1 ln(factor) + 1 (about
    1.416 at factor 64) whatever ``mscale`` and ``mscale_all_dim`` say. Not the target's rule (their ratio,
    1.0 when both are 1; reference/rope.py): a drafter must run with the amplitude it was trained and measured
    with, and for DFlash drafters that is the plain-YaRN rule of the serving stacks, which ignore the mscale
    fields. The published Kimi-K2.5-DFlash acceptance lengths were measured on SGLang; vLLM-Ascend pins
    0.1 ln(64) + 1 for exactly this config because honouring the mscale ratio (vLLM #56446) lowered acceptance.
    transformers' Qwen3 rotary, which z-lab's reference code calls, applies the ratio and gives 1.0 here. A
    config whose two mscale fields differ (both set) is rejected: there the rules disagree beyond this case.
    The softmax scale stays head_dim^-0.5 either way (Qwen3 attention has no YaRN correction of its own)."""
    key, scaling = "rope_scaling", f.data.get("rope_scaling")
    if scaling is None and isinstance(f.data.get("rope_parameters"), dict):
        key, scaling = "rope_parameters", f.data["rope_parameters"]
    if scaling is not None and not isinstance(scaling, dict):
        raise f.fail(key, f"must be an object, got {scaling!r}")
    s = Fields(scaling or {}, f"{f.where}: {key}")
    theta_fields = s if "rope_theta" in s.data else f
    theta = theta_fields.get("rope_theta", float, 10000.0)
    if theta <= 0:
        raise theta_fields.fail("rope_theta", f"must be positive, got {theta}")
    kind_key = "rope_type" if "rope_type" in s.data else "type"
    kind = s.data.get(kind_key, "default")
    if "type" in s.data and s.data["type"] != kind:  # older configs spell it `type`, some write both
        raise s.fail("type", f"is {s.data['type']!r} but rope_type is {kind!r}")
    if kind not in ("default", "yarn"):
        raise s.fail(kind_key, f"is {kind!r}; ddtree's drafter supports 'default' and 'yarn'")
    allowed = YARN_FIELDS if kind == "yarn" else ("rope_type", "type", "rope_theta")
    for name in s.data:
        if name not in allowed:
            raise s.fail(name, f"is not a parameter of {kind!r} RoPE that ddtree's drafter implements")
    if kind == "default":
        return RopeConfig(theta), 1.0
    s.reject_unless("truncate", (True,))
    factor = s.get("factor", float)
    if factor < 1.0:
        raise s.fail("factor", f"must be >= 1, got {factor}")
    betas = {name: s.get(name, float, default) for name, default in (("beta_fast", 32.0), ("beta_slow", 1.0))}
    for name, value in betas.items():
        if value <= 0:
            raise s.fail(name, f"must be positive, got {value}")
    mscale, mscale_all_dim = s.get("mscale", float, 1.0), s.get("mscale_all_dim", float, 0.0)
    if mscale and mscale_all_dim and mscale != mscale_all_dim:
        raise s.fail("mscale_all_dim", f"is {mscale_all_dim} and mscale {mscale}; ddtree's drafter runs YaRN "
                                       "with the plain amplitude, which only equal (or absent) values leave "
                                       "unambiguous")
    attention_factor = s.get("attention_factor", float, yarn_mscale(factor, 1.0))
    if attention_factor <= 0:
        raise s.fail("attention_factor", f"must be positive, got {attention_factor}")
    rope = RopeConfig(theta, "yarn", factor, s.positive("original_max_position_embeddings"), betas["beta_fast"],
                      betas["beta_slow"], mscale, mscale_all_dim)
    return rope, attention_factor


def load_drafter_config(drafter_dir: str | Path, target: ModelConfig | None = None) -> DrafterConfig:
    raw, path = read_config_json(drafter_dir)
    return parse_drafter_config(raw, where=str(path), target=target)


def drafter_tensor_specs(cfg: DrafterConfig) -> dict[str, TensorSpec]:
    """Every tensor a DFlash drafter checkpoint must hold (all bf16)."""
    return dict(iter_drafter_tensors(cfg))


def iter_drafter_tensors(cfg: DrafterConfig) -> Iterator[tuple[str, TensorSpec]]:
    """drafter_tensor_specs one by one, lazily (a checkpoint's validation stops at the first missing one)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q_dim, kv_dim = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd

    def bf(*shape: int) -> TensorSpec:
        return TensorSpec(("BF16",), shape)

    yield from {"fc.weight": bf(h, cfg.context_width), "hidden_norm.weight": bf(h), "norm.weight": bf(h)}.items()
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}"
        yield from {
            f"{p}.input_layernorm.weight": bf(h),
            f"{p}.post_attention_layernorm.weight": bf(h),
            f"{p}.self_attn.q_proj.weight": bf(q_dim, h),
            f"{p}.self_attn.k_proj.weight": bf(kv_dim, h),
            f"{p}.self_attn.v_proj.weight": bf(kv_dim, h),
            f"{p}.self_attn.o_proj.weight": bf(h, q_dim),
            f"{p}.self_attn.q_norm.weight": bf(hd),
            f"{p}.self_attn.k_norm.weight": bf(hd),
            f"{p}.mlp.gate_proj.weight": bf(cfg.intermediate_size, h),
            f"{p}.mlp.up_proj.weight": bf(cfg.intermediate_size, h),
            f"{p}.mlp.down_proj.weight": bf(h, cfg.intermediate_size),
        }.items()


def open_drafter(drafter_dir: str | Path, target: ModelConfig | None = None) -> tuple[DrafterConfig, Checkpoint]:
    """Read and validate the drafter's config.json (against the target when given) and its tensors."""
    cfg = load_drafter_config(drafter_dir, target)
    return cfg, Checkpoint(drafter_dir, cfg, iter_drafter_tensors(cfg))  # type: ignore[arg-type]


def write_drafter(drafter_dir: str | Path, cfg: DrafterConfig, tensors: Mapping[str, np.ndarray],
                  config_json: Mapping[str, Any] | None = None) -> None:
    """Write config.json, one bf16 safetensors shard per layer (plus one for fc/norms) and the index.
    ``config_json`` (default ``cfg.to_dict()``) is written as given, e.g. a published config replicated field
    for field; it must parse to ``cfg``."""
    if config_json is None:
        config_json = cfg.to_dict()
    elif parse_drafter_config(dict(config_json)) != cfg:
        raise ValueError("config_json does not describe the drafter config it is written with")
    specs = drafter_tensor_specs(cfg)
    shards = [[n for n in specs if not n.startswith("layers.")]]
    shards += [[n for n in specs if n.startswith(f"layers.{i}.")] for i in range(cfg.num_hidden_layers)]
    write_tensor_dir(drafter_dir, config_json, specs, tensors, shards)


@dataclass(frozen=True, slots=True)
class DrafterPreset:
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int = 16


# Named after the target presets they go with (ddtree.presets). `k2-layers`: a K2-sized drafter, 5 layers at
# hidden 7168, about 1.6 B parameters with fc (the published Qwen3-8B drafter has 1.05 B at hidden 4096).
DRAFTER_PRESETS = {
    "tiny": DrafterPreset(2, 4, 2, 16, 128, block_size=8),
    "small": DrafterPreset(3, 8, 2, 64, 2048),
    "k2-layers": DrafterPreset(5, 32, 8, 128, 9216),
}


def drafter_config_for(target: ModelConfig, preset: str) -> DrafterConfig:
    if preset not in DRAFTER_PRESETS:
        raise ValueError(f"unknown drafter preset {preset!r}; choose one of {', '.join(DRAFTER_PRESETS)}")
    p = DRAFTER_PRESETS[preset]
    n_target = target.num_hidden_layers
    if n_target < 2:
        raise ValueError(f"a drafter needs a target of at least 2 layers to tap, got {n_target}")
    ids = default_target_layer_ids(n_target, p.num_hidden_layers)
    if any(not 0 <= i < n_target - 1 for i in ids) or any(b <= a for a, b in itertools.pairwise(ids)):
        # Shallow targets: spread the taps over every layer but the last (whose HF output is final-normed).
        taps = min(p.num_hidden_layers, n_target - 1)
        ids = tuple(sorted({round(i * (n_target - 2) / max(taps - 1, 1)) for i in range(taps)}))
    return DrafterConfig(
        hidden_size=target.hidden_size, intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers, num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads, head_dim=p.head_dim, vocab_size=target.vocab_size,
        rms_norm_eps=target.rms_norm_eps, rope=RopeConfig(target.rope.theta), rope_attention_factor=1.0,
        max_position_embeddings=target.max_position_embeddings, block_size=p.block_size,
        mask_token_id=target.vocab_size - 1, num_target_layers=n_target, target_layer_ids=ids,
    )


def make_drafter(target: ModelConfig, out_dir: str | Path, seed: int, preset: str) -> DrafterConfig:
    """Write a seeded random DFlash drafter matching `target` (same hidden size and vocabulary)."""
    cfg = drafter_config_for(target, preset)
    write_drafter(out_dir, cfg, random_drafter_tensors(cfg, seed))
    return cfg


def random_drafter_tensors(cfg: DrafterConfig, seed: int) -> Mapping[str, np.ndarray]:
    """Seeded random bf16 tensors of a drafter, each made when first asked for (tensor i draws from (seed, i))."""
    return _RandomTensors(drafter_tensor_specs(cfg), seed)


class _RandomTensors(Mapping[str, np.ndarray]):
    """Seeded random bf16 tensors made on demand, so a K2-sized drafter is written one shard at a time."""

    def __init__(self, specs: Mapping[str, TensorSpec], seed: int) -> None:
        self._specs = dict(specs)
        self._index = {name: i for i, name in enumerate(self._specs)}
        self._seed = seed

    def __getitem__(self, name: str) -> np.ndarray:
        shape = self._specs[name].shape
        rng = np.random.default_rng([self._seed, self._index[name]])
        if len(shape) == 1:  # RMSNorm gains around 1
            values = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        else:  # fan-in scaled so activations keep their scale through the stack
            values = rng.standard_normal(shape, dtype=np.float32) * np.float32(shape[1] ** -0.5)
        return bf16.from_float32(values)

    def __iter__(self):
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)
