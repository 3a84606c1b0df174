"""Per-row top-k of log-softmax against the numpy reference's draft_top_k: log-probs within fp32 rounding, ids
equal wherever the reference separates neighbours by more than that, exact tie order on quantised logits, rows
independent of each other; bad arguments refused by name.

The kernel cuts a row into 8 slices, slice c holding tokens 128 c .. 128 c + 127 of every 1024, and merges their
top k: the vocabularies, k and ties below sit on either side of those cuts."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
kernels = pytest.importorskip("ddtree._native", exc_type=ImportError).kernels
from ddtree.reference.drafter import draft_top_k  # noqa: E402

POISON = float("nan")
VOCAB_MAX = 384 * 1024  # kTopkVocabMax (kernels/topk.cuh)
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
    (3, 1, 1),          # one token: seven of the eight slices empty
    (1, 127, 127), (2, 128, 1), (2, 129, 128),  # one slice short of, at and past one 128-token chunk
    (3, 333, 333), (2, 333, 129),               # three slices in use, k across the first two
    # around one 1024-token stride, k at and past a slice's 128 tokens there
    (3, 1023, 129), (2, 1024, 128), (2, 1024, 1024), (2, 1025, 1024),
    (3, 8191, 512), (2, 20480, 1024),
    (15, 163840, 32), (7, 163840, 256), (240, 163840, 64),  # 1 and 16 streams of the 15-row drafter block
    (1, 163841, 8),     # one token past a whole number of strides: slice 0 alone holds it
    (1, VOCAB_MAX, 1024),
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


def test_ties_across_slices_go_to_the_lower_id() -> None:
    """Equal maxima in different slices (tokens 3 and 1030 in slice 0, 130 in slice 1, 5000 and 163839 in slice 7):
    every k cuts them in ascending id order; a coarse grid over the K2 vocabulary puts the k-th value's ties in
    every slice."""
    vocab = 163840
    rng = np.random.default_rng(5)
    logits = np.round(rng.standard_normal((2, vocab)) * 2) / 2
    tied = [3, 130, 1030, 5000, 163839]
    logits[0, tied] = 20.0  # above every draw of the grid
    logits = logits.astype(np.float32)
    for k in (1, 2, 3, 4, 5, 6, 100, 1024):
        got_lp, got_ids = _topk(torch.from_numpy(logits).cuda(), k)
        ref_lp, ref_ids = draft_top_k(logits, k)
        assert np.array_equal(got_ids, ref_ids), k
        np.testing.assert_allclose(got_lp, ref_lp, rtol=0, atol=TOL * 10)
        assert got_ids[0, :min(k, 5)].tolist() == tied[:min(k, 5)]


@pytest.mark.parametrize("k", [8, 128, 129, 160, 256])
def test_top_inside_one_partial(k: int) -> None:
    """The row's 160 largest logits all in tokens 5, 1029, 2053, ...: one CTA's slice, one of its strided partials,
    so that partial's maximum stands for all of them and the other partials' maxima are far below; k on both sides
    of 128, where the selection stops using the partials' maxima."""
    rng = np.random.default_rng(k)
    logits = rng.standard_normal((2, 163840)).astype(np.float32)
    logits[0, 5::1024] = 10 + 0.25 * np.arange(160, dtype=np.float32)[::-1]
    _check_against_reference(logits, k)
    got_ids = _topk(torch.from_numpy(logits).cuda(), k)[1]
    assert got_ids[0, :min(k, 160)].tolist() == list(range(5, 5 + 1024 * min(k, 160), 1024))


