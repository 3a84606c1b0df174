"""Sharded safetensors checkpoints of DeepSeek-V3 / Kimi-K2 models: the expected tensor set, reading, writing.

Reading validates every expected tensor's name, dtype and shape against the config before anything is used,
then hands out read-only numpy views of the memory-mapped shards (no copies). bf16 tensors are returned as
uint16 bit patterns (numpy has no bfloat16); `ddtree.bf16` converts them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors
from safetensors import SafetensorError, safe_open

from ddtree.config import ModelConfig
from ddtree.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtype names -> numpy storage dtype (bf16 kept as its bit pattern)
STORAGE_DTYPES = {"BF16": np.uint16, "F32": np.float32, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    dtypes: tuple[str, ...]  # accepted safetensors dtypes, the first is what ddtree writes
    shape: tuple[int, ...]


def _linear(out_dim: int, in_dim: int) -> TensorSpec:
    return TensorSpec(("BF16",), (out_dim, in_dim))


def _vector(dim: int) -> TensorSpec:
    return TensorSpec(("BF16",), (dim,))


def expert_tensor_specs(out_dim: int, in_dim: int, group_size: int) -> dict[str, TensorSpec]:
    """compressed-tensors pack-quantized layout of one INT4 Linear."""
    return {
        "weight_packed": TensorSpec(("I32",), (out_dim, in_dim // 8)),
        "weight_scale": TensorSpec(("BF16",), (out_dim, in_dim // group_size)),
        "weight_shape": TensorSpec(("I32", "I64"), (2,)),
    }


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint of `cfg` must hold, with its dtype and shape."""
    p = cfg.weight_prefix
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    specs: dict[str, TensorSpec] = {
        f"{p}model.embed_tokens.weight": _linear(cfg.vocab_size, h),
        f"{p}model.norm.weight": _vector(h),
        f"{p}lm_head.weight": _linear(cfg.vocab_size, h),
    }
    for i in range(cfg.num_hidden_layers):
        layer = f"{p}model.layers.{i}"
        attn = f"{layer}.self_attn"
        specs.update({
            f"{layer}.input_layernorm.weight": _vector(h),
            f"{layer}.post_attention_layernorm.weight": _vector(h),
            f"{attn}.q_a_proj.weight": _linear(cfg.q_lora_rank, h),
            f"{attn}.q_a_layernorm.weight": _vector(cfg.q_lora_rank),
            f"{attn}.q_b_proj.weight": _linear(heads * cfg.qk_head_dim, cfg.q_lora_rank),
            f"{attn}.kv_a_proj_with_mqa.weight": _linear(cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
            f"{attn}.kv_a_layernorm.weight": _vector(cfg.kv_lora_rank),
            f"{attn}.kv_b_proj.weight": _linear(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            f"{attn}.o_proj.weight": _linear(h, heads * cfg.v_head_dim),
        })
        mlp = f"{layer}.mlp"
        if not cfg.is_moe_layer(i):
            inter = cfg.intermediate_size
            specs.update({
                f"{mlp}.gate_proj.weight": _linear(inter, h),
                f"{mlp}.up_proj.weight": _linear(inter, h),
                f"{mlp}.down_proj.weight": _linear(h, inter),
            })
            continue
        specs[f"{mlp}.gate.weight"] = _linear(cfg.n_routed_experts, h)
        specs[f"{mlp}.gate.e_score_correction_bias"] = TensorSpec(("F32", "BF16"), (cfg.n_routed_experts,))
        if cfg.n_shared_experts:
            shared = cfg.n_shared_experts * cfg.moe_intermediate_size
            specs.update({
                f"{mlp}.shared_experts.gate_proj.weight": _linear(shared, h),
                f"{mlp}.shared_experts.up_proj.weight": _linear(shared, h),
                f"{mlp}.shared_experts.down_proj.weight": _linear(h, shared),
            })
        inter, g = cfg.moe_intermediate_size, cfg.quantization.group_size
        for e in range(cfg.n_routed_experts):
            expert = f"{mlp}.experts.{e}"
            for proj, (out_dim, in_dim) in (("gate_proj", (inter, h)), ("up_proj", (inter, h)),
                                            ("down_proj", (h, inter))):
                for field, spec in expert_tensor_specs(out_dim, in_dim, g).items():
                    specs[f"{expert}.{proj}.{field}"] = spec
    return specs


@dataclass(frozen=True, slots=True)
class _Entry:
    shard: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the shard
    end: int


def _shard_entries(shard: Path) -> dict[str, _Entry]:
    """Validate one shard with the safetensors library, then locate each tensor's bytes for memory mapping."""
    if not shard.is_file():
        raise CheckpointError(f"{shard}: shard file not found")
    try:
        with safe_open(str(shard), framework="numpy") as f:
            names = set(f.keys())
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{shard}: not a readable safetensors file ({e})") from None
    # The safetensors format: u64 little-endian header length, JSON header, then the data section.
    with shard.open("rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(header_len))
    data_start = 8 + header_len
    entries = {}
    for name in names:
        info = header[name]
        begin, end = info["data_offsets"]
        entries[name] = _Entry(shard, info["dtype"], tuple(info["shape"]), data_start + begin, data_start + end)
    return entries


class Checkpoint(Mapping[str, np.ndarray]):
    """A validated, memory-mapped checkpoint: a read-only mapping from tensor name to numpy view."""

    def __init__(self, model_dir: str | Path, cfg: ModelConfig,
                 specs: Mapping[str, TensorSpec] | None = None) -> None:
        self.dir = Path(model_dir)
        self.config = cfg
        self._specs = dict(specs if specs is not None else expected_tensors(cfg))
        self._entries = self._index()
        self._validate()
        self._maps: dict[Path, np.memmap] = {}

    def _index(self) -> dict[str, _Entry]:
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: model directory does not exist")
        index_path = self.dir / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path}: malformed index ({e})") from None
            shards = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE_FILE).is_file():
            weight_map, shards = None, [SINGLE_FILE]
        else:
            raise CheckpointError(f"{self.dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
        entries: dict[str, _Entry] = {}
        for shard in shards:
            entries.update(_shard_entries(self.dir / shard))
        if weight_map is not None:
            for name, shard in weight_map.items():
                if name not in entries or entries[name].shard.name != shard:
                    raise CheckpointError(f"{self.dir / shard}: tensor '{name}' listed in {INDEX_FILE} is absent")
        return entries

    def _validate(self) -> None:
        for name, spec in self._specs.items():
            entry = self._entries.get(name)
            if entry is None:
                raise CheckpointError(f"{self.dir}: tensor '{name}' is missing from the checkpoint")
            if entry.dtype not in spec.dtypes:
                raise CheckpointError(f"{entry.shard}: tensor '{name}' has dtype {entry.dtype}, "
                                      f"expected {' or '.join(spec.dtypes)}")
            if entry.shape != spec.shape:
                raise CheckpointError(f"{entry.shard}: tensor '{name}' has shape {list(entry.shape)}, "
                                      f"expected {list(spec.shape)}")

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._specs:
            raise KeyError(name)
        entry = self._entries[name]
        if entry.shard not in self._maps:
            self._maps[entry.shard] = np.memmap(entry.shard, dtype=np.uint8, mode="r")
        raw = self._maps[entry.shard][entry.begin:entry.end]
        return raw.view(STORAGE_DTYPES[entry.dtype]).reshape(entry.shape)

    def dtype_of(self, name: str) -> str:
        return self._entries[name].dtype

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


_WRITE_DTYPE = {np.dtype(np.uint16): "bfloat16", np.dtype(np.float32): "float32", np.dtype(np.int32): "int32",
                np.dtype(np.int64): "int64"}


def write_tensor_dir(out_dir: str | Path, config: Mapping[str, object], specs: Mapping[str, TensorSpec],
                     tensors: Mapping[str, np.ndarray], shards: list[list[str]]) -> None:
    """Write config.json, one safetensors file per group of names in `shards`, and the index.

    `tensors` must hold exactly the names of `specs`, each with its spec's shape; uint16 arrays are BF16.
    Tensors are read shard by shard, so a lazily generated mapping never has to be in memory whole.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    missing, extra = set(specs) - set(tensors), set(tensors) - set(specs)
    if missing or extra:
        raise CheckpointError(f"{out}: tensor set does not match the config "
                              f"(missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]})")
    weight_map = {}
    total = 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        arrays = {n: np.ascontiguousarray(tensors[n]) for n in names}
        for n, a in arrays.items():
            if a.dtype not in _WRITE_DTYPE or a.shape != specs[n].shape:
                raise CheckpointError(f"{out}: tensor '{n}' has dtype {a.dtype} shape {list(a.shape)}, "
                                      f"expected {specs[n].dtypes[0]} {list(specs[n].shape)}")
        serial = {n: safetensors.TensorSpec(dtype=_WRITE_DTYPE[a.dtype], shape=list(a.shape),
                                            data_ptr=a.ctypes.data, data_len=a.nbytes) for n, a in arrays.items()}
        safetensors.serialize_file(serial, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
        total += sum(a.nbytes for a in arrays.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _shard_bytes_groups(specs: Mapping[str, TensorSpec], shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name in specs:
        nbytes = int(np.prod(specs[name].shape)) * np.dtype(STORAGE_DTYPES[specs[name].dtypes[0]]).itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_checkpoint(model_dir: str | Path, cfg: ModelConfig, tensors: Mapping[str, np.ndarray],
                     shard_bytes: int = 2 << 30) -> None:
    """Write a target checkpoint: config.json, shards of at most `shard_bytes`, model.safetensors.index.json."""
    specs = expected_tensors(cfg)
    write_tensor_dir(model_dir, cfg.to_dict(), specs, tensors, _shard_bytes_groups(specs, shard_bytes))


def open_checkpoint(model_dir: str | Path) -> Checkpoint:
    """Read config.json, then open and validate the checkpoint against it."""
    from ddtree.config import load_config

    return Checkpoint(model_dir, load_config(model_dir))
