"""Router (sigmoid, bias for selection only, top-k, normalise) against the numpy reference's route()."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
kernels = pytest.importorskip("ddtree._native", exc_type=ImportError).kernels
from ddtree.presets import preset_config  # noqa: E402
from ddtree.reference.layers import sigmoid  # noqa: E402


def _reference(logits: np.ndarray, bias: np.ndarray, topk: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    scores = sigmoid(logits)
    ids = np.argsort(-(scores + bias), axis=-1, kind="stable")[:, :topk]
    w = np.take_along_axis(scores, ids, axis=-1)
    if normalize:
        w = w / (w.sum(-1, keepdims=True) + np.float32(1e-20))
    return ids, w


@pytest.mark.parametrize("tokens,experts,topk,normalize", [(1, 384, 8, True), (33, 384, 8, True), (5, 8, 3, True),
                                                           (7, 64, 8, False), (3, 1000, 16, True)])
def test_route_topk_matches_reference(tokens: int, experts: int, topk: int, normalize: bool) -> None:
    rng = np.random.default_rng(experts + tokens)
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    logits[0, :4] = logits[0, 4]  # exact ties go to the lower expert id
    bias = (0.05 * rng.standard_normal(experts)).astype(np.float32)
    bias[:5] = 0
    ids = torch.full((tokens, topk), -1, device="cuda", dtype=torch.int32)
    weights = torch.full((tokens, topk), float("nan"), device="cuda")
    kernels.route_topk(ids, weights, torch.from_numpy(logits).cuda(), torch.from_numpy(bias).cuda(), normalize)
    torch.cuda.synchronize()
    ref_ids, ref_w = _reference(logits, bias, topk, normalize)
    np.testing.assert_array_equal(ids.cpu().numpy(), ref_ids)
    np.testing.assert_allclose(weights.cpu().numpy(), ref_w, rtol=1e-5, atol=1e-7)


def test_route_topk_batch_invariant() -> None:
    cfg = preset_config("k2-layers", 1)
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(16, cfg.n_routed_experts, device="cuda", generator=g)
    bias = torch.randn(cfg.n_routed_experts, device="cuda", generator=g) * 0.05
    k = cfg.num_experts_per_tok

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.empty(x.shape[0], k, device="cuda", dtype=torch.int32)
        w = torch.empty(x.shape[0], k, device="cuda")
        kernels.route_topk(ids, w, x, bias, True)
        return ids, w

    all_ids, all_w = run(logits)
    ids, w = run(logits[7:8].contiguous())
    assert torch.equal(ids, all_ids[7:8]) and torch.equal(w, all_w[7:8])


def test_route_topk_nan_scores_still_pick_distinct_experts_in_range() -> None:
    """NaN activations must not turn into out-of-range expert ids (an expert kernel would index with them)."""
    experts, k = 64, 8
    logits = torch.randn(3, experts, device="cuda")
    logits[0] = float("nan")  # every score NaN
    logits[1, ::2] = float("nan")  # half NaN: the finite half ranks first
    bias = torch.zeros(experts, device="cuda")
    ids = torch.full((3, k), -1, device="cuda", dtype=torch.int32)
    w = torch.empty(3, k, device="cuda")
    kernels.route_topk(ids, w, logits, bias, True)
    torch.cuda.synchronize()
    ids = ids.cpu()
    for row in ids:
        assert row.min() >= 0 and row.max() < experts and len(set(row.tolist())) == k
    assert all(int(e) % 2 == 1 for e in ids[1])
    expected = torch.topk(torch.sigmoid(logits[2]) + bias, k).indices.sort().values.cpu()
    assert torch.equal(ids[2].sort().values.long(), expected)
