"""Elementwise and dense building blocks of the reference, all in float32."""

from __future__ import annotations

import numpy as np


def linear(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x [n, in] @ weight[out, in]^T, the nn.Linear convention of HF checkpoints (no bias anywhere)."""
    return x @ weight.T


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis."""
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return weight * (x / np.sqrt(variance + np.float32(eps)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def swiglu_mlp(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """down(silu(gate(x)) * up(x)): the dense MLP, the shared expert and every routed expert."""
    return linear(silu(linear(x, gate)) * linear(x, up), down)


def softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; -inf entries get probability 0 (every row has a finite entry)."""
    shifted = scores - scores.max(axis=-1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)
