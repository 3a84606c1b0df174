"""Shared fixtures: one tiny checkpoint per test session, written by the real make-model path."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ddtree.presets import make_model

    out = tmp_path_factory.mktemp("tiny")
    make_model("tiny", out, seed=0)
    return out
