"""tools/sanitize_run.py, which runs one sanitizer shard of tools/gpu_suite.sh: a test that passes its time or
memory limit, or whose process crashes, is cut (its Python stacks printed first) and a new process runs the tests
after it; the deadline ends the shard; the log's summary names each cut."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shards = _load("sanitize_shards")
runner = _load("sanitize_run")

# A stand-in for `compute-sanitizer ... pytest`: each argument is ROOT/tests/gpu/t.py::BEHAVIOUR[i]; it records the
# phases as tests/gpu/conftest.py does and prints a sanitizer summary when it gets to its end.
FAKE = r'''
import faulthandler, json, os, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
times = os.environ["DDTREE_TEST_TIMES"]
def record(node, when, seconds):
    with open(times, "a") as out:
        out.write(json.dumps({"nodeid": node, "when": when, "seconds": seconds, "outcome": "passed",
                              "tool": "racecheck", "at": time.time()}) + "\n")
def hang_here():
    time.sleep(60)
held = []
for arg in sys.argv[1:]:
    node = "tests/gpu/" + arg.split("/tests/gpu/", 1)[1]
    record(node, "setup", 0.0)
    behaviour = node.split("::")[1].split("[")[0]
    if behaviour == "hang":
        hang_here()
    elif behaviour == "grow":
        while True:
            held.append(bytearray(32 << 20))
            time.sleep(0.02)
    elif behaviour == "crash":
        os._exit(9)
    record(node, "call", 0.01)
    record(node, "teardown", 0.0)
print(f"{len(sys.argv) - 1} passed in 0.10s")
print("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)")
'''


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "POLL_SECONDS", 0.1)
    monkeypatch.setattr(runner, "DUMP_SECONDS", 0.5)
    monkeypatch.setattr(runner, "TERM_SECONDS", 2.0)
    monkeypatch.setattr(runner, "MIN_PROCESS_SECONDS", 1.0)


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture, ids: list[str],
         seconds: float = 60.0, test_limit: float = 0.0, memory_mb: int = 0) -> tuple[int, str, list[dict]]:
    fake = tmp_path / "fake.py"
    fake.write_text(FAKE)
    times = tmp_path / "shard.times.jsonl"
    monkeypatch.setenv("DDTREE_TEST_TIMES", str(times))
    # as compute-sanitizer does, a parent process that stays beside the test process (and that SIGUSR1 would end)
    command = ["bash", "-c", f'"{sys.executable}" "{fake}" "$@"; exit $?', "sanitizer"]
    rc = runner.run_shard(command, ROOT, ids, times, "racecheck", time.time() + seconds, test_limit, memory_mb)
    log = capfd.readouterr()
    records = [json.loads(line) for line in times.read_text().splitlines()]
    return rc, log.out + log.err, records


def _cuts(records: list[dict]) -> list[tuple[str, str]]:
    return [(r["nodeid"].split("::")[1], r["reason"]) for r in records if r["when"] == "cut"]


def test_a_clean_shard_is_one_process(tmp_path, monkeypatch, capfd, fast) -> None:
    ids = [f"tests/gpu/t.py::ok[{i}]" for i in range(3)]
    rc, log, records = _run(tmp_path, monkeypatch, capfd, ids)
    assert rc == 0 and log.count("gpu_suite: process ") == 2 and "gpu_suite: shard exit 0 after" in log, log
    line, failed = shards.summary_line("racecheck", [("a.log", shards.shard_report(log))])
    assert not failed and line.startswith("racecheck: 0 errors, 0 warnings over 1 shards"), line
    assert "tests 3 passed" in line


def test_cut_tests_leave_the_rest_of_the_shard_to_new_processes(tmp_path, monkeypatch, capfd, fast) -> None:
    ids = ["tests/gpu/t.py::ok[0]", "tests/gpu/t.py::hang[1]", "tests/gpu/t.py::ok[2]", "tests/gpu/t.py::grow[3]",
           "tests/gpu/t.py::crash[4]", "tests/gpu/t.py::ok[5]"]
    rc, log, records = _run(tmp_path, monkeypatch, capfd, ids, test_limit=2.0, memory_mb=400)
    cuts = _cuts(records)
    assert [c[0] for c in cuts] == ["hang[1]", "grow[3]", "crash[4]"], log
    assert cuts[0][1] == "test limit 2 s" and cuts[1][1].startswith("memory ") and cuts[2][1] == "exit 9"
    finished = [r["nodeid"].split("::")[1] for r in records if r["when"] == "teardown"]
    assert finished == ["ok[0]", "ok[2]", "ok[5]"]
    assert "in hang_here" in log  # the stacks, printed before the kill
    assert rc == 9 and log.count("gpu_suite: process ") == 8, log  # 4 processes: "over" and "exit" lines
    line, failed = shards.summary_line("racecheck", [("a.log", shards.shard_report(
        log, (tmp_path / "shard.times.jsonl").read_text()))])
    assert failed and "tests 3 passed" in line, line
    assert re.search(r"a\.log: cut hang\[1\] after \d+ s \(test limit 2 s\)", line), line
    assert "a.log: cut grow[3] after" in line and "a.log: cut crash[4] after" in line, line
    assert "a.log: exit 9" in line and "no sanitizer summary" not in line, line
    # the next split takes each cut test's time as at least what it ran
    assert shards.sanitizer_times([tmp_path / "shard.times.jsonl"], "racecheck")["tests/gpu/t.py::hang[1]"] >= 2.0


def test_the_deadline_ends_the_shard(tmp_path, monkeypatch, capfd, fast) -> None:
    ids = ["tests/gpu/t.py::ok[0]", "tests/gpu/t.py::hang[1]", "tests/gpu/t.py::ok[2]"]
    rc, log, records = _run(tmp_path, monkeypatch, capfd, ids, seconds=3.0)
    assert rc == runner.DEADLINE_EXIT and _cuts(records) == [("hang[1]", "deadline")], log
    assert log.count("gpu_suite: process ") == 2  # no process after the deadline
    line, failed = shards.summary_line("racecheck", [("a.log", shards.shard_report(log))])
    assert failed and "timed out (exit 124)" in line and "cut hang[1]" in line, line


def test_only_the_python_process_gets_the_stack_signal() -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        assert runner.is_test_process(os.getpid()) and not runner.is_test_process(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_process_that_runs_no_test_ends_the_shard(tmp_path, monkeypatch, capfd, fast) -> None:
    times = tmp_path / "shard.times.jsonl"
    monkeypatch.setenv("DDTREE_TEST_TIMES", str(times))
    rc = runner.run_shard([sys.executable, "-c", "import sys; sys.exit(4)"], ROOT, ["tests/gpu/t.py::ok[0]"],
                          times, "racecheck", time.time() + 60, 0.0, 0)
    assert rc == 4 and "process 1" not in capfd.readouterr().out and not times.exists()


def test_every_tool_runs_with_the_common_options_then_its_own_then_the_callers() -> None:
    for tool in ("memcheck", "racecheck", "initcheck", "synccheck"):
        command = runner.sanitizer_command(tool, ["--kernel-name", "kns=ddtree"])
        assert command[:3] == ["compute-sanitizer", "--tool", tool] and command[-2:] == ["--kernel-name", "kns=ddtree"]
        assert "--error-exitcode" in command and ("device" in command)
