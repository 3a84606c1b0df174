"""Property-based tests of the checkpoint, config and drafter loaders on a tiny synthetic model written to disk.

Every defect (truncated shards, corrupted or oversized safetensors headers, wrong dtypes and shapes, missing and
extra tensors, index files pointing at missing shards or malformed, non-finite and ill-typed config fields,
drafter configs that do not match their target) must end in one ddtree exception naming the file, tensor or field;
never a crash, a hang or a silent load of anything but the original tensors. Derandomized, so CI runs the same
cases every time; the example counts add up to more than 10,000.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree import cli
from ddtree.checkpoint import INDEX_FILE, Checkpoint, expected_tensors, open_checkpoint, write_checkpoint
from ddtree.config import ModelConfig, load_config, parse_config
from ddtree.drafter import load_drafter_config, make_drafter, open_drafter
from ddtree.errors import CheckpointError, CheckpointWarning, ConfigError, DDTreeError, printable
from ddtree.presets import preset_config, random_tensors


def fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


# Two layers (one dense, one MoE with two experts and a shared expert), seven shards of at most 4 KiB.
MICRO = dataclasses.replace(
    preset_config("tiny"), vocab_size=16, hidden_size=32, intermediate_size=32, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=1, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=2, num_experts_per_tok=1, max_position_embeddings=64,
    bos_token_id=1, eos_token_ids=(2,))
EXPECTED = expected_tensors(MICRO)
SAFETENSORS_DTYPES = ("BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64")
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
            "F64": 8, "I64": 8, "U64": 8}
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                              max_size=4), max_leaves=12)


class Model:
    """The pristine files of the micro checkpoint and a work directory the tests rewrite before every example (a
    plain class: hypothesis prints failing arguments, and would print a dataclass's kilobytes of shards)."""

    def __init__(self, files: dict[str, bytes], work: Path, tensors: dict[str, np.ndarray]) -> None:
        self.files, self.work, self.tensors = files, work, tensors

    def __repr__(self) -> str:
        return f"Model({self.work})"

    @property
    def shards(self) -> list[str]:
        return sorted(n for n in self.files if n.endswith(".safetensors"))

    @property
    def weight_map(self) -> dict[str, str]:
        return json.loads(self.files[INDEX_FILE])["weight_map"]

    def write(self, files: dict[str, bytes]) -> Path:
        for path in self.work.iterdir():
            path.unlink()
        for name, data in files.items():
            (self.work / name).write_bytes(data)
        return self.work


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    pristine = tmp_path_factory.mktemp("micro")
    write_checkpoint(pristine, MICRO, random_tensors(MICRO, seed=0), shard_bytes=4096)
    checkpoint = open_checkpoint(pristine)
    work = tmp_path_factory.mktemp("work")
    return Model({p.name: p.read_bytes() for p in pristine.iterdir()}, work,
                 {name: np.array(checkpoint[name]) for name in checkpoint})


def split_shard(data: bytes) -> tuple[dict[str, Any], bytes]:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length]), data[8 + length:]