def test_every_slice_ranks_by_the_same_statistics() -> None:
    """log_prob = (x - max) - log_sum with one (max, log_sum) per row, whichever slice a token is in: the top entry
    is the row's maximum, so its log-prob is -log_sum, and every other entry follows from its logit exactly."""
    rng = np.random.default_rng(9)
    logits = (rng.standard_normal((5, 163840)) * 3).astype(np.float32)
    got_lp, got_ids = _topk(torch.from_numpy(logits).cuda(), 1024)
    for r in range(logits.shape[0]):
        x = logits[r, got_ids[r]]
        top, log_sum = x[0], np.float32(-got_lp[r, 0])
        assert top == logits[r].max()
        assert np.array_equal(got_lp[r], (x - top) - log_sum), r
    assert len({int(i) % 1024 // 128 for i in got_ids.ravel()}) == 8, "the top k should come from every slice"


def test_nan_and_infinite_logits_rank_last_across_slices() -> None:
    """NaN and -inf logits spread over every slice rank as -inf, after every finite one, among themselves by id."""
    rng = np.random.default_rng(4)
    vocab, k = 4096, 1024
    logits = (np.round(rng.standard_normal((2, vocab)) * 16) / 16).astype(np.float32)  # exact ties, clear gaps
    logits[:, ::3] = np.nan
    logits[:, 1::5] = -np.inf
    logits[1, 7:] = np.nan  # row 1: seven finite logits at most
    got_lp, got_ids = _topk(torch.from_numpy(logits).cuda(), k)
    ref_lp, ref_ids = draft_top_k(np.where(np.isnan(logits), -np.inf, logits), k)
    for r in range(2):
        finite = int(np.isfinite(logits[r]).sum())
        assert np.array_equal(got_ids[r], ref_ids[r]), r
        assert np.all(np.isfinite(got_lp[r, :finite])) and np.all(got_lp[r, finite:] == -np.inf)
        np.testing.assert_allclose(got_lp[r, :finite], ref_lp[r, :finite], rtol=0, atol=TOL * 10)


def test_nan_and_infinite_logits_rank_last() -> None:
    logits = np.zeros((1, 100), dtype=np.float32)
    logits[0, :50] = np.nan
    logits[0, 50:60] = -np.inf
    logits[0, 60:] = np.arange(40, dtype=np.float32)
    lp, ids = _topk(torch.from_numpy(logits).cuda(), 50)
    assert ids[0, :40].tolist() == list(range(99, 59, -1))
    assert np.all(np.isfinite(lp[0, :40])) and np.all(lp[0, 40:] == -np.inf)


@pytest.mark.parametrize("rows,k", [(16, 64), (240, 8), (240, 1024)])
def test_rows_are_independent(rows: int, k: int) -> None:
    """A row's result, bit for bit, alone, among other rows, among different other rows, and on a rerun."""
    rng = np.random.default_rng(rows + k)
    logits = torch.from_numpy((rng.standard_normal((rows, 163840)) * 3).astype(np.float32)).cuda()
    all_lp, all_ids = _topk(logits, k)
    rerun_lp, rerun_ids = _topk(logits, k)
    assert np.array_equal(all_lp, rerun_lp) and np.array_equal(all_ids, rerun_ids)
    for r in (0, 5, rows - 1):
        lp, ids = _topk(logits[r:r + 1].contiguous(), k)
        assert np.array_equal(lp[0], all_lp[r]) and np.array_equal(ids[0], all_ids[r])
    others = logits.clone()
    others[1:] = torch.from_numpy((rng.standard_normal((rows - 1, 163840)) * 7).astype(np.float32)).cuda()
    others[-1, ::2] = float("nan")
    lp, ids = _topk(others, k)
    assert np.array_equal(lp[0], all_lp[0]) and np.array_equal(ids[0], all_ids[0])


def test_bad_arguments_are_refused() -> None:
    logits = torch.zeros(2, 100, device="cuda")
    with pytest.raises(ValueError, match="log_probs"):
        kernels.topk_log_softmax(torch.empty(2, 101, device="cuda"), torch.empty(2, 101, device="cuda",
                                                                              dtype=torch.int32), logits)
    with pytest.raises(ValueError, match="ids"):
        kernels.topk_log_softmax(torch.empty(2, 5, device="cuda"), torch.empty(2, 5, device="cuda"), logits)
    with pytest.raises(ValueError, match="logits"):
        kernels.topk_log_softmax(torch.empty(1, 5, device="cuda"), torch.empty(1, 5, device="cuda",
                                                                            dtype=torch.int32),
                                 torch.zeros(1, VOCAB_MAX + 1, device="cuda"))
