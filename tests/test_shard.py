"""The multi-GPU layout (ddtree.shard), its agreement with the runtime's (runtime/shard.h), and the sharded numpy
forward (ddtree.reference.sharded): G ranks with rank-order sums reproduce the unsharded logits, and the
cross-rank pick equals the single-GPU token choice exactly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ddtree.engine import engine_dims
from ddtree.errors import RequestError
from ddtree.presets import preset_config, random_tensors
from ddtree.reference import ReferenceModel
from ddtree.reference.sampling import target_choices
from ddtree.reference.sharded import ShardedReference, pick_across_ranks, rank_candidates
from ddtree.shard import Shard, shard_layout, shard_tensor

K2_LAYERS = 61


@pytest.fixture(scope="module")
def tiny() -> ReferenceModel:
    cfg = preset_config("tiny")
    return ReferenceModel(cfg, random_tensors(cfg, seed=3))


def k2_config():
    return dataclasses.replace(preset_config("k2-layers", layers=4), num_hidden_layers=K2_LAYERS)


def test_k2_rank_of_eight() -> None:
    layout = shard_layout(k2_config(), Shard(7, 8))
    assert (layout.heads, layout.inter, layout.shared_inter, layout.experts, layout.vocab) == (8, 2304, 256, 48,
                                                                                              20480)
    assert (layout.first_head, layout.first_expert, layout.first_token) == (56, 336, 143360)


@pytest.mark.parametrize("field, changes", [("num_attention_heads", {"num_attention_heads": 12}),
                                            ("n_routed_experts", {"n_routed_experts": 36}),
                                            ("vocab_size", {"vocab_size": 163844}),
                                            ("intermediate_size", {"intermediate_size": 18436})])
def test_a_rank_count_that_does_not_divide_is_refused(field: str, changes: dict) -> None:
    cfg = dataclasses.replace(k2_config(), **changes)
    with pytest.raises(RequestError, match=f"ranks 8 does not divide the config's {field}"):
        shard_layout(cfg, Shard(0, 8))


@pytest.mark.parametrize("rank, ranks", [(0, 0), (2, 2), (-1, 2), (True, 2)])
def test_bad_shards_are_refused(rank: object, ranks: object) -> None:
    with pytest.raises(RequestError, match="rank"):
        Shard(rank, ranks)  # type: ignore[arg-type]


def test_slices_cover_every_tensor_once(tiny: ReferenceModel) -> None:
    cfg, weights = tiny.config, tiny._weights
    layouts = [shard_layout(cfg, Shard(r, 4)) for r in range(4)]
    for name, full in weights.items():
        parts = [shard_tensor(name, full, cfg, layout) for layout in layouts]
        if ".mlp.experts." in name:
            expert = int(name.split(".mlp.experts.")[1].split(".")[0])
            assert sum(lo.first_expert <= expert < lo.first_expert + lo.experts for lo in layouts) == 1
        elif name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            np.testing.assert_array_equal(np.concatenate(parts, axis=1), full)
        elif parts[0].shape != full.shape:
            np.testing.assert_array_equal(np.concatenate(parts, axis=0), full)
        else:
            for part in parts:
                np.testing.assert_array_equal(part, full)


def test_runtime_layout_agrees() -> None:
    native = pytest.importorskip("ddtree._native", reason="the native module is not built")
    for cfg in (preset_config("tiny"), preset_config("small"), k2_config()):
        for ranks in (1, 2, 4, 8):
            for rank in range(ranks):
                try:
                    expected = dataclasses.asdict(shard_layout(cfg, Shard(rank, ranks)))
                except RequestError as err:
                    with pytest.raises(ValueError) as refused:
                        native.shard_layout(engine_dims(cfg), rank, ranks)
                    assert str(refused.value) == str(err)
                    continue
                assert native.shard_layout(engine_dims(cfg), rank, ranks) == expected


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_sharded_forward_matches_the_whole_model(tiny: ReferenceModel, ranks: int) -> None:
    sharded = ShardedReference(tiny, ranks)
    prompt, positions = [5, 17, 300, 2, 9, 41], np.arange(6)
    whole_cache, rank_cache = tiny.new_cache(), tiny.new_cache()
    whole = tiny.forward(prompt, positions, whole_cache).logits
    parts = sharded.forward(prompt, positions, rank_cache)
    assert [p.shape[1] for p in parts] == [tiny.config.vocab_size // ranks] * ranks
    np.testing.assert_allclose(np.concatenate(parts, axis=1), whole, rtol=0, atol=2e-5 * np.abs(whole).max())
    step_whole = tiny.forward([77], [6], whole_cache).logits  # a decode step over the cached rows
    step = np.concatenate(sharded.forward([77], [6], rank_cache), axis=1)
    np.testing.assert_allclose(step, step_whole, rtol=0, atol=2e-5 * np.abs(step_whole).max())


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_the_cross_rank_pick_is_exact(ranks: int, temperature: float) -> None:
    rng = np.random.default_rng(ranks)
    logits = rng.standard_normal((40, 512)).astype(np.float32)
    logits[3, [17, 400]] = 9.0         # a tie across ranks goes to the lower id
    logits[5, :] = -np.inf             # no finite value: token 0
    logits[6, 100:] = np.nan           # NaN never wins
    positions = np.arange(40) + 100
    width = 512 // ranks
    candidates = [rank_candidates(logits[:, r * width:(r + 1) * width], r * width, temperature, 11, 2, positions)
                  for r in range(ranks)]
    expected = target_choices(logits, temperature, 11, 2, positions)
    np.testing.assert_array_equal(pick_across_ranks(candidates), expected)
    if temperature == 0:
        assert pick_across_ranks(candidates)[3] == 17


def test_the_pick_takes_int32_ids() -> None:
    """Ids as the runtime's candidates hold them (int32): the sentinel of the tie-break must not wrap."""
    values = [np.array([1.0, 2.0, -np.inf], np.float32), np.array([1.0, 3.0, -np.inf], np.float32)]
    ids = [np.array([5, 7, 1], np.int32), np.array([4, 9, 2], np.int32)]
    np.testing.assert_array_equal(pick_across_ranks(list(zip(values, ids))), [4, 9, 0])


