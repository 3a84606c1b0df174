"""The DFlash drafter on the GPU against the numpy reference drafter: the tiny Kimi-K2.5-DFlash replica, random
drafters at awkward dims, and the Kimi dims (GQA 64/8, head_dim 128, hidden 7168, intermediate 18432) at 2 layers;
logits and top-K within the reference's own bf16 error, the draft KV after several rounds of appends, 16 streams at
different context lengths, a stream's logits bitwise unchanged by the other streams, and the context window."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import ddtree  # noqa: E402
_native = pytest.importorskip("ddtree._native", exc_type=ImportError)
from ddtree.config import RopeConfig  # noqa: E402
from ddtree.drafter import drafter_config_for, drafter_tensor_specs, parse_drafter_config, random_drafter_tensors  # noqa: E402,E501
from ddtree.drafter import write_drafter  # noqa: E402
from ddtree.drafter_engine import GpuDrafter  # noqa: E402
from ddtree.errors import RequestError  # noqa: E402
from ddtree.presets import preset_config  # noqa: E402
from ddtree.reference.drafter import ReferenceDrafter  # noqa: E402
from ddtree.reference.model import ReferenceModel  # noqa: E402
from drafter_replica import kimi_dflash_config_json, write_kimi_dflash_replica  # noqa: E402
from drafter_twins import Twins, random_contexts  # noqa: E402



@pytest.fixture(scope="module")
def replica_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kimi-dflash-tiny")
    write_kimi_dflash_replica(out, seed=3, scale="tiny")
    return out


def _tiny_twins(model_dirs: dict[str, Path], drafter_dir: Path, streams: int, window: int | None = None,
                max_context: int = 512) -> Twins:
    engine = ddtree.Engine(model_dirs["tiny"], streams=streams, max_context=max_context)
    reference = ReferenceDrafter.for_model(drafter_dir, ReferenceModel.load(model_dirs["tiny"]))
    return Twins(GpuDrafter(drafter_dir, engine, window=window), reference, streams, window)


def _rounds(twins: Twins, streams: list[int], first: list[int], rounds: int, seed: int,
            monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's context rows, then `rounds` - 1 rounds of 1 .. B accepted rows per stream, each checked."""
    cfg = twins.reference.config
    rng = np.random.default_rng(seed)
    counts = first
    for _ in range(rounds):
        bonus = rng.integers(0, cfg.vocab_size, len(streams)).tolist()
        twins.check_round(streams, random_contexts(rng, counts, cfg.context_width), bonus, monkeypatch)
        counts = rng.integers(1, cfg.block_size + 1, len(streams)).tolist()


