"""Fused INT4 MoE (ddtree._native.moe.MoeLayer) against an fp32 torch reference built from the dequantized
weights; bit-exact device dequantization; the device repack equal to the host's; bitwise batch invariance; expert
masks; skewed routing; CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from ddtree import bf16  # noqa: E402
moe = pytest.importorskip("ddtree._native", exc_type=ImportError).moe
from ddtree.presets import K2_ROUTED_SCALING_FACTOR as RSF  # noqa: E402

POISON = float("nan")
TOPK = 8


@dataclass
class Experts:
    """Checkpoint-format experts, their dequantized fp32 weights on the device, and a MoeLayer holding them."""

    layer: moe.MoeLayer
    w13: torch.Tensor  # fp32 [E, 2I, H] = bf16((q - 8) * s), gate rows then up rows
    w2: torch.Tensor  # fp32 [E, H, I]
    inter: int


def _projection(rng: np.random.Generator, experts: int, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    packed = rng.integers(-(2**31), 2**31, size=(experts, rows, cols // 8), dtype=np.int64).astype(np.int32)
    # scales of both signs around 1/sqrt(cols) keep activations O(1); bf16 bit patterns for the repack
    mag = (rng.uniform(0.5, 1.5, size=(experts, rows, cols // 32)) / np.sqrt(cols) / 4).astype(np.float32)
    sign = np.where(rng.random(mag.shape) < 0.2, -1.0, 1.0).astype(np.float32)
    return packed, bf16.from_float32(mag * sign)


def _dequant(packed: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    words = torch.from_numpy(packed.view(np.uint32).astype(np.int64)).cuda()
    q = (words[..., None] >> (4 * torch.arange(8, device="cuda"))) & 0xF
    q = q.reshape(*packed.shape[:-1], -1).float()
    s = torch.from_numpy(scale.view(np.int16)).cuda().view(torch.bfloat16).float().repeat_interleave(32, -1)
    return ((q - 8) * s).bfloat16()


def make_experts(experts: int, hidden: int, inter: int, max_tokens: int, seed: int) -> Experts:
    rng = np.random.default_rng(seed)
    gate = _projection(rng, experts, inter, hidden)
    up = _projection(rng, experts, inter, hidden)
    down = _projection(rng, experts, hidden, inter)
    layer = moe.MoeLayer(experts, hidden, inter, TOPK, max_tokens, RSF)
    layer.set_experts(0, moe.repack_w13(*gate, *up), moe.repack_w2(*down))
    w13 = torch.cat([_dequant(*gate), _dequant(*up)], dim=1)
    w2 = _dequant(*down)
    # the kernel's own dequantization must be bit-identical to bf16((q - 8) * s)
    got13 = torch.full_like(w13, POISON)
    layer.dequantize_w13(got13)
    assert torch.equal(got13.view(torch.int16), w13.view(torch.int16))
    got2 = torch.full_like(w2, POISON)
    layer.dequantize_w2(got2)
    assert torch.equal(got2.view(torch.int16), w2.view(torch.int16))
    return Experts(layer, w13.float(), w2.float(), inter)


def reference(ex: Experts, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, mask: torch.Tensor | None,
              round_bf16: bool) -> torch.Tensor:
    """fp32 MoE; with round_bf16 the intermediate SiLU(gate) * up and the output are rounded to bf16 as the
    kernel does, which measures the reference's own bf16 error."""
    m, h = x.shape
    out = torch.zeros(m, h, device="cuda")
    experts = ex.w13.shape[0]
    used = (ids >= 0) & (ids < experts)
    if mask is not None:
        used &= mask.bool()[ids.clamp(0, experts - 1)]
    for e in torch.unique(ids[used]).tolist():
        tok, slot = torch.nonzero((ids == e) & used, as_tuple=True)
        gu = x[tok].float() @ ex.w13[e].T
        act = torch.nn.functional.silu(gu[:, : ex.inter]) * gu[:, ex.inter :]
        if round_bf16:
            act = act.bfloat16().float()
        y = act @ ex.w2[e].T
        out.index_add_(0, tok, y * (wts[tok, slot] * RSF)[:, None])
    return out.bfloat16().float() if round_bf16 else out


