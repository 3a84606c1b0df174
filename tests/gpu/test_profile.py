"""Profiling on the GPU: Engine.graphs() names every captured graph, Engine.replay() times one on its own and
leaves the engine able to generate the same tokens again, and `ddtree-run profile` / `bench` run end to end on the
built-in demo pair (small sizes)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import ddtree  # noqa: E402
from ddtree import cli  # noqa: E402
from ddtree.bench.oracle import decode_ar, decode_ddtree, hit_for  # noqa: E402
from ddtree.errors import RequestError  # noqa: E402
from conftest import sanitizing  # noqa: E402

DEMO = cli.DEFAULT_MODEL_DIR
NAME = re.compile(r"ar streams=\d+ span=\d+|round streams=\d+ budget=\d+ depth=\d+ width=\d+ span=\d+ "
                  r"draft_span=\d+( oracle)?")



@pytest.fixture(scope="module")
def engine():
    return ddtree.Engine(DEMO, DEMO / cli.DRAFTER_SUBDIR, streams=2, max_context=256, budget=16)


def _prompts(engine, streams: int = 2) -> list[list[int]]:
    from ddtree.bench.models import model_source

    return model_source(None, None, None, None, DEMO, cli.DRAFTER_SUBDIR).prompts(streams, 48)


def test_graphs_are_named_for_their_keys(engine) -> None:
    prompts = _prompts(engine)
    decode_ar(engine, prompts, 24)
    decode_ddtree(engine, prompts, 24, 8)
    graphs = engine.graphs()
    names = [g.name for g in graphs]
    assert all(NAME.fullmatch(n) for n in names), names
    assert any(n.startswith("ar streams=2 ") for n in names)
    assert any(n.startswith("round streams=2 budget=8 depth=15 width=8 ") for n in names)
    assert all(g.nodes > 0 for g in graphs) and len(set(names)) == len(names)
    assert [g.kind for g in graphs] == sorted(g.kind for g in graphs)  # decode steps first


def test_replay_times_each_graph_and_generate_is_unchanged(engine) -> None:
    prompts = _prompts(engine)
    ar = decode_ar(engine, prompts, 24)
    tree = decode_ddtree(engine, prompts, 24, 8)
    reference = [list(t) for t in ar.tokens]
    hit = [hit_for(4.0, 15)] * 15
    oracle = decode_ddtree(engine, prompts, 24, 16, reference=reference, hit=hit)
    assert tree.tokens == ar.tokens and oracle.tokens == ar.tokens
    graphs = engine.graphs()
    assert any(g.name.endswith(" oracle") for g in graphs)
    for g in graphs:
        seconds = engine.replay(g.name, 5)
        assert math.isfinite(seconds) and 1e-6 < seconds < 1.0, (g.name, seconds)
        assert 0 < engine.replay(g.name, 1, warmup=False) < 1.0
    # Replays advanced the streams' device state; every generate starts anew from its prefill.
    assert decode_ar(engine, prompts, 24).tokens == ar.tokens
    again = decode_ddtree(engine, prompts, 24, 8)
    assert again.tokens == ar.tokens and again.accept_lengths == tree.accept_lengths
    again = decode_ddtree(engine, prompts, 24, 16, reference=reference, hit=hit)
    assert again.tokens == ar.tokens and again.accept_lengths == oracle.accept_lengths
    sampled = engine.generate(prompts, 24, temperature=0.8, seed=3, stop_token_ids=())
    for g in graphs:
        engine.replay(g.name, 2)
    assert [r.tokens for r in engine.generate(prompts, 24, temperature=0.8, seed=3, stop_token_ids=())] == \
        [r.tokens for r in sampled]


def test_replay_time_is_that_of_a_step(engine) -> None:
    """A decode step replayed alone costs about what it costs inside a generation (there at shorter contexts)."""
    prompts = _prompts(engine)
    decode_ar(engine, prompts, 32)
    step = decode_ar(engine, prompts, 32).round_seconds
    name = next(g.name for g in engine.graphs() if g.name.startswith("ar streams=2 "))
    replayed = engine.replay(name, 50)
    if sanitizing():  # the sanitizer's per-launch cost differs between a generation and a replay loop
        assert math.isfinite(replayed) and replayed > 0
    else:
        assert 0.5 * step < replayed < 2.0 * step


def test_replay_refuses_bad_arguments(engine) -> None:
    decode_ar(engine, _prompts(engine), 8)
    with pytest.raises(RequestError, match="name: no captured graph is called 'round streams=99'"):
        engine.replay("round streams=99", 3)
    with pytest.raises(RequestError, match="n must"):
        engine.replay(engine.graphs()[0].name, 0)


def test_profile_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["profile", "--stages", "--replays", "5", "-n", "16", "--context", "32"]) == 0
    out = capsys.readouterr().out
    assert "ar streams=1 span=" in out and "round streams=1 budget=15 depth=15" in out
    assert "verify" in out and "sum" in out
    assert cli.main(["profile", "--method", "ar", "-n", "16", "--context", "32", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    name = doc["graphs"][0]["name"]
    assert doc["graphs"][0]["ms"] > 0
    assert cli.main(["profile", "--method", "ar", "-n", "16", "--context", "32", "--single", "--graph", name]) == 0
    assert "once, no warm-up" in capsys.readouterr().out
    assert cli.main(["profile", "--method", "ar", "-n", "16", "--context", "32", "--graph", "ar streams=7"]) == 2
    assert "no captured graph" in capsys.readouterr().err


def test_bench_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["bench", "--streams", "1", "2", "--budget", "4", "15", "--context", "32", "-n", "24", "--out",
            str(tmp_path)]
    assert cli.main(argv) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert len(rows) == 6 and all(r["exact"] and r["tokens_per_s"] > 0 for r in rows)
    assert (tmp_path / "bench.md").is_file()
    capsys.readouterr()  # the first call's table
    argv = ["bench", "--streams", "2", "--budget", "8", "--context", "32", "-n", "24", "--accept", "6", "--json"]
    assert cli.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[1]["target_accept"] == 6 and rows[1]["mean_accept"] > 2.5 and rows[1]["exact"]
