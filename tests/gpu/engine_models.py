"""Models the GPU engine tests share: the presets and variants they run on, and the numpy reference run on the
engine's own expert choices."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from ddtree.checkpoint import write_checkpoint
from ddtree.config import ModelConfig
from ddtree.presets import make_model, preset_config, random_tensors
from ddtree.reference import model as reference_model_module
from ddtree.reference.layers import linear, sigmoid
from ddtree.reference.mla import KVCache
from ddtree.reference.model import ForwardOutput, ReferenceModel
from ddtree.reference.moe import Routing, route

# Biased router scores of the reference closer than this are a tie at the engine's precision: its router sees
# bf16 activations that drift a few percent from the fp32 reference over the layers (measured on `small`:
# median logit error 3e-2 of the row's max), which moves sigmoid scores by ~5e-3.
# Largest reference biased-score gap at which the engine may pick another expert: its activations carry bf16
# roundings taken in another summation order through several layers; 2e-2 is five bf16 ulps of a score in
# [0.5, 1). (At 1e-2 a change of the dense GEMMs' order alone flipped one choice on `small`, gap 1.04e-2.)
ROUTER_TIE = 2e-2


# `tiny` with hidden and moe_intermediate sizes that are multiples of 128: its routed experts load into the fused
# INT4 MoE (repacked at upload), where tiny's and small's take the plain INT4 path.
TINY_FUSED = "tiny-fused"
# `tiny` with room for contexts past 4096 keys, where attention chunks grow from 512 to 1024 keys.
TINY_LONG = "tiny-long"


def model_config(model: str) -> ModelConfig:
    if model == TINY_FUSED:
        return dataclasses.replace(preset_config("tiny"), hidden_size=128, moe_intermediate_size=128)
    if model == TINY_LONG:
        return dataclasses.replace(preset_config("tiny"), max_position_embeddings=16384)
    return preset_config(model)


def make_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for preset in ("tiny", "small"):
        out = tmp_path_factory.mktemp(preset)
        make_model(preset, out, seed=0)
        dirs[preset] = out
    for variant in (TINY_FUSED, TINY_LONG):
        dirs[variant] = tmp_path_factory.mktemp(variant)
        write_checkpoint(dirs[variant], model_config(variant), random_tensors(model_config(variant), seed=0))
    return dirs


def reference_on_engine_routing(reference: ReferenceModel, seq: list[int], engine_routing: np.ndarray,
                                monkeypatch: pytest.MonkeyPatch, positions: np.ndarray | None = None,
                                cache: KVCache | None = None, visible: np.ndarray | None = None,
                                hidden_layers: tuple[int, ...] = ()) -> tuple[ForwardOutput, list[str]]:
    """The reference forward of seq (at `positions`, default 0.., after `cache`, with `visible` as in
    ReferenceModel.forward) with each MoE layer using the experts the engine chose (their weights are the
    reference's own normalised scores), and every place where the engine's choice differs from the reference's own
    by more than a rounding-level near-tie of the biased scores."""
    calls = iter(range(engine_routing.shape[0]))
    far_from_tie: list[str] = []

    def engine_route(x, gate, bias, cfg):
        layer = next(calls)
        own = route(x, gate, bias, cfg)
        scores = sigmoid(linear(x, gate))
        biased = scores + bias
        chosen = engine_routing[layer].astype(np.int64)
        for row in np.flatnonzero(np.any(np.sort(chosen, 1) != np.sort(own.experts, 1), axis=1)):
            dropped = np.setdiff1d(own.experts[row], chosen[row])
            taken = np.setdiff1d(chosen[row], own.experts[row])
            gap = float(biased[row, dropped].max() - biased[row, taken].min())
            if gap > ROUTER_TIE:
                far_from_tie.append(f"moe layer {layer} row {row}: engine took {taken.tolist()} over "
                                    f"{dropped.tolist()}, biased-score gap {gap:.1e}")
        weights = np.take_along_axis(scores, chosen, axis=-1)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(1e-20))
        return Routing(chosen, (weights * np.float32(cfg.routed_scaling_factor)).astype(np.float32))

    monkeypatch.setattr(reference_model_module, "route", engine_route)
    out = reference.forward(seq, np.arange(len(seq)) if positions is None else positions,
                            reference.new_cache() if cache is None else cache, visible, hidden_layers)
    monkeypatch.undo()
    return out, far_from_tie