def test_sharded_greedy_tokens_equal_the_whole_model(tiny: ReferenceModel) -> None:
    sharded = ShardedReference(tiny, 2)
    cache = tiny.new_cache()
    tokens, ids, position = [], [1, 2, 3], 0
    for _ in range(6):
        parts = sharded.forward(ids, np.arange(position, position + len(ids)), cache)
        token = int(sharded.pick([p[-1:] for p in parts], 0.0, 0, 0, [position + len(ids) - 1])[0])
        position += len(ids)
        tokens.append(token)
        ids = [token]
    assert tokens == tiny.greedy_generate([1, 2, 3], 6)


class _RecordingNative:
    """Stands in for ddtree._native.Engine: records what the loader uploads to each held rank."""

    def __init__(self, held_ranks: list[int]) -> None:
        self.held_ranks = held_ranks
        self.tensors: dict[tuple[int, str], np.ndarray] = {}
        self.experts: dict[int, set[tuple[int, int]]] = {r: set() for r in held_ranks}

    def upload(self, name: str, array: np.ndarray, rank: int) -> None:
        self.tensors[(rank, name)] = np.array(array)

    def upload_expert(self, layer: int, expert: int, *parts_and_rank: object) -> None:
        self.experts[parts_and_rank[-1]].add((layer, expert))  # type: ignore[index]

    def missing(self) -> str:
        return ""


@pytest.mark.parametrize("held", [[1], [0, 1]])
def test_the_loader_uploads_each_rank_its_slice(tiny_model_dir, held: list[int]) -> None:
    from ddtree.checkpoint import open_checkpoint
    from ddtree.engine import Engine

    checkpoint = open_checkpoint(tiny_model_dir)
    cfg = checkpoint.config
    engine = Engine.__new__(Engine)
    engine.config, engine.shard, engine._native = cfg, Shard(held[0], 2), _RecordingNative(held)
    engine._upload(checkpoint)
    for rank in held:
        layout = shard_layout(cfg, Shard(rank, 2))
        q_b = engine._native.tensors[(rank, "model.layers.0.self_attn.q_b_proj.weight")]
        assert q_b.shape[0] == layout.heads * cfg.qk_head_dim
        np.testing.assert_array_equal(engine._native.tensors[(rank, "lm_head.weight")],
                                      checkpoint["lm_head.weight"][rank * 256:(rank + 1) * 256])
        down = engine._native.tensors[(rank, "model.layers.0.mlp.down_proj.weight")]
        np.testing.assert_array_equal(down, checkpoint["model.layers.0.mlp.down_proj.weight"][:, rank * 80:
                                                                                                (rank + 1) * 80])
        owned = {e for _, e in engine._native.experts[rank]}
        assert owned == set(range(layout.first_expert, layout.first_expert + layout.experts))


def test_k2_rank_fits_one_h200() -> None:
    native = pytest.importorskip("ddtree._native", reason="the native module is not built")
    plan = native.plan_memory(engine_dims(k2_config()), 7, 8, 1, 16, 4096, 0)
    assert 72 << 30 < plan["weights"] < 74 << 30  # rank 7 of 8: 48 experts x 60 layers + an eighth of the rest
    assert plan["total"] + (1 << 30) < 139 << 30  # the pre-flight's headroom on an H200's 139.8 GiB
    whole = native.plan_memory(engine_dims(k2_config()), 0, 1, 1, 16, 4096, 0)
    assert whole["weights"] > 7 * plan["weights"]


def test_the_engine_refuses_a_bad_split_before_the_device() -> None:
    from ddtree.engine import Engine

    cfg = preset_config("tiny")
    with pytest.raises(RequestError, match="ranks 3 does not divide the config's num_attention_heads"):
        Engine.random(cfg, streams=1, max_context=64, shard=Shard(0, 3))
    with pytest.raises(RequestError, match="shard must be a ddtree.shard.Shard"):
        Engine.random(cfg, streams=1, max_context=64, shard=2)  # type: ignore[arg-type]


def test_a_rank_width_the_kernels_do_not_take_is_refused() -> None:
    native = pytest.importorskip("ddtree._native", reason="the native module is not built")
    with pytest.raises(ValueError, match="ranks 8 leaves 36 columns of the config's moe_intermediate_size per rank"):
        native.plan_memory(engine_dims(preset_config("small")), 0, 8, 1, 1, 64, 0)
    assert native.plan_memory(engine_dims(preset_config("small")), 3, 4, 1, 1, 64, 0)["total"] > 0
