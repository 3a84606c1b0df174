"""tools/sanitize_shards.py, which tools/gpu_suite.sh uses to run the GPU tests under compute-sanitizer in parallel
shards: balanced shards holding every node id exactly once, durations from the latest junit xml, unknown tests at
the median, -k subsets; and the one summary line over the shards' logs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "sanitize_shards.py"
_spec = importlib.util.spec_from_file_location("sanitize_shards", SCRIPT)
shards = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shards)


def _xml(path: Path, cases: dict[str, float], timestamp: str = "2026-12-01T00:00:00") -> Path:
    rows = []
    for node_id, seconds in cases.items():
        classname, name = shards.junit_key(node_id)
        rows.append(f'<testcase classname="{classname}" name="{name}" time="{seconds}" />')
    path.write_text(f'<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">'
                    f'<testsuite name="pytest" timestamp="{timestamp}">{"".join(rows)}</testsuite></testsuites>')
    return path


def _ids(count: int, module: str = "tests/gpu/test_a.py") -> list[str]:
    return [f"{module}::test_case[{i}-x y]" for i in range(count)]


def test_junit_key_follows_pytest_naming() -> None:
    assert shards.junit_key("tests/gpu/test_a.py::test_b[0.8-16-k2-layers]") == ("tests.gpu.test_a",
                                                                                 "test_b[0.8-16-k2-layers]")
    assert shards.junit_key("tests/gpu/test_a.py::Cls::test_b") == ("tests.gpu.test_a.Cls", "test_b")


def test_collect_output_yields_each_node_id_once() -> None:
    lines = ["tests/gpu/test_a.py::test_x[1]", "tests/gpu/test_a.py::test_x[1]", "tests/gpu/test_b.py::test_y",
             "  message naming ns::value", "", "3 tests collected in 0.5s", "===== warnings summary ====="]
    assert shards.node_ids(lines) == ["tests/gpu/test_a.py::test_x[1]", "tests/gpu/test_b.py::test_y"]


def test_shards_are_balanced_and_hold_every_node_id_once() -> None:
    ids = _ids(40)
    weights = [float((7 * i) % 13 + 1) for i in range(40)]
    weights[3] = 100.0  # longer than a sixth of the whole: alone on its shard
    parts = shards.split(ids, weights, 6)
    assert sorted(i for part in parts for i in part) == sorted(ids)
    assert all(part == sorted(part, key=ids.index) for part in parts)  # collection order kept in each shard
    loads = sorted(sum(weights[ids.index(i)] for i in part) for part in parts)
    assert loads[-1] == 100.0 and [ids[3]] in parts
    rest = loads[:-1]
    assert rest[-1] - rest[0] <= max(weights[:3] + weights[4:])  # greedy longest-first: within one test


def test_fewer_tests_than_shards_gives_no_empty_shard() -> None:
    assert shards.split(_ids(3), [1.0, 2.0, 3.0], 8) == [[_ids(3)[2]], [_ids(3)[1]], [_ids(3)[0]]]
    assert shards.split(_ids(3), [1.0, 1.0, 1.0], 1) == [_ids(3)]


def test_latest_xml_wins_and_unknown_tests_take_the_median(tmp_path: Path) -> None:
    ids = _ids(5)
    old = _xml(tmp_path / "old.xml", {ids[0]: 100.0, ids[1]: 1.0, ids[2]: 2.0}, "2026-12-01T00:00:00")
    new = _xml(tmp_path / "new.xml", {ids[0]: 9.0, ids[3]: 4.0}, "2026-12-02T00:00:00")
    for order in ([old, new], [new, old]):  # the timestamp decides, not the order given
        times = shards.junit_times(order)
        # ids[0] from the newer run, ids[1..3] where known, ids[4] unknown: the median of 9, 1, 2, 4
        assert shards.durations(ids, times) == [9.0, 1.0, 2.0, 4.0, 3.0]
    assert shards.durations(ids[:2], {}) == [1.0, 1.0]


def test_node_ids_relative_to_another_root_still_match(tmp_path: Path) -> None:
    times = shards.junit_times([_xml(tmp_path / "t.xml", {"tests/gpu/test_a.py::test_b[1]": 7.0})])
    assert shards.durations(["gpu/test_a.py::test_b[1]"], times) == [7.0]


def test_split_command_writes_shard_files_of_a_k_subset(tmp_path: Path) -> None:
    every = _ids(12, "tests/gpu/test_a.py") + _ids(12, "tests/gpu/test_b.py")
    xml = _xml(tmp_path / "full.xml", {node_id: float(i % 5 + 1) for i, node_id in enumerate(every)})
    subset = [i for i in every if "test_b" in i][:7]  # what `--collect-only -q -k ...` prints for a subset
    collected = tmp_path / "collect.txt"
    collected.write_text("\n".join(subset) + "\n\n7/24 tests collected (17 deselected) in 1.0s\n")
    out = subprocess.run([sys.executable, str(SCRIPT), "split", "--shards", "3", "--out-dir", str(tmp_path / "s"),
                          "--nodeids", str(collected), "--times", str(xml)], capture_output=True, text=True,
                         check=True)
    paths = out.stdout.split()
    assert paths == [str(tmp_path / "s" / f"shard_{i}.txt") for i in range(3)]
    written = [Path(p).read_text().splitlines() for p in paths]
    assert sorted(i for part in written for i in part) == sorted(subset)
    assert out.stderr.count("tests,") == 3


def test_split_command_refuses_empty_input(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "split", "--shards", "2", "--out-dir", str(tmp_path)],
                         input="no tests ran in 0.1s\n", capture_output=True, text=True)
    assert out.returncode == 1 and "no node ids" in out.stderr


MEMCHECK_LOG = """========= COMPUTE-SANITIZER
....s                                                                    [100%]
4 passed, 1 skipped, 2 warnings in 31.20s
See https://nanobind.readthedocs.io/en/latest/refleaks.html========= ERROR SUMMARY: 0 errors
gpu_suite: shard exit 0 after 40 s
"""


def _logs(tmp_path: Path, texts: list[str]) -> list[str]:
    paths = []
    for i, text in enumerate(texts):
        path = tmp_path / f"sanitize_tool_{i}.log"
        path.write_text(text)
        paths.append(str(path))
    return paths


def test_summary_of_clean_shards(tmp_path: Path) -> None:
    logs = _logs(tmp_path, [MEMCHECK_LOG, MEMCHECK_LOG.replace("40 s", "75 s")])
    out = subprocess.run([sys.executable, str(SCRIPT), "summary", "--tool", "memcheck", *logs],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout
    assert out.stdout.strip() == ("memcheck: 0 errors over 2 shards (slowest 75 s); "
                                  "tests 8 passed, 0 failed, 2 skipped")


@pytest.mark.parametrize("text,problem", [
    (MEMCHECK_LOG.replace("0 errors", "3 errors").replace("exit 0", "exit 86"), "3 errors"),
    (MEMCHECK_LOG.replace("4 passed", "3 passed, 1 failed").replace("exit 0", "exit 1"), "exit 1"),
    ("========= COMPUTE-SANITIZER\n....\ngpu_suite: shard exit 124 after 540 s\n", "timed out (exit 124)"),
    ("....\n", "no exit line"),
    (MEMCHECK_LOG.replace("See https", 'nanobind: leaked 2 instances!\n - leaked instance 0x1 of type "ddtree._native.Engine"'
                          "\nSee https"), "native objects alive at exit (nanobind: 2 instances)"),
    (MEMCHECK_LOG.replace("See https", "nanobind: leaked 3 functions!\nSee https"),
     "native objects alive at exit (nanobind: 0 instances)"),
])
def test_summary_fails_on_any_bad_shard(tmp_path: Path, text: str, problem: str) -> None:
    line, failed = shards.summary_line("memcheck", [(Path(p).name, shards.shard_report(Path(p).read_text()))
                                                    for p in _logs(tmp_path, [MEMCHECK_LOG, text])])
    assert failed and f"sanitize_tool_1.log: {problem}" in line, line


def test_summary_of_racecheck_counts_errors_and_warnings() -> None:
    text = ("========= RACECHECK SUMMARY: 12 hazards displayed (10 errors, 2 warnings)\n"
            "2 passed in 9.00s\ngpu_suite: shard exit 86 after 12 s\n")
    report = shards.shard_report(text)
    assert (report["errors"], report["warnings"], report["counts"]) == (10, 2, {"passed": 2})
    line, failed = shards.summary_line("racecheck", [("a.log", report)])
    assert failed and line.startswith("racecheck: 10 errors, 2 warnings over 1 shards")


def test_a_cut_shard_counts_the_reports_it_printed() -> None:
    text = ("========= COMPUTE-SANITIZER\n..\n"
            "========= Invalid __global__ read of size 4 bytes\n=========     at kernel()+0x10\n=========\n"
            "========= Error: Race reported between Write access at 0x1 and Read access at 0x2\n"
            "========= Warning: Race reported between Read access at 0x3 and Write access at 0x4\n"
            "========= Error: process didn't terminate successfully\n"
            "========= warnings summary =========\n"
            "gpu_suite: shard exit 124 after 540 s\n")
    report = shards.shard_report(text)
    assert (report["errors"], report["warnings"], report["unsummarized"]) == (2, 1, [2])
    clean = shards.shard_report(MEMCHECK_LOG)
    line, failed = shards.summary_line("racecheck", [("a.log", report), ("b.log", clean)])
    assert failed and line.startswith("racecheck: 2 errors, 1 warnings over 2 shards"), line
    assert "a.log: no sanitizer summary (2 errors printed before it ended)" in line, line
    clean_cut = shards.shard_report("========= COMPUTE-SANITIZER\n....\ngpu_suite: shard exit 124 after 540 s\n")
    assert (clean_cut["errors"], clean_cut["unsummarized"]) == (0, [0])


def _jsonl(path: Path, phases: list[tuple], at: float = 0.0) -> Path:
    """Records of (node id, phase, seconds[, outcome: passed when left out])."""
    path.write_text("".join(json.dumps({"nodeid": n, "when": w, "seconds": s, "outcome": (*rest, "passed")[0],
                                        "tool": "memcheck", "at": at + k}) + "\n"
                            for k, (n, w, s, *rest) in enumerate(phases)))
    return path


def test_sanitizer_times_come_first_and_scale_the_plain_ones(tmp_path: Path) -> None:
    ids = _ids(4)
    xml = shards.junit_times([_xml(tmp_path / "plain.xml", {ids[0]: 1.0, ids[1]: 2.0, ids[2]: 4.0})])
    newer = _jsonl(tmp_path / "b.jsonl", [(ids[0], "setup", 5.0), (ids[0], "call", 25.0), (ids[0], "teardown", 0.0),
                                          (ids[1], "call", 20.0), (ids[1], "teardown", 0.0)], at=100.0)
    older = _jsonl(tmp_path / "a.jsonl", [(ids[0], "call", 99.0), (ids[0], "teardown", 0.0)])
    measured = shards.sanitizer_times([newer, older])
    assert measured == {ids[0]: 30.0, ids[1]: 20.0}  # phases summed, the run that ended it last
    # ids[2] only in the plain run: 4 s times the median slowdown of 30x and 10x; ids[3] in neither: the plain
    # median (2 s) times it too
    assert shards.shard_weights(ids, xml, measured) == [30.0, 20.0, 80.0, 40.0]
    assert shards.shard_weights(ids, xml, {}) == shards.durations(ids, xml)


def test_gpu_conftest_records_each_phase_as_it_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "gpu"))
    spec = importlib.util.spec_from_file_location("gpu_conftest", ROOT / "tests" / "gpu" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    times = tmp_path / "times.jsonl"
    monkeypatch.setenv("DDTREE_TEST_TIMES", str(times))
    monkeypatch.setenv("DDTREE_SANITIZE_TOOL", "racecheck")
    node = "tests/gpu/test_a.py::test_b[1]"
    for when, seconds in (("setup", 0.5), ("call", 2.0), ("teardown", 0.25)):
        conftest.pytest_runtest_logreport(SimpleNamespace(nodeid=node, when=when, duration=seconds, outcome="passed"))
        assert len(times.read_text().splitlines()) == ("setup", "call", "teardown").index(when) + 1  # at once
    assert shards.sanitizer_times([times], "racecheck") == {node: 2.75}
    assert shards.sanitizer_times([times], "memcheck") == {}


def test_a_test_cut_before_its_teardown_does_not_count(tmp_path: Path) -> None:
    ids = _ids(2)
    cut = _jsonl(tmp_path / "cut.jsonl", [(ids[0], "setup", 0.1), (ids[0], "call", 3.0), (ids[0], "teardown", 0.1),
                                          (ids[1], "setup", 0.2)])  # ids[1] running when the timeout came
    assert shards.sanitizer_times([cut]) == {ids[0]: 3.2}


def test_a_cut_test_counts_the_time_it_ran_until_a_run_finishes_it(tmp_path: Path) -> None:
    ids = _ids(2)
    path = _jsonl(tmp_path / "a.jsonl", [(ids[0], "start", 0.0), (ids[0], "setup", 1.0), (ids[0], "call", 2.0),
                                         (ids[0], "teardown", 0.5), (ids[1], "start", 0.0), (ids[1], "setup", 4.0),
                                         (ids[1], "cut", 61.0, "cut")], at=100.0)
    assert shards.sanitizer_times([path]) == {ids[0]: 3.5, ids[1]: 61.0}  # start records add nothing
    # a later run that finishes it wins over the cut
    done = _jsonl(tmp_path / "b.jsonl", [(ids[1], "call", 30.0), (ids[1], "teardown", 0.0)], at=200.0)
    assert shards.sanitizer_times([path, done])[ids[1]] == 30.0
    assert shards.times_counts(path.read_text()) == {"passed": 1}


def test_a_split_test_shares_its_measured_time_among_its_cases() -> None:
    measured = {"t.py::f[0-tiny]": 60.0, "t.py::f[0-tiny-fused]": 8.0, "t.py::g[1]": 5.0}
    ids = ["t.py::f[0-tiny-b1]", "t.py::f[0-tiny-b2]", "t.py::f[0-tiny-b3]", "t.py::f[0-tiny-fused-b1]",
           "t.py::f[0-tiny-fused-b2]", "t.py::g[1]", "t.py::g[10-x]"]
    # the longest measured parent wins (tiny-fused, not tiny); g[1] is itself collected, so no parent of g[10-x]
    assert shards.split_case_times(ids, measured) == {
        "t.py::f[0-tiny-b1]": 20.0, "t.py::f[0-tiny-b2]": 20.0, "t.py::f[0-tiny-b3]": 20.0,
        "t.py::f[0-tiny-fused-b1]": 4.0, "t.py::f[0-tiny-fused-b2]": 4.0}


def test_a_cut_shard_counts_its_tests_from_its_times(tmp_path: Path) -> None:
    ids = _ids(3)
    log = tmp_path / "sanitize_memcheck_0.log"
    log.write_text("========= COMPUTE-SANITIZER\n.F\ngpu_suite: shard exit 124 after 554 s\n")
    _jsonl(tmp_path / "sanitize_memcheck_0.times.jsonl",
           [(ids[0], "setup", 1.0), (ids[0], "call", 2.0), (ids[0], "teardown", 0.1),
            (ids[1], "setup", 1.0), (ids[1], "call", 2.0, "failed"), (ids[1], "teardown", 0.1),
            (ids[2], "setup", 1.0)])
    out = subprocess.run([sys.executable, str(SCRIPT), "summary", "--tool", "memcheck", str(log)],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert "tests 1 passed, 1 failed, 0 skipped" in out.stdout and "timed out (exit 124)" in out.stdout, out.stdout


def test_a_shard_of_several_processes_sums_them() -> None:
    text = ("gpu_suite: process 0 over 3 tests\n========= COMPUTE-SANITIZER\n"
            "========= Error: Race reported between Write access at 0x1 and Read access at 0x2\n"
            "gpu_suite: ending process (test limit 60 s)\ngpu_suite: process 0 exit 143 after 70 s\n"
            "gpu_suite: cut tests/gpu/t.py::slow[1] after 61 s (test limit 60 s)\n"
            "gpu_suite: process 1 over 1 tests\n========= COMPUTE-SANITIZER\n.\n1 passed in 3.00s\n"
            "========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)\n"
            "gpu_suite: process 1 exit 86 after 5 s\ngpu_suite: shard exit 86 after 75 s\n")
    report = shards.shard_report(text)
    assert (report["errors"], report["unsummarized"]) == (3, [])
    assert report["cuts"] == [("tests/gpu/t.py::slow[1]", 61, "test limit 60 s", 1)]
    line, failed = shards.summary_line("racecheck", [("a.log", report)])
    assert failed and line.startswith("racecheck: 3 errors, 0 warnings"), line
    assert "a.log: cut slow[1] after 61 s (test limit 60 s; 1 errors printed before it)" in line, line
    assert "a.log: 3 errors" in line and "exit 86" in line, line
    # a process that ended without its summary and was not cut (the sanitizer itself died)
    lost = shards.shard_report(text.replace("gpu_suite: cut tests/gpu/t.py::slow[1] after 61 s (test limit 60 s)\n",
                                            ""))
    assert lost["unsummarized"] == [1]
    assert "a.log: no sanitizer summary (1 errors printed before it ended)" in shards.summary_line(
        "racecheck", [("a.log", lost)])[0]
