"""Per-row top-k of log-softmax against the numpy reference's draft_top_k: log-probs within fp32 rounding, ids
equal wherever the reference separates neighbours by more than that, exact tie order on quantised logits, rows
independent of each other; bad arguments refused by name."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
kernels = pytest.importorskip("ddtree._native", exc_type=ImportError).kernels
from ddtree.reference.drafter import draft_top_k  # noqa: E402

POISON = float("nan")
# |log-prob| is at most a few tens here; fp32 exp/log of another implementation and summation order differ by a
# few ulps of the row's log-sum-exp.
TOL = 2e-5


def _topk(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    rows = logits.shape[0]
    log_probs = torch.full((rows, k), POISON, device="cuda")
    ids = torch.full((rows, k), -1, device="cuda", dtype=torch.int32)
    kernels.topk_log_softmax(log_probs, ids, logits)
    torch.cuda.synchronize()
    return log_probs.cpu().numpy(), ids.cpu().numpy()


def _check_against_reference(logits: np.ndarray, k: int) -> None:
    got_lp, got_ids = _topk(torch.from_numpy(logits).cuda(), k)
    ref_lp, ref_ids = draft_top_k(logits, k)
    np.testing.assert_allclose(got_lp, ref_lp, rtol=0, atol=TOL * max(1.0, float(np.abs(ref_lp).max())))
    assert np.all(np.diff(got_lp, axis=1) <= 0), "log-probs not sorted descending"
    # ids agree wherever the reference's value is clear of its neighbours, the (k + 1)-th included
    vocab = logits.shape[1]
    beyond = draft_top_k(logits, k + 1)[0][:, k:] if k < vocab else np.full((logits.shape[0], 1), -np.inf)
    values = np.concatenate([np.full((logits.shape[0], 1), np.inf), ref_lp, beyond], axis=1)
    gaps = -np.diff(values, axis=1)
    clear = (gaps[:, :-1] > 4 * TOL) & (gaps[:, 1:] > 4 * TOL)
    assert np.array_equal(got_ids[clear], ref_ids[clear])
    assert all(len(set(row.tolist())) == k for row in got_ids)


@pytest.mark.parametrize("rows,vocab,k", [
    (1, 163840, 1), (7, 163840, 8), (7, 163840, 64), (16, 163840, 1024),  # K2 vocabulary, budgets 1 .. 1024
    (3, 1000, 1000),    # k = vocab
    (5, 33, 17),        # a vocabulary smaller than one pass of the block
    (2, 4097, 1023),    # k just under the largest, odd vocabulary
    (4, 512, 7),        # tiny preset
])
def test_topk_matches_reference(rows: int, vocab: int, k: int) -> None:
    rng = np.random.default_rng(rows * vocab + k)
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    _check_against_reference(logits, k)


def test_ties_go_to_the_lower_id() -> None:
    """Logits on a coarse grid tie exactly, and so do their log-probs: the order among equals is ascending id, as
    the reference's, across the k-th boundary too; an all-equal row keeps the first k ids."""
    rng = np.random.default_rng(3)
    logits = np.round(rng.standard_normal((6, 20000)) * 4) / 4
    logits[5] = 1.5
    logits = logits.astype(np.float32)
    for k in (1, 10, 300, 1024):
        got_lp, got_ids = _topk(torch.from_numpy(logits).cuda(), k)
        ref_lp, ref_ids = draft_top_k(logits, k)
        assert np.array_equal(got_ids, ref_ids), k
        np.testing.assert_allclose(got_lp, ref_lp, rtol=0, atol=TOL * 10)
    assert np.array_equal(_topk(torch.from_numpy(logits[5:]).cuda(), 8)[1][0], np.arange(8))


def test_nan_and_infinite_logits_rank_last() -> None:
    logits = np.zeros((1, 100), dtype=np.float32)
    logits[0, :50] = np.nan
    logits[0, 50:60] = -np.inf
    logits[0, 60:] = np.arange(40, dtype=np.float32)
    lp, ids = _topk(torch.from_numpy(logits).cuda(), 50)
    assert ids[0, :40].tolist() == list(range(99, 59, -1))
    assert np.all(np.isfinite(lp[0, :40])) and np.all(lp[0, 40:] == -np.inf)


def test_rows_are_independent() -> None:
    rng = np.random.default_rng(1)
    logits = torch.from_numpy((rng.standard_normal((16, 163840)) * 3).astype(np.float32)).cuda()
    all_lp, all_ids = _topk(logits, 64)
    for r in (0, 5, 15):
        lp, ids = _topk(logits[r:r + 1].contiguous(), 64)
        assert np.array_equal(lp[0], all_lp[r]) and np.array_equal(ids[0], all_ids[r])


def test_bad_arguments_are_refused() -> None:
    logits = torch.zeros(2, 100, device="cuda")
    with pytest.raises(ValueError, match="log_probs"):
        kernels.topk_log_softmax(torch.empty(2, 101, device="cuda"), torch.empty(2, 101, device="cuda",
                                                                              dtype=torch.int32), logits)
    with pytest.raises(ValueError, match="ids"):
        kernels.topk_log_softmax(torch.empty(2, 5, device="cuda"), torch.empty(2, 5, device="cuda"), logits)