def join_shard(header: dict[str, Any], body: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def rebuild_shard(tensors: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    """A shard of (dtype, shape, bytes) tensors, laid out in order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    body = b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + len(raw)]}
        body += raw
    return join_shard(header, body)


def shard_tensors(data: bytes) -> dict[str, tuple[str, list[int], bytes]]:
    header, body = split_shard(data)
    header.pop("__metadata__", None)
    return {n: (i["dtype"], i["shape"], body[i["data_offsets"][0]:i["data_offsets"][1]]) for n, i in header.items()}


def outcome(load: Callable[[], Any]) -> tuple[Any, list[warnings.WarningMessage]]:
    """What `load` returned or the DDTreeError it raised, and the warnings it gave; anything else propagates."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return load(), caught
        except DDTreeError as error:
            return error, caught


def assert_names(error: Any, *culprits: str) -> None:
    assert isinstance(error, DDTreeError), f"loaded silently: {error!r}"
    message = str(error)
    assert "\n" not in message
    assert any(c in message for c in culprits), f"{message!r} names none of {culprits}"


def assert_loads_original(result: Any, model: Model) -> None:
    assert isinstance(result, Checkpoint), result
    assert set(result) == set(model.tensors)
    for name, array in model.tensors.items():
        assert np.array_equal(result[name], array), name


# ---- shard files ---------------------------------------------------------------------------------------------


def truncated_shard(model: Model, data: st.DataObject) -> tuple[str, dict[str, bytes]]:
    shard = data.draw(st.sampled_from(model.shards))
    cut = data.draw(st.integers(0, len(model.files[shard]) - 1))
    return shard, {**model.files, shard: model.files[shard][:cut]}


def corrupted_header(model: Model, data: st.DataObject) -> tuple[str, dict[str, bytes]]:
    """One to four bytes of a shard's length field or JSON header overwritten."""
    shard = data.draw(st.sampled_from(model.shards))
    raw = bytearray(model.files[shard])
    header_end = 8 + struct.unpack("<Q", raw[:8])[0]
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, header_end - 1))] = data.draw(st.integers(0, 255))
    return shard, {**model.files, shard: bytes(raw)}


@fuzz(1000)
@given(data=st.data())
def test_truncated_shard(model: Model, data: st.DataObject) -> None:
    shard, files = truncated_shard(model, data)
    error, _ = outcome(lambda: open_checkpoint(model.write(files)))
    assert isinstance(error, CheckpointError)
    assert_names(error, shard)


@fuzz(2000)
@given(data=st.data())
def test_corrupted_header_bytes(model: Model, data: st.DataObject) -> None:
    """An error naming the shard or a tensor, or (when the change means nothing, e.g. in padding) exactly the
    original tensors."""
    shard, files = corrupted_header(model, data)
    result, _ = outcome(lambda: open_checkpoint(model.write(files)))
    if isinstance(result, DDTreeError):
        assert_names(result, shard, "tensor '")
    else:
        assert_loads_original(result, model)


@fuzz(500)
@given(data=st.data())
def test_oversized_header_length(model: Model, data: st.DataObject) -> None:
    shard = data.draw(st.sampled_from(model.shards))
    raw = model.files[shard]
    length = data.draw(st.integers(len(raw) - 7, 2**64 - 1))
    files = {**model.files, shard: struct.pack("<Q", length) + raw[8:]}
    error, _ = outcome(lambda: open_checkpoint(model.write(files)))
    assert isinstance(error, CheckpointError)
    assert_names(error, shard)


@fuzz(800)
@given(data=st.data(), header=JSON)
def test_header_replaced_by_other_json(model: Model, data: st.DataObject, header: Any) -> None:
    shard = data.draw(st.sampled_from(model.shards))
    body = split_shard(model.files[shard])[1]
    text = json.dumps(header).encode()
    raw = struct.pack("<Q", len(text)) + text + body
    error, _ = outcome(lambda: open_checkpoint(model.write({**model.files, shard: raw})))
    assert_names(error, shard, "tensor '")


