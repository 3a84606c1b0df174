"""Checkpoint reading: every expected tensor is checked before use, and each defect names its file and tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors

from ddtree.checkpoint import INDEX_FILE, Checkpoint, expected_tensors, open_checkpoint, write_checkpoint
from ddtree.config import load_config
from ddtree.errors import CheckpointError


@pytest.fixture()
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_model_dir, dst)
    return dst


def _weight_map(model_dir: Path) -> dict[str, str]:
    return json.loads((model_dir / INDEX_FILE).read_text())["weight_map"]


def _rewrite_shard(model_dir: Path, shard: str, edit) -> None:
    """Load every tensor of one shard as raw bytes, let `edit` change the dict, write the shard back."""
    path = model_dir / shard
    with open(path, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(header_len))
        data = fh.read()
    header.pop("__metadata__", None)
    tensors = {n: (i["dtype"], i["shape"], data[i["data_offsets"][0]:i["data_offsets"][1]])
               for n, i in header.items()}
    edit(tensors)
    keep = [np.frombuffer(b, dtype=np.uint8) for _, _, b in tensors.values()]
    specs = {n: safetensors.TensorSpec(dtype={"BF16": "bfloat16", "F32": "float32", "I32": "int32",
                                              "I64": "int64"}[d], shape=s, data_ptr=a.ctypes.data,
                                       data_len=a.nbytes)
             for (n, (d, s, _)), a in zip(tensors.items(), keep)}
    safetensors.serialize_file(specs, str(path), metadata={"format": "pt"})


def test_open_and_views_are_zero_copy(tiny_model_dir: Path) -> None:
    ckpt = open_checkpoint(tiny_model_dir)
    cfg = ckpt.config
    assert set(ckpt) == set(expected_tensors(cfg))
    emb = ckpt["model.embed_tokens.weight"]
    assert emb.dtype == np.uint16 and emb.shape == (cfg.vocab_size, cfg.hidden_size)
    assert isinstance(emb.base, np.ndarray) or isinstance(emb, np.memmap)  # a view of the mapped shard
    assert not emb.flags.writeable


def test_write_then_read_round_trip(tiny_model_dir: Path, tmp_path: Path) -> None:
    ckpt = open_checkpoint(tiny_model_dir)
    write_checkpoint(tmp_path / "copy", ckpt.config, dict(ckpt), shard_bytes=1 << 16)
    copy = open_checkpoint(tmp_path / "copy")
    assert len({*_weight_map(tmp_path / "copy").values()}) > 1  # really sharded
    for name in ckpt:
        assert np.array_equal(ckpt[name], copy[name]), name


def test_missing_directory_and_index(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = load_config(tiny_model_dir)
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "nowhere", cfg)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json nor model.safetensors"):
        Checkpoint(tmp_path, cfg)


def test_missing_shard_is_named(model_copy: Path) -> None:
    shard = sorted(set(_weight_map(model_copy).values()))[0]
    (model_copy / shard).unlink()
    with pytest.raises(CheckpointError, match=f"{shard}: shard file not found"):
        open_checkpoint(model_copy)


def test_truncated_shard_is_named(model_copy: Path) -> None:
    shard = sorted(set(_weight_map(model_copy).values()))[0]
    path = model_copy / shard
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{shard}: not a readable safetensors file"):
        open_checkpoint(model_copy)


def test_absent_tensor_is_named(model_copy: Path) -> None:
    name = "model.layers.1.mlp.experts.0.down_proj.weight_scale"
    shard = _weight_map(model_copy)[name]
    _rewrite_shard(model_copy, shard, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"tensor '{name}'"):
        open_checkpoint(model_copy)


def test_wrong_dtype_is_named(model_copy: Path) -> None:
    name = "model.layers.0.self_attn.o_proj.weight"
    shard = _weight_map(model_copy)[name]

    def to_f32(t: dict) -> None:
        dtype, shape, data = t[name]
        t[name] = ("F32", shape, np.zeros(int(np.prod(shape)), np.float32).tobytes())

    _rewrite_shard(model_copy, shard, to_f32)
    with pytest.raises(CheckpointError, match=f"{shard}: tensor '{name}' has dtype F32, expected BF16"):
        open_checkpoint(model_copy)


def test_wrong_shape_is_named(model_copy: Path) -> None:
    name = "model.norm.weight"
    shard = _weight_map(model_copy)[name]

    def shrink(t: dict) -> None:
        dtype, shape, data = t[name]
        t[name] = (dtype, [shape[0] - 1], data[:-2])

    _rewrite_shard(model_copy, shard, shrink)
    with pytest.raises(CheckpointError, match=f"tensor '{name}' has shape"):
        open_checkpoint(model_copy)


def test_write_rejects_incomplete_tensor_set(tiny_model_dir: Path, tmp_path: Path) -> None:
    ckpt = open_checkpoint(tiny_model_dir)
    tensors = dict(ckpt)
    tensors.pop("lm_head.weight")
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        write_checkpoint(tmp_path / "bad", ckpt.config, tensors)
