"""The GPU drafter beside the numpy reference on the same weights, and the tolerance the comparison uses.

The tolerance is the reference's own bf16 error: every round also runs the reference with the inputs and outputs of
each of its linear layers rounded to bf16 (the precision of the GPU's activations between kernels), and the GPU may
deviate from the float32 reference by at most BF16_ERROR_MULTIPLE times as much as that emulation does. The GPU
rounds in a few more places than the emulation (the residual stream, normed q/k), hence a multiple above 1."""

from __future__ import annotations

import numpy as np
import pytest

from ddtree import bf16
from ddtree.reference import drafter as reference_drafter_module
from ddtree.reference import layers as reference_layers_module
from ddtree.reference.drafter import ReferenceDrafter, draft_top_k

BF16_ERROR_MULTIPLE = 4.0
TOP_K = 8


def _bf16(x: np.ndarray) -> np.ndarray:
    return bf16.as_float32(bf16.from_float32(x))


def _bf16_linear(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    return _bf16(_bf16(x) @ weight.T)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """Largest error of a row relative to the row's largest magnitude, over the rows (last axis)."""
    got, want = got.reshape(-1, want.shape[-1]), want.reshape(-1, want.shape[-1])
    return float((np.abs(got - want).max(-1) / np.maximum(np.abs(want).max(-1), 1e-30)).max())


class Twins:
    """A GPU drafter and the reference drafter on the same weights, with per-stream reference caches in float32 and
    in the bf16 emulation."""

    def __init__(self, gpu, reference: ReferenceDrafter, streams: int, window: int | None = None) -> None:
        self.gpu, self.reference = gpu, reference
        self.caches = [reference.new_cache(window) for _ in range(streams)]
        self.emulated_caches = [reference.new_cache(window) for _ in range(streams)]

    def round(self, streams: list[int], contexts: list[np.ndarray], bonus: list[int],
              monkeypatch: pytest.MonkeyPatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Append `contexts` (bf16 bits) and draft below `bonus` on the GPU and on both references: GPU, float32
        and emulated logits [streams, B - 1, vocab]."""
        self.gpu.append(streams, contexts)
        got = self.gpu.draft(streams, bonus)
        want, emulated = [], []
        for stream, context, token in zip(streams, contexts, bonus):
            features = bf16.as_float32(context)
            start = self.caches[stream].length + len(context)
            assert self.gpu.committed(stream) == start
            want.append(self.reference.draft(self.caches[stream], features, token, start))
            monkeypatch.setattr(reference_drafter_module, "linear", _bf16_linear)
            monkeypatch.setattr(reference_layers_module, "linear", _bf16_linear)
            emulated.append(self.reference.draft(self.emulated_caches[stream], features, token, start))
            monkeypatch.undo()
        return got, np.stack(want), np.stack(emulated)

    def check_round(self, streams: list[int], contexts: list[np.ndarray], bonus: list[int],
                    monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
        """One round, its logits and per-depth top-K checked against the reference; returns the GPU logits."""
        got, want, emulated = self.round(streams, contexts, bonus, monkeypatch)
        bound = BF16_ERROR_MULTIPLE * relative_error(emulated, want)
        err = relative_error(got, want)
        assert np.isfinite(got).all()
        assert err <= bound, f"GPU logits deviate {err:.2e} (of each row's max) from the reference; bound {bound:.2e}"
        log_probs, ids = self.gpu.draft_top_k(streams, bonus, TOP_K)
        check_top_k(log_probs, ids, want, bound)
        return got

    def check_cache(self, streams: list[int]) -> None:
        """Every layer's cached K and V rows against the reference cache, within the emulation's multiple."""
        for stream in streams:
            cache, emulated = self.caches[stream], self.emulated_caches[stream]
            for layer in range(self.reference.config.num_hidden_layers):
                keys, values = self.gpu.cache_rows(stream, layer)
                for name, got, want, emu in (("K", keys, cache.keys[layer], emulated.keys[layer]),
                                             ("V", values, cache.values[layer], emulated.values[layer])):
                    assert got.shape == want.shape, (stream, layer, name, got.shape, want.shape)
                    bound = BF16_ERROR_MULTIPLE * max(relative_error(emu, want), 2.0 ** -8)
                    err = relative_error(got, want)
                    assert err <= bound, f"stream {stream} layer {layer} {name}: {err:.2e} > {bound:.2e}"


def check_top_k(got_lp: np.ndarray, got_ids: np.ndarray, want: np.ndarray, bound: float) -> None:
    """The GPU's per-depth top-K (log-probs and ids [streams, B - 1, TOP_K], computed on the device) equals the
    reference's wherever the reference separates a rank from its neighbours by more than the tolerance (log-probs
    move by at most twice the largest logit error)."""
    rows = want.reshape(-1, want.shape[-1])
    for g_lp, g_ids, w in zip(got_lp.reshape(len(rows), -1), got_ids.reshape(len(rows), -1), rows):
        tol = 2 * bound * float(np.abs(w).max())
        want_lp, want_ids = draft_top_k(w[None], TOP_K + 1)
        gaps = -np.diff(want_lp[0])
        assert np.all(np.diff(g_lp) <= 0) and len(set(g_ids.tolist())) == TOP_K
        for rank in range(TOP_K):
            separated = gaps[rank] > 2 * tol and (rank == 0 or gaps[rank - 1] > 2 * tol)
            if separated:
                assert g_ids[rank] == want_ids[0, rank], (rank, g_ids, want_ids[0, :TOP_K])
                assert abs(g_lp[rank] - want_lp[0, rank]) <= tol, (rank, g_lp[rank], want_lp[0, rank])


def random_contexts(rng: np.random.Generator, counts: list[int], width: int) -> list[np.ndarray]:
    """Tapped-hidden-state rows as bf16 bits, of unit scale like a residual stream."""
    return [bf16.from_float32(rng.standard_normal((n, width)).astype(np.float32)) for n in counts]
