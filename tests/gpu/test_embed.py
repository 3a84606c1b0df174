"""Row gather (token embedding) is an exact copy."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
kernels = pytest.importorskip("ddtree._native", exc_type=ImportError).kernels


@pytest.mark.parametrize("vocab,dim,rows", [(512, 64, 1), (1000, 7168, 17), (163840, 7168, 3)])
def test_gather_rows_exact(vocab: int, dim: int, rows: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(vocab)
    table = torch.randn(vocab, dim, device="cuda", generator=g).bfloat16()
    ids = torch.randint(0, vocab, (rows,), device="cuda", generator=g, dtype=torch.int32)
    ids[0] = vocab - 1
    out = torch.full((rows, dim), float("nan"), device="cuda", dtype=torch.bfloat16)
    kernels.gather_rows(out, table, ids)
    torch.cuda.synchronize()
    assert torch.equal(out, table[ids.long()])
