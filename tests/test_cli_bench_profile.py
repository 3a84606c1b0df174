"""ddtree-run bench and profile on a machine without a GPU: bad options give one line naming the option and status 2
before anything loads; with no device the commands say so in one line (status 3); and their whole flow (the live
table, the report files, the graph listing and replays, --single, --stages) runs against a stand-in engine
(tests/fake_engine.py), so only the GPU's numbers are left to tests/gpu."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree import cli
from ddtree.bench import models
from ddtree.bench.oracle import hit_for
from ddtree.device import has_cuda_device, native_unavailable
from ddtree.engine import Engine
from ddtree.errors import RequestError
from fake_engine import FakeEngine


def _fails(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str, status: int = 2) -> str:
    assert cli.main(argv) == status
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "Traceback" not in captured.err + captured.out
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture()
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> list[FakeEngine]:
    """bench and profile run on FakeEngine, as if a device were there; the engines made, in order."""
    made: list[FakeEngine] = []

    def engine(self, streams: int, max_context: int, budget: int | None) -> FakeEngine:
        made.append(FakeEngine(streams, max_context, budget))
        return made[-1]

    monkeypatch.setattr(cli, "_require_device", lambda command: "a stand-in GPU")
    monkeypatch.setattr(models.ModelSource, "engine", engine)
    return made


@pytest.mark.parametrize(("argv", "needles"), [
    (["bench", "--budget", "2000"], ("--budget 2000", "1024")),
    (["bench", "--streams", "0"], ("--streams",)),
    (["bench", "--budget", "8", "8"], ("--budget", "twice")),
    (["bench", "--accept", "99"], ("--accept 99", "1..16")),
    (["bench", "--context", "3000"], ("--context 3000", "max_position_embeddings 2048")),
    (["bench", "-n", "1"], ("-n",)),
    (["bench", "--preset", "tiny", "--model", "x"], ("--preset",)),
    (["bench", "--preset", "k2-layers"], ("--layers",)),
    (["bench", "--preset", "tiny", "--layers", "2"], ("--layers",)),
    (["bench", "--model", "/no/such/dir"], ("--model /no/such/dir",)),
    (["bench", "--drafter", "/no/such/dir"], ("--drafter /no/such/dir",)),
    (["bench", "--accept", "nan"], ("--accept",)),
    (["profile", "--single"], ("--single", "--graph")),
    (["profile", "--single", "--graph", "x", "--replays", "3"], ("--single", "--replays")),
    (["profile", "--stages", "--method", "ar"], ("--stages",)),
    (["profile", "--budget", "4", "--method", "ar"], ("--budget",)),
    (["profile", "--budget", "5000"], ("--budget 5000",)),
    (["profile", "--replays", "20000"], ("--replays",)),
    (["profile", "--method", "tree"], ("--method",)),
    (["profile", "--graph", " "], ("--graph",)),
    (["profile", "--context", "4000"], ("--context 4000",)),
])
def test_bad_options_are_one_line(capsys: pytest.CaptureFixture[str], fake_gpu: list[FakeEngine], argv: list[str],
                                  needles: tuple[str, ...]) -> None:
    _fails(capsys, argv, *needles)
    assert not fake_gpu, "an engine was made before the options were checked"


def test_bench_out_must_be_a_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    _fails(capsys, ["bench", "--out", str(tmp_path / "file")], "--out", "not a directory")


def test_a_model_without_a_drafter_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                              tiny_model_dir: Path) -> None:
    _fails(capsys, ["bench", "--model", str(tiny_model_dir), "--drafter", str(tmp_path)], "config.json")
    target_only = tmp_path / "target"
    target_only.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.is_file():
            (target_only / f.name).symlink_to(f)
    _fails(capsys, ["bench", "--model", str(target_only)], "has no drafter")
    _fails(capsys, ["profile", "--model", str(target_only), "--method", "ddtree"], "has no drafter")


@pytest.mark.skipif(has_cuda_device() and native_unavailable() is None, reason="a CUDA device is present")
@pytest.mark.parametrize("command", ["bench", "profile"])
def test_without_a_gpu_the_commands_say_so(capsys: pytest.CaptureFixture[str], command: str) -> None:
    _fails(capsys, [command], command, "GPU engine", status=3)


def test_bench_flow_and_report(capsys: pytest.CaptureFixture[str], fake_gpu: list[FakeEngine],
                               tmp_path: Path) -> None:
    out = tmp_path / "report"
    argv = ["bench", "--streams", "1", "3", "--budget", "4", "8", "--context", "32", "-n", "16", "--out", str(out)]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "6 of 6 configurations measured" in captured.out
    assert len(fake_gpu) == 1 and (fake_gpu[0].streams, fake_gpu[0].max_context, fake_gpu[0].budget) == (3, 48, 8)
    report = json.loads((out / "bench.json").read_text())
    assert report["model"] == "the built-in demo pair" and report["device"] == "a stand-in GPU"
    rows = report["rows"]
    assert [(r["streams"], r["method"], r["budget"]) for r in rows] == [
        (1, "ar", 0), (1, "ddtree", 4), (1, "ddtree", 8), (3, "ar", 0), (3, "ddtree", 4), (3, "ddtree", 8)]
    assert all(r["exact"] for r in rows)
    assert rows[1]["mean_accept"] == 3.0 and rows[1]["speedup"] == pytest.approx(
        rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"])
    md = (out / "bench.md").read_text()
    assert md.count("\n| 32 |") == 6
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in captured.err
    else:
        assert (out / "bench.png").stat().st_size > 0


def test_bench_oracle_profiles_json(capsys: pytest.CaptureFixture[str], fake_gpu: list[FakeEngine]) -> None:
    argv = ["bench", "--preset", "tiny", "--accept", "2", "4", "--streams", "2", "--budget", "4", "--context", "16",
            "-n", "8", "--json"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "tiny, random weights"
    assert [(r["method"], r["target_accept"]) for r in report["rows"]] == [("ar", None), ("ddtree", 2.0),
                                                                         ("ddtree", 4.0)]
    assert any(name.endswith(" oracle") for name in fake_gpu[0].captured)


def test_profile_lists_replays_and_splits_stages(capsys: pytest.CaptureFixture[str],
                                                 fake_gpu: list[FakeEngine]) -> None:
    assert cli.main(["profile", "--stages", "--replays", "7"]) == 0
    out = capsys.readouterr().out
    engine = fake_gpu[0]
    assert [(name.split()[0], n, warm) for name, n, warm in engine.replayed] == [("ar", 7, True), ("round", 7, True)]
    for name in engine.captured:
        assert name in out
    assert "generate (ar)" in out and "generate (ddtree)" in out and "mean acceptance 3.00" in out
    assert "verify" in out and "66.7%" in out


def test_profile_single_replays_one_graph_once(capsys: pytest.CaptureFixture[str],
                                               fake_gpu: list[FakeEngine]) -> None:
    assert cli.main(["profile", "--method", "ar", "--single", "--graph", "ar streams=1 span=128"]) == 0
    assert fake_gpu[0].replayed == [("ar streams=1 span=128", 1, False)]
    assert "once, no warm-up" in capsys.readouterr().out


def test_profile_unknown_graph_lists_the_captured(capsys: pytest.CaptureFixture[str],
                                                  fake_gpu: list[FakeEngine]) -> None:
    _fails(capsys, ["profile", "--graph", "round streams=9"], "--graph 'round streams=9'", "ar streams=1 span=128")


def test_profile_json(capsys: pytest.CaptureFixture[str], fake_gpu: list[FakeEngine]) -> None:
    assert cli.main(["profile", "--method", "ddtree", "--budget", "5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [g["name"].split()[0] for g in doc["graphs"]] == ["round"]
    assert doc["graphs"][0]["replays"] == 20 and doc["generate"][0]["method"] == "ddtree"


def test_engine_replay_checks_its_arguments() -> None:
    engine = Engine.__new__(Engine)
    engine._native = None  # never reached
    for name, n in (("x", 0), ("x", 10001), ("x", True), (3, 5)):
        with pytest.raises(RequestError, match="name" if name == 3 else "n must"):
            engine.replay(name, n)


def test_hit_for_gives_the_chain_mean() -> None:
    for mean, depth in ((1.0, 7), (2.5, 7), (4.0, 15), (7.9, 7)):
        h = hit_for(mean, depth)
        assert sum(h ** d for d in range(depth + 1)) == pytest.approx(mean, abs=1e-6) if mean > 1 else h == 0.0


def test_demo_prompts_are_windows_of_python_text() -> None:
    source = models.model_source(None, None, None, None, cli.DEFAULT_MODEL_DIR, cli.DRAFTER_SUBDIR)
    prompts = source.prompts(4, 100)
    assert [len(p) for p in prompts] == [100] * 4 and len({tuple(p) for p in prompts}) == 4
    assert all(0 <= t < source.config.vocab_size for p in prompts for t in p)
