"""YaRN RoPE for MLA queries and the latent KV store, against the numpy reference (ddtree.reference)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
kernels = pytest.importorskip("ddtree._native", exc_type=ImportError).kernels
from ddtree.presets import preset_config  # noqa: E402
from ddtree.reference.layers import rms_norm  # noqa: E402
from ddtree.reference.rope import Rope  # noqa: E402

POISON = float("nan")


def _rope(preset: str) -> tuple[Rope, torch.Tensor]:
    cfg = preset_config(preset, 1 if preset == "k2-layers" else None)
    rope = Rope.from_config(cfg)
    return rope, torch.from_numpy(rope.inv_freq).cuda()


def _close_to_reference(out: torch.Tensor, ref: np.ndarray) -> None:
    # one bf16 rounding of values whose fp32 cos/sin may differ in the last bits
    ref_t = torch.from_numpy(ref).cuda()
    torch.testing.assert_close(out.float(), ref_t, rtol=2**-7, atol=2e-3 * ref_t.abs().max().item())


@pytest.mark.parametrize("preset,heads,rows", [("tiny", 4, 5), ("k2-layers", 64, 3), ("small", 8, 17)])
def test_rope_queries_match_reference(preset: str, heads: int, rows: int) -> None:
    rope, inv_freq = _rope(preset)
    d = 2 * inv_freq.numel()
    nope = 2 * d  # query layout [nope | rope] per head, as q_b_proj writes it
    g = torch.Generator(device="cuda").manual_seed(rows)
    q = torch.randn(rows, heads, nope + d, device="cuda", generator=g).bfloat16()
    positions = torch.tensor([0, 1, 4095, 70000, 262143][:rows] + [7] * max(0, rows - 5), device="cuda",
                             dtype=torch.int32)
    out = torch.full((rows, heads, 3 * d), POISON, device="cuda", dtype=torch.bfloat16)
    kernels.rope_queries(out, d, q, nope, positions, inv_freq, rope.attention_factor, rope.interleave)
    torch.cuda.synchronize()
    cos, sin = rope.cos_sin(positions.cpu().numpy())
    ref = rope.apply(q[..., nope:].float().cpu().numpy(), cos, sin)
    _close_to_reference(out[..., d:2 * d], ref)
    assert out[..., :d].isnan().all() and out[..., 2 * d:].isnan().all()  # nothing written outside the slice


@pytest.mark.parametrize("preset,rows", [("tiny", 3), ("k2-layers", 16)])
def test_mla_store_kv_matches_reference(preset: str, rows: int) -> None:
    rope, inv_freq = _rope(preset)
    cfg = preset_config(preset, 1 if preset == "k2-layers" else None)
    lora, d = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    g = torch.Generator(device="cuda").manual_seed(9)
    kv_a = (torch.randn(rows, lora + d, device="cuda", generator=g) * 2).bfloat16()
    norm = (1 + 0.1 * torch.randn(lora, device="cuda", generator=g)).bfloat16()
    positions = torch.arange(rows, device="cuda", dtype=torch.int32) * 37
    slots = torch.randperm(4 * rows, device="cuda", generator=g)[:rows].to(torch.int32)
    cache = torch.full((4 * rows, lora + d), POISON, device="cuda", dtype=torch.bfloat16)
    kernels.mla_store_kv(cache, slots, kv_a, norm, 1e-6, positions, inv_freq, rope.attention_factor, rope.interleave)
    torch.cuda.synchronize()
    a = kv_a.float().cpu().numpy()
    cos, sin = rope.cos_sin(positions.cpu().numpy())
    ref = np.concatenate([rms_norm(a[:, :lora], norm.float().cpu().numpy(), 1e-6), rope.apply(a[:, lora:], cos, sin)],
                         axis=1)
    _close_to_reference(cache[slots.long()], ref)
    untouched = torch.ones(4 * rows, dtype=torch.bool, device="cuda")
    untouched[slots.long()] = False
    assert cache[untouched].isnan().all()
