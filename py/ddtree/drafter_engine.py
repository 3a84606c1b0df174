"""The DFlash drafter on the GPU, beside a ddtree.Engine whose embedding table and LM head it shares.

The C++ runtime (ddtree._native.Drafter) holds the drafter's bf16 weights, a per-stream draft KV cache of the
committed context rows (all of them, or the last `window`), and runs the context append and the block forward
(ddtree.reference.drafter is the spec). This module opens and validates the checkpoint, hands the runtime host views
of its tensors, and checks requests; what the runtime refuses arrives as a RequestError naming the argument.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ddtree import bf16
from ddtree.drafter import DrafterConfig, open_drafter
from ddtree.engine import Engine, _native_call, drafter_dims, upload_drafter_tensors
from ddtree.errors import RequestError
from ddtree.reference.rope import Rope

# Context rows per append launch: a prompt's rows go up in launches of this many.
MAX_APPEND_ROWS = 1024


class GpuDrafter:
    """The drafter of `engine`'s streams on its GPU. ``window`` (None: unbounded) keeps only the last ``window``
    committed context rows per stream, as ReferenceDrafter.new_cache(window) does."""

    def __init__(self, drafter_dir: str | Path, engine: Engine, window: int | None = None) -> None:
        config, checkpoint = open_drafter(drafter_dir, engine.config)
        self._create(config, engine, window)
        self.upload(checkpoint)

    @classmethod
    def random(cls, cfg: DrafterConfig, engine: Engine, window: int | None = None, seed: int = 0) -> GpuDrafter:
        """A drafter with random weights of the right scale made on the device (benchmarks at K2 dims)."""
        drafter = cls.__new__(cls)
        drafter._create(cfg, engine, window)
        drafter._native.randomize_weights(seed)
        return drafter

    @classmethod
    def with_weights(cls, cfg: DrafterConfig, engine: Engine, weights: Mapping[str, np.ndarray],
                     window: int | None = None) -> GpuDrafter:
        """A drafter of the given host tensors (bf16 bits by checkpoint name), e.g. random ones shared with a
        reference, without a checkpoint on disk."""
        drafter = cls.__new__(cls)
        drafter._create(cfg, engine, window)
        drafter.upload(weights)
        return drafter

    def _create(self, cfg: DrafterConfig, engine: Engine, window: int | None) -> None:
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise RequestError(f"window must be a positive integer or None, got {window!r}")
        if (cfg.hidden_size, cfg.vocab_size) != (engine.config.hidden_size, engine.config.vocab_size):
            raise RequestError(f"drafter hidden_size/vocab_size {cfg.hidden_size}/{cfg.vocab_size} differ from the "
                               f"engine's {engine.config.hidden_size}/{engine.config.vocab_size}")
        from ddtree import _native

        rope = Rope.from_drafter_config(cfg)
        self.config, self.engine, self.window = cfg, engine, window
        self._native = _native_call(_native.Drafter, engine.native, drafter_dims(cfg), rope.inv_freq.tolist(),
                                    float(rope.attention_factor), engine.streams, engine.max_context, window or 0,
                                    MAX_APPEND_ROWS)

    @property
    def native(self) -> Any:
        """The C++ drafter (profiling and test entry points)."""
        return self._native

    def upload(self, weights: Mapping[str, np.ndarray]) -> None:
        """Copy every drafter tensor of ``weights`` (bf16 bits) to the device; RuntimeError if one is missing."""
        upload_drafter_tensors(weights, self._native.upload, self._native.missing)

    def committed(self, stream: int) -> int:
        """Context rows committed to `stream` so far (the position its next block starts at)."""
        return _native_call(self._native.committed, stream)

    def append(self, streams: Sequence[int], contexts: Sequence[np.ndarray]) -> None:
        """Append each stream's context rows ([rows, taps * hidden]: bf16 bits, or floats rounded to bf16) at its
        next positions."""
        if len(streams) != len(contexts):
            raise RequestError(f"{len(streams)} streams but {len(contexts)} contexts")
        width = self.config.context_width
        rows = []
        for stream, context in zip(streams, contexts):
            context = np.asarray(context)
            if context.ndim != 2 or context.shape[1] != width:
                raise RequestError(f"context of stream {stream} must be [rows, {width}], got shape "
                                   f"{list(context.shape)}")
            rows.append(context if context.dtype == np.uint16 else bf16.from_float32(context))
        features = np.ascontiguousarray(np.concatenate(rows) if rows else np.zeros((0, width), np.uint16))
        _native_call(self._native.append, list(streams), [len(r) for r in rows], features)

    def draft(self, streams: Sequence[int], bonus_tokens: Sequence[int]) -> np.ndarray:
        """The block forward of each stream at its committed length below its bonus token: fp32 logits
        [streams, block_size - 1, vocab] of depths 1 .. block_size - 1."""
        return _native_call(self._native.draft, list(streams), [int(t) for t in bonus_tokens])

    def draft_top_k(self, streams: Sequence[int], bonus_tokens: Sequence[int], k: int) -> tuple[np.ndarray, np.ndarray]:
        """The same block forward's per-depth log-softmax top-k, computed on the device (no logit row leaves it):
        fp32 log-probs sorted descending (ties to the lower id) and int32 ids, [streams, block_size - 1, k]."""
        return _native_call(self._native.draft_top_k, list(streams), [int(t) for t in bonus_tokens], k)

    def cache_rows(self, stream: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The draft cache's K and V rows of `stream` in `layer`, oldest first, as float32 [rows, kv_heads,
        head_dim]."""
        keys, values = _native_call(self._native.cache_rows, stream, layer)
        return bf16.as_float32(keys), bf16.as_float32(values)


__all__ = ["GpuDrafter", "drafter_dims"]
