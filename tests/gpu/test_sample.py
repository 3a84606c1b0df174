"""Greedy arg-max and seeded Gumbel-max sampling over fp32 logits."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
kernels = pytest.importorskip("ddtree._native", exc_type=ImportError).kernels


ALL_FINITE = 0x7F7F7F7F  # kAllLogitsFinite


def _sample_checked(logits: torch.Tensor, temperature: float, seed: int, streams: torch.Tensor | None = None,
                    positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens, and per stream id the lowest position of a row with non-finite logits (ALL_FINITE if none)."""
    rows = logits.shape[0]
    tokens = torch.full((rows,), -1, device="cuda", dtype=torch.int32)
    streams = torch.arange(rows, device="cuda", dtype=torch.int32) if streams is None else streams
    positions = torch.zeros(rows, device="cuda", dtype=torch.int32) if positions is None else positions
    nonfinite = torch.full((int(streams.max().item()) + 1,), ALL_FINITE, device="cuda", dtype=torch.int32)
    kernels.sample_tokens(tokens, nonfinite, logits, torch.tensor([temperature], device="cuda"),
                          torch.tensor([seed], device="cuda", dtype=torch.int64), streams, positions)
    torch.cuda.synchronize()
    return tokens, nonfinite


def _sample(logits: torch.Tensor, temperature: float, seed: int, streams: torch.Tensor | None = None,
            positions: torch.Tensor | None = None) -> torch.Tensor:
    tokens, nonfinite = _sample_checked(logits, temperature, seed, streams, positions)
    if torch.isfinite(logits).all():
        assert (nonfinite == ALL_FINITE).all()
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


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_non_finite_rows_mark_their_stream_at_the_lowest_position(temperature: float) -> None:
    # 6 rows of 3 streams (ids 0, 2, 2, 1, 2, 0) at awkward positions over a vocabulary not a multiple of the
    # CTAs' slices; the bad values sit at the ends of slices and of the row
    vocab = 163_841
    g = torch.Generator(device="cuda").manual_seed(5)
    logits = torch.randn(6, vocab, device="cuda", generator=g)
    streams = torch.tensor([0, 2, 2, 1, 2, 0], device="cuda", dtype=torch.int32)
    positions = torch.tensor([7, 40, 31, 3, 35, 9], device="cuda", dtype=torch.int32)
    logits[1, vocab - 1] = float("nan")
    logits[4, 0] = float("inf")
    logits[5, vocab // 8] = -float("inf")
    tokens, nonfinite = _sample_checked(logits, temperature, 3, streams, positions)
    assert nonfinite.tolist() == [9, ALL_FINITE, 35]
    assert ((tokens >= 0) & (tokens < vocab)).all()
