"""Seeded random target checkpoints in the real K2 format, from tiny test fixtures to K2-shaped layer stacks.

Weights are drawn so activations stay well-conditioned through any depth: every Linear is N(0, 1/in) (unit-scale
outputs for unit-scale inputs), embeddings N(0, 1), norm weights near 1, router biases small enough to change
only some selections. Routed experts are quantized from random bf16 weights with a per-group absmax/7 scale into
compressed-tensors pack-quantized INT4; everything else is bf16, e_score_correction_bias float32.

The same seed gives the same checkpoint, generated on all cores (see JOB_ELEMENTS).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from ddtree import bf16
from ddtree.checkpoint import STORAGE_DTYPES, expected_tensors, write_checkpoint
from ddtree.config import DEFAULT_QUANT_IGNORE, ModelConfig, QuantConfig, RopeConfig
from ddtree.errors import ConfigError
from ddtree.reference import int4

GROUP_SIZE = 32
NORM_WEIGHT_SPREAD = 0.1  # norm weights 1 + N(0, 0.1^2)
ROUTER_BIAS_STD = 0.05  # comparable to gaps between sigmoid scores: the bias changes some selections
# K2-sized expert stacks (tens of GB) are not quantized float by float; their INT4 groups are drawn from a pool
# of this many groups quantized exactly from random bf16 weights (see _ExpertSampler).
EXPERT_POOL_GROUPS = 1 << 16
# Tensors are generated in blocks of rows of about this many elements, each from its own generator keyed by
# (seed, 1, tensor index, block index): the same seed gives the same bytes whatever the thread count.
JOB_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class _Dims:
    vocab: int
    hidden: int
    intermediate: int
    moe_intermediate: int
    layers: int
    heads: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v: int
    experts: int
    top_k: int
    max_positions: int
    rope_theta: float
    yarn_factor: float
    yarn_original_max: int
    yarn_mscale_all_dim: float
    bos: int
    eos: int


_PRESETS = {
    # A few layers (the first dense), every mechanism exercised: YaRN with a ramp inside the rope dims and an
    # attention factor != 1 (mscale_all_dim != mscale), top-k < experts, a shared expert.
    "tiny": _Dims(vocab=512, hidden=64, intermediate=160, moe_intermediate=32, layers=3, heads=4, q_lora=48,
                  kv_lora=32, nope=16, rope=16, v=16, experts=8, top_k=3, max_positions=1024, rope_theta=10000.0,
                  yarn_factor=4.0, yarn_original_max=256, yarn_mscale_all_dim=0.8, bos=1, eos=2),
    # A few hundred MB with K2's ratios (intermediate 2.57x hidden, moe_intermediate 0.29x, top-8).
    "small": _Dims(vocab=32000, hidden=1024, intermediate=2624, moe_intermediate=288, layers=6, heads=8,
                   q_lora=224, kv_lora=128, nope=64, rope=32, v=64, experts=64, top_k=8, max_positions=65536,
                   rope_theta=50000.0, yarn_factor=16.0, yarn_original_max=4096, yarn_mscale_all_dim=1.0,
                   bos=1, eos=2),
    # Kimi K2's real dimensions; the layer count comes from the caller.
    "k2-layers": _Dims(vocab=163840, hidden=7168, intermediate=18432, moe_intermediate=2048, layers=0, heads=64,
                       q_lora=1536, kv_lora=512, nope=128, rope=64, v=128, experts=384, top_k=8,
                       max_positions=262144, rope_theta=50000.0, yarn_factor=64.0, yarn_original_max=4096,
                       yarn_mscale_all_dim=1.0, bos=163584, eos=163585),
}
PRESETS = tuple(_PRESETS)
K2_ROUTED_SCALING_FACTOR = 2.827


def preset_config(preset: str, layers: int | None = None) -> ModelConfig:
    """The ModelConfig of a preset; `layers` is required for k2-layers and optional for the others."""
    if preset not in _PRESETS:
        raise ConfigError(f"preset {preset!r} is unknown; presets: {', '.join(PRESETS)}")
    d = _PRESETS[preset]
    if layers is None and not d.layers:
        raise ConfigError(f"preset {preset!r} needs a layer count (--layers N)")
    num_layers = d.layers if layers is None else layers
    if num_layers < 1:
        raise ConfigError(f"layers must be >= 1, got {num_layers}")
    return ModelConfig(
        model_type="kimi_k2", vocab_size=d.vocab, hidden_size=d.hidden, intermediate_size=d.intermediate,
        moe_intermediate_size=d.moe_intermediate, num_hidden_layers=num_layers, num_attention_heads=d.heads,
        q_lora_rank=d.q_lora, kv_lora_rank=d.kv_lora, qk_nope_head_dim=d.nope, qk_rope_head_dim=d.rope,
        v_head_dim=d.v, n_routed_experts=d.experts, n_shared_experts=1, num_experts_per_tok=d.top_k,
        routed_scaling_factor=K2_ROUTED_SCALING_FACTOR, norm_topk_prob=True, first_k_dense_replace=1,
        max_position_embeddings=d.max_positions, rms_norm_eps=1e-6,
        rope=RopeConfig(theta=d.rope_theta, kind="yarn", factor=d.yarn_factor,
                        original_max_position_embeddings=d.yarn_original_max, beta_fast=32.0, beta_slow=1.0,
                        mscale=1.0, mscale_all_dim=d.yarn_mscale_all_dim),
        rope_interleave=True,
        quantization=QuantConfig(num_bits=4, group_size=GROUP_SIZE, symmetric=True, ignore=DEFAULT_QUANT_IGNORE),
        bos_token_id=d.bos, eos_token_ids=(d.eos,),
    )


def make_model(preset: str, out_dir: str | Path, seed: int, layers: int | None = None) -> ModelConfig:
    """Write a seeded random checkpoint of `preset` to out_dir and return its config.

    The whole checkpoint is built in memory before it is written (k2-layers: about 8.5 GB per MoE layer).
    """
    cfg = preset_config(preset, layers)
    write_checkpoint(out_dir, cfg, random_tensors(cfg, seed, sample_experts=preset == "k2-layers"))
    return cfg


def random_tensors(cfg: ModelConfig, seed: int, sample_experts: bool = False) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint of cfg, drawn as the module docstring says.

    sample_experts: draw each expert's INT4 groups from a pool of exactly quantized groups instead of
    quantizing every float (same distribution, ~90x faster; for K2-sized stacks).
    """
    samplers = {in_dim: _ExpertSampler(in_dim, np.random.default_rng((seed, 0, in_dim)))
                for in_dim in (cfg.hidden_size, cfg.moe_intermediate_size)} if sample_experts else {}
    tensors: dict[str, np.ndarray] = {}
    jobs: list[tuple[tuple[int, ...], Callable[[np.random.Generator, slice], None], slice]] = []
    for index, (name, spec) in enumerate(expected_tensors(cfg).items()):
        if name.endswith((".weight_scale", ".weight_shape")):
            continue  # made with their weight_packed
        if name.endswith(".weight_packed"):
            base = name.removesuffix(".weight_packed")
            out_dim, in_dim = spec.shape[0], spec.shape[1] * int4.NIBBLES_PER_WORD
            packed = tensors[name] = np.empty(spec.shape, np.int32)
            scale = tensors[f"{base}.weight_scale"] = np.empty((out_dim, in_dim // GROUP_SIZE), np.uint16)
            tensors[f"{base}.weight_shape"] = np.array([out_dim, in_dim], dtype=np.int32)
            fill = partial(_fill_expert_rows, packed, scale, samplers.get(in_dim))
            row_size = in_dim
        else:
            out = tensors[name] = np.empty(spec.shape, STORAGE_DTYPES[spec.dtypes[0]])
            fill = partial(_fill_dense_rows, out, name)
            row_size = math.prod(spec.shape[1:])
        rows_per_job = max(1, JOB_ELEMENTS // row_size)
        for block, first in enumerate(range(0, spec.shape[0], rows_per_job)):
            jobs.append(((seed, 1, index, block), fill, slice(first, min(first + rows_per_job, spec.shape[0]))))

    def run(job: tuple[tuple[int, ...], Callable[[np.random.Generator, slice], None], slice]) -> None:
        key, fill, rows = job
        fill(np.random.default_rng(key), rows)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # numpy fills and ufuncs drop the GIL
        for _ in pool.map(run, jobs):
            pass
    return tensors


def _gaussian(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    values = rng.standard_normal(shape, dtype=np.float32)
    values *= np.float32(std)
    return values


def _fill_dense_rows(out: np.ndarray, name: str, rng: np.random.Generator, rows: slice) -> None:
    shape = (rows.stop - rows.start,) + out.shape[1:]
    if name.endswith("e_score_correction_bias"):
        out[rows] = _gaussian(rng, shape, ROUTER_BIAS_STD)
    elif name.endswith("norm.weight"):  # every RMSNorm: input/post_attention/q_a/kv_a layernorms, final norm
        out[rows] = bf16.from_float32(1.0 + _gaussian(rng, shape, NORM_WEIGHT_SPREAD))
    elif name.endswith("embed_tokens.weight"):
        out[rows] = bf16.from_float32(_gaussian(rng, shape, 1.0))
    else:  # a Linear [out, in]
        out[rows] = bf16.from_float32(_gaussian(rng, shape, out.shape[1] ** -0.5))


def _fill_expert_rows(packed: np.ndarray, scale: np.ndarray, sampler: _ExpertSampler | None,
                      rng: np.random.Generator, rows: slice) -> None:
    in_dim = packed.shape[1] * int4.NIBBLES_PER_WORD
    if sampler is None:
        weight = bf16.round_float32(_gaussian(rng, (rows.stop - rows.start, in_dim), in_dim ** -0.5))
        quantized = int4.quantize_linear(weight, GROUP_SIZE)
    else:
        quantized = sampler.sample(rng, rows.stop - rows.start)
    packed[rows] = quantized["weight_packed"]
    scale[rows] = quantized["weight_scale"]


class _ExpertSampler:
    """Draws INT4 Linears [out, in] group by group from a pool of exactly quantized random groups.

    Quantizing every float of a K2 MoE layer (17G weights) takes about 12 minutes of single-core numpy.
    Instead a pool of EXPERT_POOL_GROUPS groups of 32 N(0, 1/in) bf16 weights is quantized exactly as the
    slow path does (absmax/7 bf16 scale, round, clip, pack); every group of a sampled Linear is an independent
    uniform draw from the pool, so codes and scales follow the empirical distribution of that quantization
    (one code of +-7 per group, the rest spread as 7 w / absmax) and a group's codes stay paired with its scale.
    """

    def __init__(self, in_dim: int, rng: np.random.Generator) -> None:
        weight = bf16.round_float32(_gaussian(rng, (EXPERT_POOL_GROUPS, GROUP_SIZE), in_dim ** -0.5))
        pool = int4.quantize_linear(weight, GROUP_SIZE)
        self.in_dim = in_dim
        self.words = pool["weight_packed"]  # [pool, 32 / 8]
        self.scales = pool["weight_scale"][:, 0]  # [pool]

    def sample(self, rng: np.random.Generator, out_dim: int) -> dict[str, np.ndarray]:
        picks = rng.integers(0, EXPERT_POOL_GROUPS, size=(out_dim, self.in_dim // GROUP_SIZE), dtype=np.int32)
        return {
            "weight_packed": self.words[picks].reshape(out_dim, self.in_dim // int4.NIBBLES_PER_WORD),
            "weight_scale": self.scales[picks],
        }
