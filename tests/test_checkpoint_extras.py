"""Tensors a checkpoint holds beyond what its config.json describes: refused when the config counts fewer layers or
experts than the checkpoint, expected when they are multi-token-prediction layers or (in multimodal checkpoints)
outside the text model, one warning naming them otherwise."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import pytest

from ddtree.checkpoint import Checkpoint, TensorSpec, expected_tensors, write_tensor_dir
from ddtree.config import ModelConfig
from ddtree.errors import CheckpointError, CheckpointWarning
from ddtree.presets import preset_config, random_tensors

TINY = preset_config("tiny")


def _write(out: Path, cfg: ModelConfig, extras: dict[str, np.ndarray]) -> Path:
    """A checkpoint of `cfg`'s tensors plus `extras`, in one shard."""
    tensors = {**random_tensors(cfg, seed=0), **extras}
    specs = {name: TensorSpec(("",), array.shape) for name, array in tensors.items()}
    write_tensor_dir(out, cfg.to_dict(), specs, tensors, [list(tensors)])
    return out


def _open(model_dir: Path, cfg: ModelConfig) -> tuple[Checkpoint, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint = Checkpoint(model_dir, cfg)
    return checkpoint, [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]


def test_config_with_fewer_layers_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    model = _write(tmp_path, TINY, {})
    with pytest.raises(CheckpointError, match="tensor 'model.layers.2.input_layernorm.weight' is beyond what .*"
                                              "config.json counts"):
        Checkpoint(model, dataclasses.replace(TINY, num_hidden_layers=2))


def test_config_with_fewer_experts_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    extra = {f"model.layers.1.mlp.experts.8.up_proj.{field}": random_tensors(TINY, seed=0)[
        f"model.layers.1.mlp.experts.0.up_proj.{field}"] for field in ("weight_packed", "weight_scale")}
    with pytest.raises(CheckpointError, match="tensor 'model.layers.1.mlp.experts.8.up_proj.weight_packed' is "
                                              "beyond what"):
        Checkpoint(_write(tmp_path, TINY, extra), TINY)


def test_multi_token_prediction_layers_are_expected(tmp_path: Path) -> None:
    """DeepSeek-V3 stores its MTP module as layer num_hidden_layers (61) and declares num_nextn_predict_layers 1."""
    mtp = {"model.layers.3.eh_proj.weight": np.zeros((64, 128), np.uint16),
           "model.layers.3.input_layernorm.weight": np.zeros(64, np.uint16)}
    model = _write(tmp_path, TINY, mtp)
    checkpoint, warned = _open(model, dataclasses.replace(TINY, num_nextn_predict_layers=1))
    assert warned == [] and set(checkpoint) == set(expected_tensors(TINY))
    with pytest.raises(CheckpointError, match="model.layers.3.input_layernorm.weight"):
        Checkpoint(model, TINY)  # without the declaration, layer 3 is a layer the config does not count


def test_multimodal_tensors_outside_the_text_model_are_expected(tmp_path: Path) -> None:
    cfg = dataclasses.replace(TINY, weight_prefix="language_model.")
    model = _write(tmp_path, cfg, {"vision_tower.patch_embed.weight": np.zeros((4, 4), np.float32)})
    checkpoint, warned = _open(model, cfg)
    assert warned == [] and "language_model.model.norm.weight" in checkpoint


def test_unknown_tensors_give_one_warning_naming_them(tmp_path: Path) -> None:
    unknown = {f"model.rotary_emb.{i}.inv_freq": np.zeros(8, np.float32) for i in range(5)}
    checkpoint, warned = _open(_write(tmp_path, TINY, unknown), TINY)
    assert set(checkpoint) == set(expected_tensors(TINY))
    assert warned == [f"{tmp_path}: ignoring 5 tensor(s) this model does not use: 'model.rotary_emb.0.inv_freq', "
                      f"'model.rotary_emb.1.inv_freq', 'model.rotary_emb.2.inv_freq' and 2 more"]
