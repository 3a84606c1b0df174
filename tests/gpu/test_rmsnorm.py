"""RMSNorm kernels against an fp32 torch reference, plus bitwise batch invariance."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
kernels = pytest.importorskip("ddtree._native", exc_type=ImportError).kernels

POISON = float("nan")


def _ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).bfloat16()


@pytest.mark.parametrize("rows,dim", [(1, 7168), (3, 1536), (17, 512), (33, 111), (257, 7168)])
def test_rmsnorm_matches_fp32_reference(rows: int, dim: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows * 1000 + dim)
    x = torch.randn(rows, dim, device="cuda", generator=g).bfloat16() * 3
    w = (torch.rand(dim, device="cuda", generator=g) + 0.5).bfloat16()
    out = torch.full_like(x, POISON)
    kernels.rmsnorm(out, x, w, 1e-6)
    torch.cuda.synchronize()
    ref = _ref(x, w, 1e-6)
    # one bf16 rounding of the same fp32 value: at most one ulp apart
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("rows,dim", [(5, 7168), (64, 512)])
def test_add_rmsnorm_matches_unfused(rows: int, dim: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(7)
    res = torch.randn(rows, dim, device="cuda", generator=g).bfloat16()
    delta = torch.randn(rows, dim, device="cuda", generator=g).bfloat16()
    w = (torch.rand(dim, device="cuda", generator=g) + 0.5).bfloat16()
    expect_res = (res.float() + delta.float()).bfloat16()
    out = torch.full_like(res, POISON)
    kernels.add_rmsnorm(out, res, delta, w, 1e-5)
    torch.cuda.synchronize()
    assert torch.equal(res, expect_res)
    torch.testing.assert_close(out.float(), _ref(expect_res, w, 1e-5).float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("rows,dim", [(3, 7168), (5, 111), (2, 16384)])
def test_add_two_deltas_rmsnorm(rows: int, dim: int) -> None:
    # the engine's layer input: residual + attention or MLP output + routed-expert output, one rounding
    g = torch.Generator(device="cuda").manual_seed(dim)
    res, d1, d2 = (torch.randn(rows, dim, device="cuda", generator=g).bfloat16() for _ in range(3))
    w = (torch.rand(dim, device="cuda", generator=g) + 0.5).bfloat16()
    expect_res = ((res.float() + d1.float()) + d2.float()).bfloat16()
    out = torch.full_like(res, POISON)
    kernels.add_rmsnorm(out, res, d1, w, 1e-6, delta2=d2)
    torch.cuda.synchronize()
    assert torch.equal(res, expect_res)
    torch.testing.assert_close(out.float(), _ref(expect_res, w, 1e-6).float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("dim", [1536, 7168])
def test_rmsnorm_unaligned_rows_same_bits(dim: int) -> None:
    # Rows 2 bytes off 16-byte alignment take the element-wise loads; the sum order is the same by construction.
    g = torch.Generator(device="cuda").manual_seed(dim + 1)
    x = torch.randn(4, dim, device="cuda", generator=g).bfloat16()
    w = torch.randn(dim, device="cuda", generator=g).bfloat16()
    aligned = torch.full_like(x, POISON)
    kernels.rmsnorm(aligned, x, w, 1e-6)
    storage = torch.full((4 * dim + 1,), POISON, device="cuda", dtype=torch.bfloat16)
    x_off = storage[1:].view(4, dim)
    x_off.copy_(x)
    out_off = torch.full((4 * dim + 1,), POISON, device="cuda", dtype=torch.bfloat16)[1:].view(4, dim)
    kernels.rmsnorm(out_off, x_off, w, 1e-6)
    torch.cuda.synchronize()
    assert torch.equal(out_off, aligned)


def test_rmsnorm_batch_invariant() -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(16, 7168, device="cuda", generator=g).bfloat16()
    w = torch.randn(7168, device="cuda", generator=g).bfloat16()
    full = torch.full_like(x, POISON)
    kernels.rmsnorm(full, x, w, 1e-6)
    for r in (0, 5, 15):
        alone = torch.full_like(x[r : r + 1], POISON)
        kernels.rmsnorm(alone, x[r : r + 1].contiguous(), w, 1e-6)
        assert torch.equal(alone, full[r : r + 1])


def test_rmsnorm_rejects_bad_arguments() -> None:
    x = torch.randn(4, 64, device="cuda").bfloat16()
    w = torch.ones(64, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="'weight'"):
        kernels.rmsnorm(torch.empty_like(x), x, w[:32].contiguous(), 1e-6)
    with pytest.raises(ValueError, match="'x' must be bfloat16"):
        kernels.rmsnorm(torch.empty_like(x), x.float(), w, 1e-6)
    wide = torch.randn(1, 16392, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="'x' has rows of 16392 elements"):
        kernels.rmsnorm(torch.empty_like(wide), wide, torch.ones(16392, device="cuda").bfloat16(), 1e-6)
