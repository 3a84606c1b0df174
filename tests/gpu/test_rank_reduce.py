"""The collectives' arithmetic (kernels/rank_reduce.cu): the rank-order sum is the fp32 sum in rank then term order
rounded once, bit for bit; a vocabulary split into rank slices, each rank's candidates picked across ranks, gives
exactly the token the single-GPU sampler gives over the whole row, greedy and sampled."""

from __future__ import annotations

import pytest
import torch

from ddtree._native import kernels


@pytest.mark.parametrize("ranks, terms, rows, width", [(2, 1, 1, 64), (4, 2, 37, 7168), (8, 2, 5, 100)])
def test_rank_order_sum_is_the_ordered_fp32_sum(ranks: int, terms: int, rows: int, width: int) -> None:
    torch.manual_seed(ranks * 10 + terms)
    parts = (torch.randn(ranks, terms, rows, width, device="cuda") * 3).bfloat16()
    out = torch.empty(rows, width, device="cuda", dtype=torch.bfloat16)
    kernels.rank_order_sum(out, parts)
    expected = torch.zeros(rows, width, device="cuda")
    for r in range(ranks):
        for t in range(terms):
            expected = expected + parts[r, t].float()
    assert torch.equal(out, expected.bfloat16())
    one = torch.empty(1, width, device="cuda", dtype=torch.bfloat16)  # a row alone: the same bits
    kernels.rank_order_sum(one, parts[:, :, -1:].contiguous())
    assert torch.equal(one[0], out[-1])


def _device_scalars(temperature: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([temperature], device="cuda", dtype=torch.float32),
            torch.tensor([seed], device="cuda", dtype=torch.int64))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("ranks, vocab", [(2, 512), (8, 163840), (4, 32000)])
def test_split_pick_equals_the_whole_row_sampler(ranks: int, vocab: int, temperature: float) -> None:
    torch.manual_seed(vocab + ranks)
    rows = 9
    logits = torch.randn(rows, vocab, device="cuda") * 4
    logits[1, [3, vocab - 5]] = 50.0  # a tie across ranks: the lower id
    logits[2] = float("-inf")         # nothing above -inf: token 0
    logits[3, : vocab // 2] = float("nan")
    temp, seed = _device_scalars(temperature, 77)
    streams = torch.arange(rows, device="cuda", dtype=torch.int32)
    positions = streams * 13 + 5
    whole = torch.empty(rows, device="cuda", dtype=torch.int32)
    nonfinite = torch.full((rows,), 0x7F7F7F7F, device="cuda", dtype=torch.int32)
    kernels.sample_tokens(whole, nonfinite, logits, temp, seed, streams, positions)
    width = vocab // ranks
    candidates = torch.empty(ranks, rows, 2, device="cuda", dtype=torch.int32)
    split_nonfinite = torch.full((rows,), 0x7F7F7F7F, device="cuda", dtype=torch.int32)
    for r in range(ranks):
        slot = torch.empty(rows, 2, device="cuda", dtype=torch.int32)
        kernels.sample_candidates(slot, split_nonfinite, logits, r * width, width, temp, seed, streams, positions)
        candidates[r] = slot
    picked = torch.empty(rows, device="cuda", dtype=torch.int32)
    kernels.pick_candidates(picked, candidates)
    torch.cuda.synchronize()
    assert picked[2].item() == 0
    assert torch.equal(picked, whole)
    assert torch.equal(split_nonfinite, nonfinite)
    if temperature == 0:
        assert picked[1].item() == 3