def routing(m: int, experts: int, gen: torch.Generator, skew: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if skew:  # every token picks the same 8 hot experts, in its own order
        ids = torch.stack([torch.randperm(TOPK, device="cuda", generator=gen) for _ in range(m)]).int()
    else:
        ids = torch.rand(m, experts, device="cuda", generator=gen).topk(TOPK, dim=1).indices.int()
    wts = torch.rand(m, TOPK, device="cuda", generator=gen) + 0.05
    return ids, wts / wts.sum(1, keepdim=True)


def run(ex: Experts, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, mask: torch.Tensor | None = None):
    out = torch.full_like(x, POISON)
    ex.layer.forward(out, x, ids, wts, mask)
    torch.cuda.synchronize()
    return out


def assert_matches_reference(ex, x, ids, wts, mask=None) -> torch.Tensor:
    out = run(ex, x, ids, wts, mask)
    assert torch.isfinite(out).all()
    exact = reference(ex, x, ids, wts, mask, round_bf16=False)
    own = (reference(ex, x, ids, wts, mask, round_bf16=True) - exact).abs().max().item()
    err = (out.float() - exact).abs().max().item()
    # the kernel rounds at the same two places as the bf16 reference; allow twice that reference's error
    assert err <= 2 * own + 1e-6 * exact.abs().max().item(), (err, own)
    return out


@pytest.fixture(scope="module")
def small() -> Experts:
    return make_experts(experts=40, hidden=640, inter=384, max_tokens=1000, seed=1)


@pytest.mark.parametrize("m", [1, 3, 9, 33, 90, 256, 1000])
def test_matches_fp32_reference(small: Experts, m: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 640, device="cuda", generator=gen).bfloat16()
    ids, wts = routing(m, 40, gen)
    assert_matches_reference(small, x, ids, wts)


@pytest.mark.parametrize("m", [70, 1000])
def test_skewed_routing(small: Experts, m: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(100 + m)
    x = torch.randn(m, 640, device="cuda", generator=gen).bfloat16()
    ids, wts = routing(m, 40, gen, skew=True)  # 8 experts with m tokens each: full and tail blocks
    assert_matches_reference(small, x, ids, wts)


def test_masked_and_invalid_experts_are_skipped(small: Experts) -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    m = 57
    x = torch.randn(m, 640, device="cuda", generator=gen).bfloat16()
    ids, wts = routing(m, 40, gen)
    ids[3, 2] = -1  # an id that no GPU owns
    ids[4, 0] = 40
    mask = (torch.rand(40, device="cuda", generator=gen) < 0.5).to(torch.uint8)
    ids[7] = torch.nonzero(mask == 0).flatten()[:TOPK].int()  # token 7 has only remote experts: output 0
    out = assert_matches_reference(small, x, ids, wts, mask)
    assert torch.equal(out[7], torch.zeros_like(out[7]))


def test_decode_size_calls_align_in_the_gemms(small: Experts) -> None:
    # At most 32 (token, slot) pairs the GEMM CTAs align the routing themselves (no moe_align launch); such calls
    # must skip the same pairs and give the same bits as the same tokens inside a larger call.
    gen = torch.Generator(device="cuda").manual_seed(17)
    m = 12
    x = torch.randn(m, 640, device="cuda", generator=gen).bfloat16()
    ids, wts = routing(m, 40, gen)
    ids[0, 1] = ids[0, 0]  # one expert twice in a token: two columns of one block
    ids[1, 2] = -1
    ids[1, 5] = 40
    mask = torch.ones(40, dtype=torch.uint8, device="cuda")
    mask[::3] = 0
    ids[2] = torch.nonzero(mask == 0).flatten()[:TOPK].int()  # only remote experts: output 0
    full = assert_matches_reference(small, x, ids, wts, mask)
    for rows in ((0, 1), (0, 1, 2, 3), (2,), (5,), (11, 4, 7, 1)):  # 32 pairs at most
        sub = torch.tensor(rows, device="cuda")
        part = assert_matches_reference(small, x[sub].contiguous(), ids[sub].contiguous(), wts[sub].contiguous(), mask)
        assert torch.equal(part, full[sub]), rows
    assert torch.equal(full[2], torch.zeros_like(full[2]))


def test_masked_experts_weights_are_never_read() -> None:
    ex = make_experts(experts=16, hidden=256, inter=128, max_tokens=64, seed=9)
    gen = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(64, 256, device="cuda", generator=gen).bfloat16()
    ids, wts = routing(64, 16, gen)
    mask = torch.ones(16, dtype=torch.uint8, device="cuda")
    mask[::3] = 0
    before = run(ex, x, ids, wts, mask)
    w13_bytes, w2_bytes = moe.repacked_bytes(256, 128)
    remote = torch.nonzero(mask == 0).flatten().tolist()
    for e in remote:  # all-ones bytes: NaN scales wherever a masked expert would be read
        ex.layer.set_experts(e, np.full((1, w13_bytes), 0xFF, np.uint8), np.full((1, w2_bytes), 0xFF, np.uint8))
    after = run(ex, x, ids, wts, mask)
    assert torch.equal(before, after)
    assert torch.isfinite(after).all()


@pytest.mark.parametrize("m", [300, 1000])
def test_batch_invariance_bitwise(small: Experts, m: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(m, 640, device="cuda", generator=gen).bfloat16()
    ids, wts = routing(m, 40, gen)
    ids[:100] = routing(100, 40, gen, skew=True)[0]  # hot experts: > 64 tokens, several blocks
    full = run(small, x, ids, wts)
    for r in (0, 1, 99, 150, 299):
        alone = run(small, x[r : r + 1].contiguous(), ids[r : r + 1].contiguous(), wts[r : r + 1].contiguous())
        assert torch.equal(alone, full[r : r + 1]), r
    sub = torch.tensor([5, 99, 100, 101, 250, 299], device="cuda")
    part = run(small, x[sub].contiguous(), ids[sub].contiguous(), wts[sub].contiguous())
    assert torch.equal(part, full[sub])
    again = run(small, x, ids, wts)
    assert torch.equal(again, full)


def test_two_stripe_units_match_reference_and_lone_rows() -> None:
    # 8 stripes per expert in both GEMMs: at m = 90 and 128 the 64 experts' blocks give enough units for the GEMMs
    # to run two stripes per unit on an H200-size grid; a lone row has too few units and runs one stripe per unit.
    # Both must give the same bits.
    ex = make_experts(experts=64, hidden=1024, inter=512, max_tokens=128, seed=13)
    gen = torch.Generator(device="cuda").manual_seed(13)
    for m in (90, 128):
        x = torch.randn(m, 1024, device="cuda", generator=gen).bfloat16()
        ids, wts = routing(m, 64, gen)
        full = assert_matches_reference(ex, x, ids, wts)
        for r in (0, m // 2, m - 1):
            alone = run(ex, x[r : r + 1].contiguous(), ids[r : r + 1].contiguous(), wts[r : r + 1].contiguous())
            assert torch.equal(alone, full[r : r + 1]), (m, r)


def test_cuda_graph_capture_and_replay(small: Experts) -> None:
    gen = torch.Generator(device="cuda").manual_seed(21)
    m = 33
    x = torch.randn(m, 640, device="cuda", generator=gen).bfloat16()
    ids, wts = routing(m, 40, gen)
    out = torch.full_like(x, POISON)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture
        small.layer.forward(out, x, ids, wts, None, stream.cuda_stream)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        small.layer.forward(out, x, ids, wts, None, torch.cuda.current_stream().cuda_stream)
    new_x = torch.randn(m, 640, device="cuda", generator=gen).bfloat16()
    new_ids, new_wts = routing(m, 40, gen)
    x.copy_(new_x)
    ids.copy_(new_ids)
    wts.copy_(new_wts)
    out.fill_(POISON)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run(small, new_x, new_ids, new_wts))


@pytest.mark.parametrize("experts,hidden,inter", [(3, 256, 384), (2, 384, 128)])
def test_device_repack_equals_host_repack(experts: int, hidden: int, inter: int) -> None:
    rng = np.random.default_rng(11)
    gate, up = _projection(rng, experts, inter, hidden), _projection(rng, experts, inter, hidden)
    down = _projection(rng, experts, hidden, inter)

    def on_device(packed: np.ndarray, scale: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(packed).cuda(), torch.from_numpy(scale.view(np.int16)).cuda().view(torch.bfloat16)

    want13, want2 = moe.repack_w13(*gate, *up), moe.repack_w2(*down)
    got13 = torch.full(want13.shape, 0xA5, dtype=torch.uint8, device="cuda")  # poison
    got2 = torch.full(want2.shape, 0xA5, dtype=torch.uint8, device="cuda")
    moe.repack_w13_on_device(got13, *on_device(*gate), *on_device(*up))
    moe.repack_w2_on_device(got2, *on_device(*down))
    assert np.array_equal(got13.cpu().numpy(), want13)
    assert np.array_equal(got2.cpu().numpy(), want2)
    with pytest.raises(ValueError, match="up_scale"):
        moe.repack_w13_on_device(got13, *on_device(*gate), on_device(*up)[0],
                                 on_device(*up)[1][:, :-1].contiguous())


def test_k2_shape() -> None:
    ex = make_experts(experts=10, hidden=7168, inter=2048, max_tokens=64, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for m, skew in ((1, False), (9, False), (64, True)):
        x = torch.randn(m, 7168, device="cuda", generator=gen).bfloat16()
        ids, wts = routing(m, 10, gen, skew=skew)
        full = assert_matches_reference(ex, x, ids, wts)
        alone = run(ex, x[-1:].contiguous(), ids[-1:].contiguous(), wts[-1:].contiguous())
        assert torch.equal(alone, full[-1:])


def test_forward_rejects_bad_arguments() -> None:
    layer = moe.MoeLayer(8, 128, 128, TOPK, 16, RSF)
    x = torch.randn(4, 128, device="cuda").bfloat16()
    ids = torch.zeros(4, TOPK, dtype=torch.int32, device="cuda")
    wts = torch.ones(4, TOPK, device="cuda")
    out = torch.empty_like(x)
    with pytest.raises(ValueError, match="'topk_ids' must be int32"):
        layer.forward(out, x, ids.long(), wts)
    with pytest.raises(ValueError, match="'topk_weights' has shape"):
        layer.forward(out, x, ids, wts[:, :4].contiguous())
    with pytest.raises(ValueError, match="'expert_mask' has shape"):
        layer.forward(out, x, ids, wts, torch.ones(7, dtype=torch.uint8, device="cuda"))
    big = torch.randn(17, 128, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="max_tokens=16"):
        layer.forward(torch.empty_like(big), big, ids, wts)
