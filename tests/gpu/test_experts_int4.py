"""The plain INT4 routed-expert kernel (shapes the Marlin kernel does not take) against fp32 torch."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
kernels = pytest.importorskip("ddtree._native", exc_type=ImportError).kernels
from ddtree.reference import int4  # noqa: E402


def _quantized(experts: int, out_dim: int, in_dim: int, rng: np.random.Generator):
    packed, scales, dense = [], [], []
    for _ in range(experts):
        w = (rng.standard_normal((out_dim, in_dim)) / in_dim**0.5).astype(np.float32)
        q = int4.quantize_linear(w, 32)
        packed.append(q["weight_packed"])
        scales.append(q["weight_scale"])
        dense.append(int4.dequantize(q["weight_packed"], q["weight_scale"]))
    as_bf16 = torch.from_numpy(np.stack(scales).astype(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.stack(packed)).cuda(), as_bf16.cuda(), torch.from_numpy(np.stack(dense)).cuda()


@pytest.mark.parametrize("tokens,hidden,inter,experts,topk", [(3, 64, 32, 8, 3), (9, 1024, 288, 16, 8)])
def test_experts_int4_matches_fp32(tokens: int, hidden: int, inter: int, experts: int, topk: int) -> None:
    rng = np.random.default_rng(hidden)
    gp, gs, gd = _quantized(experts, inter, hidden, rng)
    up, us, ud = _quantized(experts, inter, hidden, rng)
    dp, ds, dd = _quantized(experts, hidden, inter, rng)
    x = torch.from_numpy(rng.standard_normal((tokens, hidden)).astype(np.float32)).cuda().bfloat16()
    ids = torch.from_numpy(np.stack([rng.permutation(experts)[:topk] for _ in range(tokens)]).astype(np.int32)).cuda()
    weights = torch.from_numpy(rng.random((tokens, topk)).astype(np.float32)).cuda()
    out = torch.full((tokens, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
    act = torch.empty(tokens * topk, inter, device="cuda", dtype=torch.bfloat16)
    kernels.experts_int4(out, act, x, ids, weights, 2.5, gp, gs, up, us, dp, ds)
    torch.cuda.synchronize()
    ref = torch.zeros(tokens, hidden, device="cuda")
    xf = x.float()
    for t in range(tokens):
        for k in range(topk):
            e = ids[t, k].item()
            h = torch.nn.functional.silu(gd[e] @ xf[t]) * (ud[e] @ xf[t])
            ref[t] += weights[t, k] * 2.5 * (dd[e] @ h.bfloat16().float())
    torch.testing.assert_close(out.float(), ref, rtol=2**-6, atol=2**-7 * ref.abs().max().item())
