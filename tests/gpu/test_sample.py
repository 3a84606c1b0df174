"""Greedy arg-max and seeded Gumbel-max sampling over fp32 logits."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
kernels = pytest.importorskip("ddtree._native", exc_type=ImportError).kernels


def _sample(logits: torch.Tensor, temperature: float, seed: int, streams: torch.Tensor | None = None,
            positions: torch.Tensor | None = None) -> torch.Tensor:
    rows = logits.shape[0]
    tokens = torch.full((rows,), -1, device="cuda", dtype=torch.int32)
    streams = torch.arange(rows, device="cuda", dtype=torch.int32) if streams is None else streams
    positions = torch.zeros(rows, device="cuda", dtype=torch.int32) if positions is None else positions
    kernels.sample_tokens(tokens, logits, torch.tensor([temperature], device="cuda"),
                          torch.tensor([seed], device="cuda", dtype=torch.int64), streams, positions)
    torch.cuda.synchronize()
    return tokens


# 70000 rows: more than a grid's y dimension holds (the row clusters lie along x).
@pytest.mark.parametrize("rows,vocab", [(1, 163840), (17, 512), (3, 32000), (2, 7), (70000, 5)])
def test_greedy_is_argmax_lowest_on_ties(rows: int, vocab: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(vocab)
    logits = torch.randn(rows, vocab, device="cuda", generator=g)
    logits[0, vocab // 3] = logits[0, vocab - 1] = 100.0  # a tie: the lower id wins
    tokens = _sample(logits, 0.0, 0)
    expect = logits.argmax(dim=-1).to(torch.int32)
    expect[0] = vocab // 3
    assert torch.equal(tokens, expect)


def test_sampling_is_seeded_and_row_invariant() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(16, 1000, device="cuda", generator=g)
    positions = torch.arange(16, device="cuda", dtype=torch.int32) * 5
    a = _sample(logits, 0.8, 42, positions=positions)
    assert torch.equal(a, _sample(logits, 0.8, 42, positions=positions))
    alone = _sample(logits[3:4].contiguous(), 0.8, 42, torch.tensor([3], device="cuda", dtype=torch.int32),
                    positions[3:4].contiguous())
    assert alone.item() == a[3].item()
    assert not torch.equal(a, _sample(logits, 0.8, 43, positions=positions))


def test_sampling_follows_softmax() -> None:
    # one row drawn at 4000 positions: frequencies match softmax(logits / T) within sampling noise
    vocab, draws, temperature = 6, 4000, 0.7
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 1.5]], device="cuda").repeat(draws, 1)
    positions = torch.arange(draws, device="cuda", dtype=torch.int32)
    tokens = _sample(logits, temperature, 7, torch.zeros(draws, device="cuda", dtype=torch.int32), positions)
    freq = torch.bincount(tokens.long(), minlength=vocab).float() / draws
    expect = torch.softmax(logits[0] / temperature, dim=-1)
    assert (freq - expect).abs().max().item() < 0.03
