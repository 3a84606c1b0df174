"""tools/soak.py's flow on a machine without a GPU: the stand-in engine of tests/fake_engine.py in place of
ddtree.Engine and a made-up memory reading, so its checks, its budgets (auto among them) and its report run here;
the soak itself runs on the device."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from fake_engine import FakeEngine

TOOLS = Path(__file__).resolve().parent.parent / "tools"


@pytest.fixture
def soak(monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("soak", TOOLS / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    budgets_seen: list = []

    class Engine(FakeEngine):
        def __init__(self, model_dir, drafter_dir, streams: int, max_context: int, budget: int) -> None:
            super().__init__(streams, max_context, budget)
            self.config = SimpleNamespace(vocab_size=97)

        def generate(self, prompts, max_new_tokens, budget=None, **kwargs):
            budgets_seen.append(budget)
            return super().generate(prompts, max_new_tokens, budget=None if budget == "auto" else budget, **kwargs)

    monkeypatch.setattr(module.ddtree, "Engine", Engine)
    monkeypatch.setattr(module, "device_info", lambda: "a stand-in device")
    module.budgets_seen = budgets_seen
    return module


def test_soak_checks_calls_and_writes_its_report(soak, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(soak, "process_used_bytes", lambda: 1 << 30)
    assert soak.main(["--out", str(tmp_path), "--minutes", "0.03", "--model", str(tmp_path / "model")]) == 0
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["failures"] == [] and len(report["calls"]) > soak.WARMUP_CALLS
    assert report["memory_counted"] == "this process's (NVML)"
    assert "auto" in soak.budgets_seen and set(soak.budgets_seen) <= set(soak.BUDGETS) | {None}
    assert "Failures: none" in (tmp_path / "soak.md").read_text()


def test_soak_fails_on_memory_that_keeps_growing(soak, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter(range(1 << 30, 1 << 40, 1 << 21))  # one 2 MiB granule more at every call
    monkeypatch.setattr(soak, "process_used_bytes", lambda: next(readings))
    assert soak.main(["--out", str(tmp_path), "--minutes", "0.01", "--model", str(tmp_path / "model")]) == 1
    report = json.loads((tmp_path / "soak.json").read_text())
    assert any("device memory grew" in f for f in report["failures"])
