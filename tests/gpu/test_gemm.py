"""Weight-streaming bf16 GEMM against an fp32 torch reference; bitwise batch invariance."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
kernels = pytest.importorskip("ddtree._native", exc_type=ImportError).kernels

POISON = float("nan")


def _scratch(m: int, n: int, k: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    ws = torch.empty(max(1, kernels.gemm_workspace_floats(m, n, k, batch)), device="cuda", dtype=torch.float32)
    counters = torch.zeros(kernels.gemm_counter_count(n, batch), device="cuda", dtype=torch.int32)
    return ws, counters


def _inputs(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
    return x, w


def _run(x: torch.Tensor, w: torch.Tensor, epilogue: str, out_cols: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((x.shape[0], out_cols), POISON, device="cuda", dtype=dtype)
    ws, counters = _scratch(x.shape[0], w.shape[0], x.shape[1])
    kernels.gemm(out, x, w, epilogue, ws, counters)
    torch.cuda.synchronize()
    return out


def _tolerance(ref: torch.Tensor, k: int) -> float:
    # fp32 sums in a different order: a few ulp of the magnitude of the terms, plus one bf16 rounding of the result
    return 2**-7 * ref.abs().max().item() + 1e-5 * k**0.5


# (m, n, k): every token tiling (<= 8, <= 16, <= 32, <= 64 and several passes of 64), N not a multiple of the
# 16/32-row tiles, K below, between and not a multiple of the 512-column chunks, K <= 128 and not a multiple of
# 32 (the short-K kernel), K2 shapes that take the split-K path (small N, large K), and q_b at 12 rows (16-row
# tiles with a two-stage ring, where 32-row tiles would leave most of a second wave idle), and 64-token tiles over
# several token passes with K unsplit in one chunk, a one-stage ring (prefill's q_b and o_proj on `small`).
SHAPES = [(1, 2112, 7168), (3, 100, 200), (16, 576, 7168), (17, 1000, 328), (64, 384, 7168), (100, 264, 1536),
          (5, 12288, 1536), (12, 12288, 1536), (9, 7168, 2048), (33, 40, 1064), (130, 48, 520), (70, 96, 48),
          (3, 40, 16), (70, 200, 320)]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gemm_matches_fp32(m: int, n: int, k: int) -> None:
    x, w = _inputs(m, n, k, m * 7 + n)
    ref = x.float() @ w.float().T
    out = _run(x, w, "f32", n, torch.float32)
    torch.testing.assert_close(out, ref, rtol=0, atol=_tolerance(ref, k))
    out_bf16 = _run(x, w, "bf16", n, torch.bfloat16)
    torch.testing.assert_close(out_bf16.float(), ref, rtol=2**-7, atol=_tolerance(ref, k))


@pytest.mark.parametrize("m,inter,k", [(1, 2048, 7168), (7, 168, 64), (33, 288, 1024)])
def test_gemm_silu_mul_interleaved(m: int, inter: int, k: int) -> None:
    x, gate = _inputs(m, inter, k, 1)
    _, up = _inputs(m, inter, k, 2)
    # the engine's layout: blocks of 8 gate rows then the 8 matching up rows
    w = torch.stack([gate.view(inter // 8, 8, k), up.view(inter // 8, 8, k)], dim=1).reshape(2 * inter, k)
    g, u = x.float() @ gate.float().T, x.float() @ up.float().T
    ref = torch.nn.functional.silu(g) * u
    out = _run(x, w.contiguous(), "silu_mul", inter, torch.bfloat16)
    torch.testing.assert_close(out.float(), ref, rtol=2**-6, atol=_tolerance(ref, k) * 4)


def test_gemm_batched_heads() -> None:
    m, heads, n, k = 5, 8, 512, 128  # the absorbed q_nope . W_UK shape, heads as the batch
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(m, heads, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(heads, n, k, device="cuda", generator=g) / k**0.5).bfloat16()
    out = torch.full((m, heads, n), POISON, device="cuda", dtype=torch.bfloat16)
    ws, counters = _scratch(m, n, k, heads)
    kernels.gemm(out, x, w, "bf16", ws, counters)
    torch.cuda.synchronize()
    ref = torch.einsum("mhk,hnk->mhn", x.float(), w.float())
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=_tolerance(ref, k))


@pytest.mark.parametrize("n,k", [(2112, 7168), (384, 7168), (7168, 8192), (12288, 1536), (333, 96), (100, 48)])
def test_gemm_batch_invariant(n: int, k: int) -> None:
    # 130 rows: three passes of the 64-token kernel, against every smaller tiling of the same rows
    x, w = _inputs(130, n, k, 11)
    full = _run(x, w, "f32", n, torch.float32)
    for rows in (1, 9, 16, 33, 64, 100):
        for start in (0, 5, 130 - rows):
            part = _run(x[start:start + rows].contiguous(), w, "f32", n, torch.float32)
            assert torch.equal(part, full[start:start + rows]), (rows, start)
    # replays reuse the self-resetting split counters: same bits again
    assert torch.equal(_run(x, w, "f32", n, torch.float32), full)


def test_gemm_dependent_chain_in_graph() -> None:
    """Dependent launches: each GEMM of a captured chain reads the previous one's output, so its start may
    overlap the previous kernel only up to the wait; replays give the eager, synchronised result."""
    m, n, k = 3, 1536, 1536
    x, w1 = _inputs(m, n, k, 21)
    _, w2 = _inputs(m, k, n, 22)
    ws, counters = _scratch(m, n, k)
    hops = [torch.full((m, n), POISON, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
    expected = [x]
    for i in range(6):
        expected.append(_run(expected[-1], w1 if i % 2 == 0 else w2, "bf16", n, torch.bfloat16))
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        kernels.use_stream(stream.cuda_stream)
        try:
            with torch.cuda.graph(graph, stream=stream):
                src = x
                for i, dst in enumerate(hops):
                    kernels.gemm(dst, src, w1 if i % 2 == 0 else w2, "bf16", ws, counters)
                    src = dst
        finally:
            kernels.use_stream(0)
    for _ in range(3):
        for h in hops:
            h.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(hops, expected[1:]):
            assert torch.equal(got, want)


def test_gemm_rejects_bad_arguments() -> None:
    x, w = _inputs(4, 64, 64, 0)
    ws, counters = _scratch(4, 64, 64)
    with pytest.raises(ValueError, match="'epilogue'"):
        kernels.gemm(torch.empty(4, 64, device="cuda", dtype=torch.bfloat16), x, w, "relu", ws, counters)
    with pytest.raises(ValueError, match="'out'"):
        kernels.gemm(torch.empty(4, 63, device="cuda", dtype=torch.bfloat16), x, w, "bf16", ws, counters)
    with pytest.raises(ValueError, match="'w'"):
        kernels.gemm(torch.empty(4, 64, device="cuda", dtype=torch.bfloat16), x, w[:, :32].contiguous(), "bf16", ws,
                     counters)
    flat = torch.empty(4 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    shifted = flat[1:].view(4, 64)  # contiguous, 2 bytes off a 16-byte boundary
    with pytest.raises(ValueError, match="16-byte"):
        kernels.gemm(torch.empty(4, 64, device="cuda", dtype=torch.bfloat16), shifted, w, "bf16", ws, counters)