def _shapes_of(count: int) -> st.SearchStrategy[list[int]]:
    """Shapes of exactly `count` elements (rank 0 to 3)."""
    divisors = [d for d in range(1, count + 1) if count % d == 0]
    return st.one_of(
        st.just([count]), st.just([]) if count == 1 else st.nothing(),
        st.sampled_from(divisors).map(lambda d: [d, count // d]),
        st.tuples(st.sampled_from(divisors), st.sampled_from(divisors)).filter(
            lambda ab: count % (ab[0] * ab[1]) == 0).map(lambda ab: [ab[0], ab[1], count // (ab[0] * ab[1])]))


@fuzz(1500)
@given(data=st.data())
def test_wrong_dtype_or_shape(model: Model, data: st.DataObject) -> None:
    """A tensor stored with another dtype or shape over the same bytes: the tensor is named, unless both are
    what the config expects (then the original loads)."""
    name = data.draw(st.sampled_from(sorted(EXPECTED)))
    shard = model.weight_map[name]
    tensors = shard_tensors(model.files[shard])
    dtype, shape, raw = tensors[name]
    new_dtype = data.draw(st.sampled_from([d for d in SAFETENSORS_DTYPES if len(raw) % ITEMSIZE[d] == 0]))
    new_shape = data.draw(_shapes_of(len(raw) // ITEMSIZE[new_dtype]))
    tensors[name] = (new_dtype, new_shape, raw)
    result, _ = outcome(lambda: open_checkpoint(model.write({**model.files, shard: rebuild_shard(tensors)})))
    spec = EXPECTED[name]
    if new_dtype in spec.dtypes and tuple(new_shape) == spec.shape:
        assert isinstance(result, Checkpoint) and result.dtype_of(name) == new_dtype
    else:
        assert isinstance(result, CheckpointError)
        assert_names(result, f"tensor '{name}'")


@fuzz(300)
@given(data=st.data())
def test_weight_shape_values(model: Model, data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(n for n in EXPECTED if n.endswith(".weight_shape"))))
    shard = model.weight_map[name]
    tensors = shard_tensors(model.files[shard])
    dtype, shape, _ = tensors[name]
    values = data.draw(st.lists(st.integers(-2**31, 2**31 - 1), min_size=2, max_size=2))
    tensors[name] = (dtype, shape, np.array(values, np.int32 if dtype == "I32" else np.int64).tobytes())
    result, _ = outcome(lambda: open_checkpoint(model.write({**model.files, shard: rebuild_shard(tensors)})))
    if tuple(values) == EXPECTED[name].value:
        assert isinstance(result, Checkpoint)
    else:
        assert_names(result, f"tensor '{name}' holds {values}")


# ---- the tensor set ------------------------------------------------------------------------------------------


@fuzz(1200)
@given(data=st.data())
def test_missing_tensors(model: Model, data: st.DataObject) -> None:
    removed = data.draw(st.sets(st.sampled_from(sorted(EXPECTED)), min_size=1, max_size=5))
    also_from_index = data.draw(st.booleans())
    files = dict(model.files)
    for shard in {model.weight_map[n] for n in removed}:
        files[shard] = rebuild_shard({n: t for n, t in shard_tensors(files[shard]).items() if n not in removed})
    if also_from_index:
        index = json.loads(files[INDEX_FILE])
        index["weight_map"] = {n: s for n, s in index["weight_map"].items() if n not in removed}
        files[INDEX_FILE] = json.dumps(index).encode()
    error, _ = outcome(lambda: open_checkpoint(model.write(files)))
    assert isinstance(error, CheckpointError)
    assert_names(error, *(f"tensor '{n}'" for n in removed))


KIND = re.compile(r"(?<=\.)\d+(?=\.)")
EXPECTED_KINDS = {KIND.sub("#", n) for n in EXPECTED}
LAYER_SUFFIXES = sorted({n.split(".", 3)[3] for n in EXPECTED if n.startswith("model.layers.")})
EXTRA_NAMES = st.one_of(
    # a layer beyond num_hidden_layers (layer 2 is an MTP layer when num_nextn_predict_layers is 1)
    st.builds(lambda i, s: f"model.layers.{i}.{s}", st.integers(2, 99), st.sampled_from(LAYER_SUFFIXES)),
    # an expert beyond n_routed_experts
    st.builds(lambda e, p, f: f"model.layers.1.mlp.experts.{e}.{p}.{f}", st.integers(2, 999),
              st.sampled_from(["gate_proj", "up_proj", "down_proj"]),
              st.sampled_from(["weight_packed", "weight_scale", "weight_shape"])),
    # names ddtree does not know, control characters included (messages must stay one line)
    st.text(st.sampled_from("abcxyz_.019\n\t"), min_size=1, max_size=24),
)


@fuzz(1200)
@given(data=st.data())
def test_extra_tensors(model: Model, data: st.DataObject) -> None:
    """Extras of an expected kind are errors naming the tensor; unknown extras load with one warning naming them;
    the layers after num_hidden_layers are silent when config.json declares them multi-token-prediction layers."""
    extras = data.draw(st.sets(EXTRA_NAMES.filter(lambda n: n not in EXPECTED), min_size=1, max_size=3))
    nextn = data.draw(st.integers(0, 1))
    shard = data.draw(st.sampled_from(model.shards))
    tensors = shard_tensors(model.files[shard])
    tensors.update({n: ("F32", [2], np.zeros(2, np.float32).tobytes()) for n in extras})
    config = json.loads(model.files["config.json"])
    config["num_nextn_predict_layers"] = nextn
    files = {**model.files, shard: rebuild_shard(tensors), "config.json": json.dumps(config).encode()}
    result, caught = outcome(lambda: open_checkpoint(model.write(files)))
    unused = {n for n in extras if nextn and n.startswith("model.layers.2.")}
    flagged = sorted(n for n in extras - unused if KIND.sub("#", n) in EXPECTED_KINDS)
    unknown = sorted(extras - unused - set(flagged))
    if flagged:
        assert isinstance(result, CheckpointError)
        assert_names(result, f"tensor '{printable(flagged[0])}' is beyond what")
        return
    assert_loads_original(result, model)
    warned = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    if unknown:
        assert len(warned) == 1 and f"ignoring {len(unknown)} tensor(s)" in warned[0]
        assert f"'{printable(unknown[0])}'" in warned[0] and "\n" not in warned[0]
    else:
        assert warned == []


@fuzz(400)
@given(data=st.data())
def test_tensor_in_two_shards(model: Model, data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(EXPECTED)))
    home = model.weight_map[name]
    other = data.draw(st.sampled_from([s for s in model.shards if s != home]))
    tensors = shard_tensors(model.files[other])
    tensors[name] = shard_tensors(model.files[home])[name]
    error, _ = outcome(lambda: open_checkpoint(model.write({**model.files, other: rebuild_shard(tensors)})))
    assert isinstance(error, CheckpointError)
    assert_names(error, f"tensor '{name}' is also in")


# ---- the index -----------------------------------------------------------------------------------------------


@fuzz(800)
@given(data=st.data())
def test_index_points_at_a_missing_shard(model: Model, data: st.DataObject) -> None:
    missing = data.draw(st.from_regex(r"[a-z0-9-]{1,16}\.safetensors", fullmatch=True).filter(
        lambda n: n not in model.files))
    names = data.draw(st.sets(st.sampled_from(sorted(EXPECTED)), min_size=1, max_size=3))
    index = json.loads(model.files[INDEX_FILE])
    index["weight_map"].update({n: missing for n in names})
    error, _ = outcome(lambda: open_checkpoint(model.write({**model.files, INDEX_FILE: json.dumps(index).encode()})))
    assert isinstance(error, CheckpointError)
    assert_names(error, f"{missing}: shard file not found")


def malformed_index(model: Model, data: st.DataObject) -> dict[str, bytes]:
    """The whole index, its weight_map or one of its entries replaced by other JSON (or by bytes that are not)."""
    index = json.loads(model.files[INDEX_FILE])
    where = data.draw(st.sampled_from(["index", "weight_map", "entry", "bytes"]))
    value = data.draw(JSON)
    if where == "index":
        index = value
    elif where == "weight_map":
        index["weight_map"] = value
    elif where == "entry":
        index["weight_map"][data.draw(st.sampled_from(sorted(EXPECTED)))] = value
    text = data.draw(st.binary(max_size=40)) if where == "bytes" else json.dumps(index).encode()
    return {**model.files, INDEX_FILE: text}


@fuzz(800)
@given(data=st.data())
def test_malformed_index(model: Model, data: st.DataObject) -> None:
    result, _ = outcome(lambda: open_checkpoint(model.write(malformed_index(model, data))))
    if isinstance(result, Checkpoint):  # the replacement happened to be a valid index of the same files
        assert_loads_original(result, model)
    else:
        assert_names(result, INDEX_FILE, "tensor '", ": shard file not found")


# ---- config.json ---------------------------------------------------------------------------------------------


def _leaves(value: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(value, dict) and value:
        return [leaf for key, item in value.items() for leaf in _leaves(item, (*path, key))]
    return [path]


def _with(raw: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    copy = json.loads(json.dumps(raw))
    node = copy
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return copy


def _get(raw: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        raw = raw[key]
    return raw


MICRO_CONFIG = MICRO.to_dict()
NUMBER_PATHS = sorted(p for p in _leaves(MICRO_CONFIG) if type(_get(MICRO_CONFIG, p)) in (int, float))
READ_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
               "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
               "routed_scaling_factor", "first_k_dense_replace", "max_position_embeddings", "rms_norm_eps",
               "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
               "mscale_all_dim", "num_bits", "group_size", "num_nextn_predict_layers", "bos_token_id",
               "eos_token_id", "n_group", "topk_group", "moe_layer_freq")


@fuzz(800)
@given(data=st.data())
def test_non_finite_config_numbers(model: Model, data: st.DataObject) -> None:
    """NaN, Infinity and overflowing literals (1e999 reads as inf) in any numeric field read from config.json."""
    path = data.draw(st.sampled_from([p for p in NUMBER_PATHS if p[-1] in READ_FIELDS]))
    literal = data.draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]))
    text = json.dumps(_with(MICRO_CONFIG, path, "@")).replace('"@"', literal)
    error, _ = outcome(lambda: load_config(model.write({"config.json": text.encode()})))
    assert isinstance(error, ConfigError)
    assert_names(error, f"field '{path[-1]}'")
    assert "config.json" in str(error)


def any_config_field(data: st.DataObject) -> dict[str, Any]:
    """The micro config with one field (at any depth) set to any JSON value."""
    return _with(MICRO_CONFIG, data.draw(st.sampled_from(_leaves(MICRO_CONFIG))), data.draw(JSON))


@fuzz(1500)
@given(data=st.data())
def test_config_fields_of_any_json(data: st.DataObject) -> None:
    """A ConfigError naming a field, or a config that parses (the value was valid, or a field ddtree does not
    read) with every number finite."""
    result, _ = outcome(lambda: parse_config(any_config_field(data)))
    if isinstance(result, DDTreeError):
        assert isinstance(result, ConfigError)
        assert_names(result, "field '")
    else:
        assert isinstance(result, ModelConfig)
        assert all(math.isfinite(v) for v in (result.rms_norm_eps, result.rope.theta, result.rope.factor,
                                               result.routed_scaling_factor, result.rope.mscale))


COUNTS = ("num_hidden_layers", "n_routed_experts", "n_shared_experts", "first_k_dense_replace",
          "num_nextn_predict_layers", "num_experts_per_tok", "vocab_size", "hidden_size")
# Values other than the original that leave the tensor set as it is.
HARMLESS = {"num_nextn_predict_layers": lambda v: v >= 0, "num_experts_per_tok": lambda v: 1 <= v <= 2}


@fuzz(600)
@given(data=st.data())
def test_config_counts_against_the_checkpoint(model: Model, data: st.DataObject) -> None:
    """Counts and dims in config.json up to 2**62 against the micro checkpoint: fails at once (expected tensors
    are enumerated lazily, MTP layers are matched, not listed), naming a tensor or a field, or loads the original
    when the value leaves the tensor set as it is (no shared expert: a warning names its tensors)."""
    field = data.draw(st.sampled_from(COUNTS))
    value = data.draw(st.one_of(st.integers(-2, 40), st.integers(0, 2**62)))
    config = {**json.loads(model.files["config.json"]), field: value}
    result, caught = outcome(lambda: open_checkpoint(model.write({**model.files,
                                                                  "config.json": json.dumps(config).encode()})))
    if field == "n_shared_experts" and value == 0 and isinstance(result, Checkpoint):
        # The shared expert's tensors are then of no kind the config has: ignored, with a warning naming them.
        assert "shared_experts" in str(caught[0].message)
    elif isinstance(result, Checkpoint):
        assert value == MICRO_CONFIG[field] or HARMLESS.get(field, lambda v: False)(value)
        assert_loads_original(result, model)
    else:
        assert_names(result, "tensor '", "field '")


DEFECTS: dict[str, Callable[[Model, st.DataObject], dict[str, bytes]]] = {
    "truncated shard": lambda model, data: truncated_shard(model, data)[1],
    "corrupted header": lambda model, data: corrupted_header(model, data)[1],
    "malformed index": malformed_index,
    "config field": lambda model, data: {**model.files, "config.json": json.dumps(any_config_field(data)).encode()},
}


@settings(fuzz(400), suppress_health_check=[*fuzz(400).suppress_health_check, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_cli_reports_every_defect_in_one_line(model: Model, data: st.DataObject,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """ddtree-run generate over a defective checkpoint: status 2 and one error line, or a run (status 0) with at
    most one warning line; never an internal error."""
    files = DEFECTS[data.draw(st.sampled_from(sorted(DEFECTS)))](model, data)
    status = cli.main(["generate", "--model", str(model.write(files)), "--prompt-ids", "1", "-n", "2",
                       "--backend", "reference"])
    lines = capsys.readouterr().err.splitlines()
    if status == 2:
        assert len(lines) == 1 and lines[0].startswith("ddtree-run: error: "), lines
    else:
        assert status == 0 and len(lines) <= 1 and all(line.startswith("ddtree-run: warning: ") for line in lines)


# ---- the drafter against its target --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafter_files(model: Model, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    drafter = tmp_path_factory.mktemp("drafter")
    make_drafter(MICRO, drafter, seed=1, preset="tiny")
    return drafter, json.loads((drafter / "config.json").read_text())


DRAFTER_DIMS = ("hidden_size", "vocab_size", "num_target_layers", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "block_size", "max_position_embeddings")


@fuzz(1200)
@given(data=st.data(), value=JSON)
def test_drafter_config_against_its_target(drafter_files: tuple[Path, dict[str, Any]], data: st.DataObject,
                                           value: Any) -> None:
    """A drafter config.json field (or dflash_config entry) changed to a nearby integer, a non-finite number or any
    JSON, opened against the micro target: a ConfigError naming a field or a CheckpointError naming a tensor,
    or the drafter loads and its dims still match the target."""
    drafter_dir, pristine = drafter_files
    path = data.draw(st.sampled_from(_leaves(pristine)))
    original = _get(pristine, path)
    if isinstance(original, int) and not isinstance(original, bool) and data.draw(st.booleans()):
        # Layer counts stay small: the drafter's tensor specs are enumerated before any is read.
        value = max(0, original + data.draw(st.integers(-3, 3))) if path[-1] == "num_hidden_layers" else \
            original + data.draw(st.integers(-40, 40))
    elif data.draw(st.integers(0, 3)) == 0:
        value = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    if path[-1] == "num_hidden_layers" and not (isinstance(value, int) and value <= 8):
        value = 8
    raw = _with(pristine, path, value)
    work = drafter_dir.parent / f"{drafter_dir.name}-work"
    if not work.exists():
        shutil.copytree(drafter_dir, work)
    (work / "config.json").write_text(json.dumps(raw))
    result, _ = outcome(lambda: open_drafter(work, MICRO))
    if isinstance(result, DDTreeError):
        assert isinstance(result, (ConfigError, CheckpointError))
        assert_names(result, "field '", "tensor '")
        return
    cfg, _ = result
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers) == (MICRO.hidden_size, MICRO.vocab_size,
                                                                       MICRO.num_hidden_layers)
    assert all(0 <= i < MICRO.num_hidden_layers - 1 for i in cfg.target_layer_ids)
    assert load_drafter_config(work, MICRO) == cfg
