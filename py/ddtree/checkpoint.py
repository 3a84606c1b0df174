"""Sharded safetensors checkpoints of DeepSeek-V3 / Kimi-K2 models: the expected tensor set, reading, writing.

Reading validates every expected tensor's name, dtype and shape (and the value of shape-holding tensors) against
the config before anything is used, refuses tensors of a kind the config counts at indices it does not count (a
config.json with fewer layers or experts than the checkpoint), warns about tensors it does not know, then hands
out read-only numpy views of the memory-mapped shards (no copies). bf16 tensors are returned as uint16 bit
patterns (numpy has no bfloat16); `ddtree.bf16` converts them.
"""

from __future__ import annotations

import json
import re
import struct
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors
from safetensors import SafetensorError, safe_open

from ddtree.config import ModelConfig
from ddtree.errors import CheckpointError, CheckpointWarning, printable

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtype names -> numpy storage dtype (bf16 kept as its bit pattern)
STORAGE_DTYPES = {"BF16": np.uint16, "F32": np.float32, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    dtypes: tuple[str, ...]  # accepted safetensors dtypes, the first is what ddtree writes
    shape: tuple[int, ...]
    value: tuple[int, ...] | None = None  # the integers a shape-holding tensor must contain


def _linear(out_dim: int, in_dim: int) -> TensorSpec:
    return TensorSpec(("BF16",), (out_dim, in_dim))


def _vector(dim: int) -> TensorSpec:
    return TensorSpec(("BF16",), (dim,))


def expert_tensor_specs(out_dim: int, in_dim: int, group_size: int) -> dict[str, TensorSpec]:
    """compressed-tensors pack-quantized layout of one INT4 Linear."""
    return {
        "weight_packed": TensorSpec(("I32",), (out_dim, in_dim // 8)),
        "weight_scale": TensorSpec(("BF16",), (out_dim, in_dim // group_size)),
        "weight_shape": TensorSpec(("I32", "I64"), (2,), value=(out_dim, in_dim)),
    }


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint of `cfg` must hold, with its dtype and shape."""
    return dict(iter_expected_tensors(cfg))


def iter_expected_tensors(cfg: ModelConfig) -> Iterator[tuple[str, TensorSpec]]:
    """expected_tensors one at a time, layer by layer: a reader that stops at the first missing tensor never
    enumerates the rest of a config that counts far more layers or experts than its checkpoint holds."""
    p = cfg.weight_prefix
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    yield from {
        f"{p}model.embed_tokens.weight": _linear(cfg.vocab_size, h),
        f"{p}model.norm.weight": _vector(h),
        f"{p}lm_head.weight": _linear(cfg.vocab_size, h),
    }.items()
    for i in range(cfg.num_hidden_layers):
        layer = f"{p}model.layers.{i}"
        attn = f"{layer}.self_attn"
        yield from {
            f"{layer}.input_layernorm.weight": _vector(h),
            f"{layer}.post_attention_layernorm.weight": _vector(h),
            f"{attn}.q_a_proj.weight": _linear(cfg.q_lora_rank, h),
            f"{attn}.q_a_layernorm.weight": _vector(cfg.q_lora_rank),
            f"{attn}.q_b_proj.weight": _linear(heads * cfg.qk_head_dim, cfg.q_lora_rank),
            f"{attn}.kv_a_proj_with_mqa.weight": _linear(cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
            f"{attn}.kv_a_layernorm.weight": _vector(cfg.kv_lora_rank),
            f"{attn}.kv_b_proj.weight": _linear(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            f"{attn}.o_proj.weight": _linear(h, heads * cfg.v_head_dim),
        }.items()
        mlp = f"{layer}.mlp"
        if not cfg.is_moe_layer(i):
            inter = cfg.intermediate_size
            yield from {
                f"{mlp}.gate_proj.weight": _linear(inter, h),
                f"{mlp}.up_proj.weight": _linear(inter, h),
                f"{mlp}.down_proj.weight": _linear(h, inter),
            }.items()
            continue
        yield f"{mlp}.gate.weight", _linear(cfg.n_routed_experts, h)
        yield f"{mlp}.gate.e_score_correction_bias", TensorSpec(("F32", "BF16"), (cfg.n_routed_experts,))
        if cfg.n_shared_experts:
            shared = cfg.n_shared_experts * cfg.moe_intermediate_size
            yield from {
                f"{mlp}.shared_experts.gate_proj.weight": _linear(shared, h),
                f"{mlp}.shared_experts.up_proj.weight": _linear(shared, h),
                f"{mlp}.shared_experts.down_proj.weight": _linear(h, shared),
            }.items()
        inter, g = cfg.moe_intermediate_size, cfg.quantization.group_size
        for e in range(cfg.n_routed_experts):
            expert = f"{mlp}.experts.{e}"
            for proj, (out_dim, in_dim) in (("gate_proj", (inter, h)), ("up_proj", (inter, h)),
                                            ("down_proj", (h, inter))):
                for field, spec in expert_tensor_specs(out_dim, in_dim, g).items():
                    yield f"{expert}.{proj}.{field}", spec


def unused_by(cfg: ModelConfig) -> Callable[[str], bool]:
    """Whether a tensor name belongs to what a checkpoint of `cfg` may hold beside the model ddtree runs: its
    multi-token-prediction layers and, in multimodal checkpoints, everything outside the text model."""
    p, first_mtp = cfg.weight_prefix, cfg.num_hidden_layers
    layer = re.compile(rf"{re.escape(p)}model\.layers\.(\d{{1,18}})\.")  # a longer index is beyond any MTP layer

    def unused(name: str) -> bool:
        match = layer.match(name)
        return not name.startswith(p) or (match is not None and
                                          first_mtp <= int(match[1]) < first_mtp + cfg.num_nextn_predict_layers)

    return unused


_INDEX_COMPONENT = re.compile(r"(?<=\.)\d+(?=\.)")


def _kind(name: str) -> str:
    """A tensor name with its layer and expert indices blanked: 'model.layers.#.mlp.experts.#.up_proj.weight'."""
    return _INDEX_COMPONENT.sub("#", name)


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
        # The safetensors format: u64 little-endian header length, JSON header, then the data section.
        with shard.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{shard}: not a readable safetensors file ({printable(str(e))})") from None
    data_start = 8 + header_len
    entries = {}
    for name in names:
        info = header[name]
        begin, end = info["data_offsets"]
        entries[name] = _Entry(shard, info["dtype"], tuple(info["shape"]), data_start + begin, data_start + end)
    return entries


def _weight_map(index_path: Path) -> dict[str, str]:
    """The index's tensor -> shard file map; every defect names the index and the entry at fault."""
    try:
        index = json.loads(index_path.read_text())
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{index_path}: not valid JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: field 'weight_map' must be an object mapping tensor names to shard "
                              f"files, got {weight_map!r:.80}")
    for name, shard in weight_map.items():
        # A shard is a file of the model directory (no path of another, however relative) with a printable name.
        if not isinstance(shard, str) or shard in ("", "..") or Path(shard).name != shard or not shard.isprintable():
            raise CheckpointError(f"{index_path}: weight_map entry '{printable(name)}' is {shard!r:.80}; shards must "
                                  f"be file names in the model directory")
    return weight_map


class Checkpoint(Mapping[str, np.ndarray]):
    """A validated, memory-mapped checkpoint: a read-only mapping from tensor name to numpy view.

    `specs` defaults to the target model's tensors of `cfg`; a drafter passes its own, as (name, spec) pairs that
    are read lazily, so a config declaring absurdly many layers fails at the first missing tensor instead of first
    listing them all.
    """

    def __init__(self, model_dir: str | Path, cfg: ModelConfig,
                 specs: Iterable[tuple[str, TensorSpec]] | None = None) -> None:
        self.dir = Path(model_dir)
        self.config = cfg
        self._maps: dict[Path, np.memmap] = {}
        self._entries = self._index()
        self._specs = self._validate(iter_expected_tensors(cfg) if specs is None else specs)
        self._check_extras(unused_by(cfg) if specs is None else lambda name: False)

    def _index(self) -> dict[str, _Entry]:
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: model directory does not exist")
        index_path = self.dir / INDEX_FILE
        if index_path.is_file():
            weight_map: dict[str, str] | None = _weight_map(index_path)
            shards = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE_FILE).is_file():
            weight_map, shards = None, [SINGLE_FILE]
        else:
            raise CheckpointError(f"{self.dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
        entries: dict[str, _Entry] = {}
        for shard in shards:
            for name, entry in _shard_entries(self.dir / shard).items():
                if name in entries:
                    raise CheckpointError(f"{entry.shard}: tensor '{printable(name)}' is also in "
                                          f"{entries[name].shard.name}")
                entries[name] = entry
        if weight_map is not None:
            for name, shard in weight_map.items():
                if name not in entries or entries[name].shard.name != shard:
                    raise CheckpointError(f"{self.dir / shard}: tensor '{printable(name)}' listed in {INDEX_FILE} "
                                          f"is absent")
        return entries

    def _validate(self, expected: Iterable[tuple[str, TensorSpec]]) -> dict[str, TensorSpec]:
        """The expected specs, each checked against its entry; raises at the first tensor at fault."""
        specs = {}
        for name, spec in expected:
            entry = self._entries.get(name)
            if entry is None:
                raise CheckpointError(f"{self.dir}: tensor '{name}' is missing from the checkpoint")
            if entry.dtype not in spec.dtypes:
                raise CheckpointError(f"{entry.shard}: tensor '{name}' has dtype {entry.dtype}, "
                                      f"expected {' or '.join(spec.dtypes)}")
            if entry.shape != spec.shape:
                raise CheckpointError(f"{entry.shard}: tensor '{name}' has shape {list(entry.shape)}, "
                                      f"expected {list(spec.shape)}")
            if spec.value is not None and tuple(self._view(entry).tolist()) != spec.value:
                raise CheckpointError(f"{entry.shard}: tensor '{name}' holds {self._view(entry).tolist()}, "
                                      f"expected {list(spec.value)} (the shape its packed weights have)")
            specs[name] = spec
        return specs

    def _check_extras(self, unused: Callable[[str], bool]) -> None:
        """Tensors beyond the expected ones: an error when tensors of their kind are expected (the config counts
        fewer layers or experts than the checkpoint holds), a warning naming them when ddtree does not know them."""
        extras = sorted(n for n in self._entries if n not in self._specs and not unused(n))
        if not extras:
            return
        kinds = {_kind(n) for n in self._specs}
        for name in extras:
            if _kind(name) in kinds:
                raise CheckpointError(f"{self._entries[name].shard}: tensor '{printable(name)}' is beyond what "
                                      f"{self.dir / 'config.json'} counts (it lists fewer layers or experts than "
                                      f"the checkpoint holds)")
        listed = ", ".join(f"'{printable(n)}'" for n in extras[:3]) + \
            (f" and {len(extras) - 3} more" if len(extras) > 3 else "")
        warnings.warn(f"{self.dir}: ignoring {len(extras)} tensor(s) this model does not use: {listed}",
                      CheckpointWarning, stacklevel=3)

    def _view(self, entry: _Entry) -> np.ndarray:
        if entry.shard not in self._maps:
            self._maps[entry.shard] = np.memmap(entry.shard, dtype=np.uint8, mode="r")
        raw = self._maps[entry.shard][entry.begin:entry.end]
        return raw.view(STORAGE_DTYPES[entry.dtype]).reshape(entry.shape)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._specs:
            raise KeyError(name)
        return self._view(self._entries[name])

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
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a directory")
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
