"""Host repack of compressed-tensors INT4 experts into the fused MoE layout (CPU only).

Two independent oracles: the native unpack walks the repacked bytes back to checkpoint order (and raises
unless every (row, col) and scale is hit exactly once), and a numpy re-implementation of the layout
documented in kernels/moe_marlin.cuh rebuilds the repacked bytes from scratch.
"""

from __future__ import annotations

import numpy as np
import pytest

moe = pytest.importorskip("ddtree._native", exc_type=ImportError).moe

STRIPE_ROWS, STAGE_K, GROUP = 128, 128, 32


def random_projection(rng: np.random.Generator, experts: int, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Checkpoint format: weight_packed int32 [E, rows, cols/8] (any bits), weight_scale bf16 bits [E, rows, cols/32]."""
    packed = rng.integers(-(2**31), 2**31, size=(experts, rows, cols // 8), dtype=np.int64).astype(np.int32)
    scale = rng.integers(0, 2**16, size=(experts, rows, cols // GROUP), dtype=np.uint16)
    return packed, scale


def unpack_checkpoint(packed: np.ndarray) -> np.ndarray:
    """q[e, row, col] = nibble col % 8 (LSB first) of packed[e, row, col // 8]."""
    words = packed.view(np.uint32)[..., None]
    shifts = (4 * np.arange(8, dtype=np.uint32))
    return ((words >> shifts) & 0xF).astype(np.uint8).reshape(*packed.shape[:-1], -1)


def tile_rows(stripes: int, gate_up: bool, inter: int) -> np.ndarray:
    """Checkpoint row of each (stripe, tile row) as documented in moe_marlin.cuh."""
    s, r = np.meshgrid(np.arange(stripes), np.arange(STRIPE_ROWS), indexing="ij")
    if not gate_up:
        return s * STRIPE_ROWS + r
    warp, rr = r // 16, r % 16
    f = s * (STRIPE_ROWS // 2) + warp * 8 + (rr & 7)
    return np.where(rr < 8, f, inter + f)


def layout_bytes(q: np.ndarray, scale: np.ndarray, gate_up: bool, inter: int) -> np.ndarray:
    """numpy rebuild of the repacked bytes [E, bytes] from q [E, rows, cols] and scale bits [E, rows, cols/32]."""
    experts, rows, cols = q.shape
    stripes, stages = rows // STRIPE_ROWS, cols // STAGE_K
    row_of = tile_rows(stripes, gate_up, inter)  # [S, 128]
    # weight word ((warp*2 + half)*32 + lane)*4 + j, nibble i
    warp, half, lane, j, nib = np.meshgrid(
        np.arange(8), np.arange(2), np.arange(32), np.arange(4), np.arange(8), indexing="ij"
    )
    g, t = lane // 4, lane % 4
    tile_row = warp * 16 + g + 8 * (nib & 1)
    col_in_stage = (half * 4 + j) * 16 + 2 * t + 8 * ((nib >> 1) & 1) + (nib >> 2)
    tile_row = tile_row.reshape(-1, 8)  # [2048 words, 8 nibbles]
    col_in_stage = col_in_stage.reshape(-1, 8)
    rows_idx = row_of[:, None, :][:, :, tile_row]  # [S, 1, 2048, 8]
    cols_idx = (np.arange(stages) * STAGE_K)[None, :, None, None] + col_in_stage[None, None]
    nibbles = q[:, rows_idx, cols_idx].astype(np.uint32)  # [E, S, stages, 2048, 8]
    words = (nibbles << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint64).astype(np.uint32)
    # scale entry ((warp*8 + g)*2 + hi)*4 + grp
    wg, hi, grp = np.meshgrid(np.arange(64), np.arange(2), np.arange(4), indexing="ij")
    s_tile_row = ((wg // 8) * 16 + wg % 8 + 8 * hi).reshape(-1)
    s_rows = row_of[:, None, :][:, :, s_tile_row]  # [S, 1, 512]
    s_cols = (np.arange(stages) * (STAGE_K // GROUP))[None, :, None] + grp.reshape(-1)[None, None]
    scales = scale[:, s_rows, s_cols]  # [E, S, stages, 512]
    parts = [np.ascontiguousarray(words).view(np.uint8), np.ascontiguousarray(scales).view(np.uint8)]
    stage_bytes = np.concatenate(parts, axis=-1)
    return stage_bytes.reshape(experts, -1)


@pytest.mark.parametrize("experts,hidden,inter", [(1, 128, 128), (3, 384, 256), (2, 256, 640)])
def test_w13_round_trip_and_layout(experts: int, hidden: int, inter: int) -> None:
    rng = np.random.default_rng(experts * 7919 + hidden + inter)
    gate_p, gate_s = random_projection(rng, experts, inter, hidden)
    up_p, up_s = random_projection(rng, experts, inter, hidden)
    repacked = moe.repack_w13(gate_p, gate_s, up_p, up_s)
    w13_bytes, _ = moe.repacked_bytes(hidden, inter)
    assert repacked.shape == (experts, w13_bytes)
    assert w13_bytes * 8 == 2 * inter * hidden * 4.5  # 4-bit weights + one bf16 scale per 32

    q, scale = moe.unpack_w13(repacked, hidden, inter)  # raises unless a bijection
    np.testing.assert_array_equal(q, np.concatenate([unpack_checkpoint(gate_p), unpack_checkpoint(up_p)], axis=1))
    np.testing.assert_array_equal(scale, np.concatenate([gate_s, up_s], axis=1))
    np.testing.assert_array_equal(repacked, layout_bytes(q, scale, gate_up=True, inter=inter))


@pytest.mark.parametrize("experts,hidden,inter", [(1, 128, 128), (4, 640, 384)])
def test_w2_round_trip_and_layout(experts: int, hidden: int, inter: int) -> None:
    rng = np.random.default_rng(experts * 104729 + hidden + inter)
    down_p, down_s = random_projection(rng, experts, hidden, inter)
    repacked = moe.repack_w2(down_p, down_s)
    assert repacked.shape == (experts, moe.repacked_bytes(hidden, inter)[1])
    q, scale = moe.unpack_w2(repacked, hidden, inter)
    np.testing.assert_array_equal(q, unpack_checkpoint(down_p))
    np.testing.assert_array_equal(scale, down_s)
    np.testing.assert_array_equal(repacked, layout_bytes(q, scale, gate_up=False, inter=inter))


def test_repack_rejects_bad_inputs() -> None:
    rng = np.random.default_rng(0)
    p, s = random_projection(rng, 2, 128, 256)
    with pytest.raises(ValueError, match="'down_scale'"):
        moe.repack_w2(p, s.astype(np.float32))
    with pytest.raises(ValueError, match="'down_scale' has shape"):
        moe.repack_w2(p, s[:, :, :4].copy())
    with pytest.raises(ValueError, match="'up_packed'"):
        moe.repack_w13(p, s, p[:1].copy(), s)
    odd_p, odd_s = random_projection(rng, 1, 96, 256)
    with pytest.raises(ValueError, match="multiples of 128"):
        moe.repack_w13(odd_p, odd_s, odd_p, odd_s)
    with pytest.raises(ValueError, match="multiples of 128"):  # checked before any CUDA call
        moe.MoeLayer(8, 640, 100, 8, 16, 2.827)
    with pytest.raises(ValueError, match="'repacked'"):
        moe.unpack_w2(np.zeros((1, 10), np.uint8), 128, 128)
