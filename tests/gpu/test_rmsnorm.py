"""RMSNorm kernels against an fp32 torch reference, plus bitwise batch invariance."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from ddtree._native import kernels  # noqa: E402

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