@pytest.mark.parametrize("window", [None, 16])
def test_kimi_replica_rounds_match_reference(window: int | None, model_dirs: dict[str, Path], replica_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Four rounds on three streams (prompts longer than the window among them), then the draft KV."""
    twins = _tiny_twins(model_dirs, replica_dir, 3, window)
    _rounds(twins, [0, 1, 2], [5, 23, 40], 4, seed=1, monkeypatch=monkeypatch)
    twins.check_cache([0, 1, 2])


def _awkward_drafter(out: Path, variant: str) -> None:
    """Random drafters for the tiny target at dims no preset has: GQA group 3 with head_dim 24 and block 5, and
    multi-head attention (group 1) at head_dim 40, block 3 and YaRN with an explicit amplitude."""
    base = drafter_config_for(preset_config("tiny"), "tiny")
    if variant == "group3":
        cfg = dataclasses.replace(base, num_attention_heads=6, num_key_value_heads=2, head_dim=24,
                                  intermediate_size=104, block_size=5)
    else:
        cfg = dataclasses.replace(base, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
                                  head_dim=40, intermediate_size=56, block_size=3,
                                  rope=RopeConfig(50000.0, "yarn", 8.0, 64, 32.0, 1.0, 1.0, 1.0),
                                  rope_attention_factor=1.3)
    write_drafter(out, cfg, random_drafter_tensors(cfg, seed=7))


@pytest.mark.parametrize("variant", ["group3", "mha-yarn"])
def test_awkward_dims_match_reference(variant: str, model_dirs: dict[str, Path], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _awkward_drafter(tmp_path, variant)
    twins = _tiny_twins(model_dirs, tmp_path, 2, window=None if variant == "group3" else 9)
    _rounds(twins, [1, 0], [11, 300], 3, seed=2, monkeypatch=monkeypatch)
    twins.check_cache([0, 1])


def test_sixteen_streams_each_unchanged_by_the_others(model_dirs: dict[str, Path], replica_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """16 streams at 16 context lengths (across the attention's 256-key chunks) against the reference; every
    stream's logits bitwise the same drafted alone or beside others."""
    twins = _tiny_twins(model_dirs, replica_dir, 16, max_context=1024)
    cfg = twins.reference.config
    rng = np.random.default_rng(4)
    streams = list(range(16))
    counts = [1 + 41 * i for i in range(16)]
    bonus = rng.integers(0, cfg.vocab_size, 16).tolist()
    together = twins.check_round(streams, random_contexts(rng, counts, cfg.context_width), bonus, monkeypatch)
    for subset in ([5], [15, 0], [3, 9, 14, 2]):
        alone = twins.gpu.draft(subset, [bonus[s] for s in subset])
        for i, s in enumerate(subset):
            assert np.array_equal(alone[i], together[s]), f"stream {s} drafted with {subset} differs"
    # A round in which only some streams commit rows: the others' logits are unchanged bitwise.
    moved = [2, 7, 11]
    twins.gpu.append(moved, random_contexts(rng, [3, 8, 1], cfg.context_width))
    again = twins.gpu.draft(streams, bonus)
    for s in set(streams) - set(moved):
        assert np.array_equal(again[s], together[s]), f"stream {s} changed by other streams' appends"


def _torch_random_drafter(cfg, seed: int) -> dict[str, np.ndarray]:
    """Random bf16 drafter tensors made on the GPU (seconds, where numpy takes minutes at K2 dims)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for name, spec in drafter_tensor_specs(cfg).items():
        shape = spec.shape
        if len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, device="cuda")
        else:
            t = torch.randn(shape, generator=g, device="cuda") * shape[1] ** -0.5
        out[name] = t.bfloat16().view(torch.int16).cpu().numpy().view(np.uint16)
    return out


def test_kimi_dims_match_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The published drafter's dims at 2 layers (a smaller vocabulary keeps the reference's LM head small)."""
    vocab = 16384
    raw = kimi_dflash_config_json("real")
    raw.update(num_hidden_layers=2, layer_types=["full_attention"] * 2, max_window_layers=2, vocab_size=vocab,
               dflash_config={**raw["dflash_config"], "mask_token_id": vocab - 2})
    cfg = parse_drafter_config(json.loads(json.dumps(raw)))
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size) == (64, 8, 128, 7168)
    engine = ddtree.Engine.random(dataclasses.replace(preset_config("k2-layers", 1), vocab_size=vocab), 2, 256,
                                  seed=5)
    weights = _torch_random_drafter(cfg, seed=6)
    reference = ReferenceDrafter(cfg, weights, _native.engine_table(engine.native, "embed"),
                                 _native.engine_table(engine.native, "lm_head"))
    twins = Twins(GpuDrafter.with_weights(cfg, engine, weights), reference, 2)
    _rounds(twins, [0, 1], [12, 40], 3, seed=8, monkeypatch=monkeypatch)
    twins.check_cache([0, 1])


def test_bad_requests_name_the_argument(model_dirs: dict[str, Path], replica_dir: Path) -> None:
    twins = _tiny_twins(model_dirs, replica_dir, 2, max_context=64)
    gpu, width = twins.gpu, twins.reference.config.context_width
    rows = random_contexts(np.random.default_rng(0), [4], width)
    with pytest.raises(RequestError, match="stream 2"):
        gpu.append([2], rows)
    with pytest.raises(RequestError, match="twice"):
        gpu.append([0, 0], rows + rows)
    with pytest.raises(RequestError, match="context of stream 0"):
        gpu.append([0], [np.zeros((3, width + 1), np.uint16)])
    with pytest.raises(RequestError, match="max_context"):
        gpu.append([0], random_contexts(np.random.default_rng(0), [65], width))
    with pytest.raises(RequestError, match="bonus token"):
        gpu.draft([0], [10**6])
    with pytest.raises(RequestError, match="window"):
        GpuDrafter(replica_dir, twins.gpu.engine, window=0)
