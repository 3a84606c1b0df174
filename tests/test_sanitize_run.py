"""tools/sanitize_run.py and tools/sanitizer_process.py, which run one sanitizer shard of tools/gpu_suite.sh: a test
that passes its time or memory limit, or whose process crashes, is cut (its Python stacks printed first) and a new
process runs the tests that have not run; a test that ends while its stacks are printed is not cut; the deadline
ends the shard; nothing of a process outlives it; the log's summary names each cut."""

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
sys.path.insert(0, str(ROOT / "tools"))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shards = _load("sanitize_shards")
runner = _load("sanitize_run")
import sanitizer_process as process  # noqa: E402  (the module sanitize_run imported)

# A stand-in for `pytest`: each argument is ROOT/tests/gpu/t.py::BEHAVIOUR[i]; it records each test's start and
# phases as tests/gpu/conftest.py does, and prints a sanitizer summary when it gets to its end.
FAKE = r'''
import faulthandler, json, os, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
times = os.environ["DDTREE_TEST_TIMES"]
def record(node, when, seconds=0.0):
    with open(times, "a") as out:
        out.write(json.dumps({"nodeid": node, "when": when, "seconds": seconds, "outcome": "passed",
                              "tool": "racecheck", "at": time.time()}) + "\n")
def hang_here():
    time.sleep(60)
held = []
for arg in sys.argv[1:]:
    node = "tests/gpu/" + arg.split("/tests/gpu/", 1)[1]
    behaviour = node.split("::")[1].split("[")[0]
    record(node, "start")
    if behaviour == "crash_in_setup":
        os._exit(9)
    record(node, "setup")
    if behaviour == "hang":
        hang_here()
    elif behaviour == "grow":
        while True:
            held.append(bytearray(8 << 20))
            time.sleep(0.02)  # 400 MB/s: under 1 GB when the 1 s for the stacks is over
    elif behaviour == "crash":
        os._exit(9)
    elif behaviour == "just_over":  # past the limit, but done before its stacks are
        time.sleep(float(os.environ["JUST_OVER_SECONDS"]))
    elif behaviour == "nap":
        time.sleep(float(os.environ["NAP_SECONDS"]))
    record(node, "call", 0.01)
    record(node, "teardown")
print(f"{len(sys.argv) - 1} passed in 0.10s")
print("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)")
'''


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "POLL_SECONDS", 0.1)
    monkeypatch.setattr(process, "DUMP_SECONDS", 1.0)
    monkeypatch.setattr(process, "TERM_SECONDS", 2.0)
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
    records = [json.loads(line) for line in times.read_text().splitlines()] if times.exists() else []
    return rc, log.out + log.err, records


def _cuts(records: list[dict]) -> list[tuple[str, str]]:
    return [(r["nodeid"].split("::")[1], r["reason"]) for r in records if r["when"] == "cut"]


def _finished(records: list[dict]) -> list[str]:
    return [r["nodeid"].split("::")[1] for r in records if r["when"] == "teardown"]


def test_a_clean_shard_is_one_process(tmp_path, monkeypatch, capfd, fast) -> None:
    ids = [f"tests/gpu/t.py::ok[{i}]" for i in range(3)]
    rc, log, records = _run(tmp_path, monkeypatch, capfd, ids)
    assert rc == 0 and "gpu_suite: process 1" not in log and "gpu_suite: shard exit 0 after" in log, log
    line, failed = shards.summary_line("racecheck", [("a.log", shards.shard_report(log))])
    assert not failed and line.startswith("racecheck: 0 errors, 0 warnings over 1 shards"), line
    assert "tests 3 passed" in line


def test_cut_tests_leave_the_rest_of_the_shard_to_new_processes(tmp_path, monkeypatch, capfd, fast) -> None:
    ids = ["tests/gpu/t.py::ok[0]", "tests/gpu/t.py::hang[1]", "tests/gpu/t.py::ok[2]", "tests/gpu/t.py::crash[3]",
           "tests/gpu/t.py::crash_in_setup[4]", "tests/gpu/t.py::ok[5]"]
    rc, log, records = _run(tmp_path, monkeypatch, capfd, ids, test_limit=2.0)
    assert _cuts(records) == [("hang[1]", "test limit 2 s"), ("crash[3]", "exit 9"), ("crash_in_setup[4]", "exit 9")]
    assert _finished(records) == ["ok[0]", "ok[2]", "ok[5]"]
    assert "in hang_here" in log  # the stacks, printed before the end
    assert "gpu_suite: process 0 exit 143" in log  # SIGTERM's: SIGUSR1 reached the test process only
    assert rc == 9 and "gpu_suite: process 3 over 1 tests" in log, log
    line, failed = shards.summary_line("racecheck", [("a.log", shards.shard_report(
        log, (tmp_path / "shard.times.jsonl").read_text()))])
    assert failed and "tests 3 passed" in line, line
    assert re.search(r"a\.log: cut hang\[1\] after \d+ s \(test limit 2 s\)", line), line
    assert "a.log: cut crash_in_setup[4] after" in line, line
    assert "a.log: exit 9" in line and "no sanitizer summary" not in line, line
    # the next split takes each cut test's time as at least what it ran
    assert shards.sanitizer_times([tmp_path / "shard.times.jsonl"], "racecheck")["tests/gpu/t.py::hang[1]"] >= 2.0


def test_a_test_past_the_memory_limit_is_cut(tmp_path, monkeypatch, capfd, fast) -> None:
    rc, log, records = _run(tmp_path, monkeypatch, capfd, ["tests/gpu/t.py::grow[0]", "tests/gpu/t.py::ok[1]"],
                            memory_mb=300)
    [(cut, reason)] = _cuts(records)
    assert cut == "grow[0]" and re.fullmatch(r"memory \d+ MB over 300 MB", reason), log
    assert rc == 1 and _finished(records) == ["ok[1]"]


def test_a_test_that_ends_while_its_stacks_are_printed_is_not_cut(tmp_path, monkeypatch, capfd, fast) -> None:
    # the limit comes at 3 s, its check again at 5 s: just_over ended at 3.5 s, and nap, from then on, runs to
    # 6 s, inside its own limit; so the process goes on past the check
    monkeypatch.setattr(process, "DUMP_SECONDS", 2.0)
    monkeypatch.setenv("JUST_OVER_SECONDS", "3.5")
    monkeypatch.setenv("NAP_SECONDS", "2.5")
    ids = ["tests/gpu/t.py::just_over[0]", "tests/gpu/t.py::nap[1]", "tests/gpu/t.py::ok[2]"]
    rc, log, records = _run(tmp_path, monkeypatch, capfd, ids, test_limit=3.0)
    assert rc == 0 and _cuts(records) == [] and _finished(records) == ["just_over[0]", "nap[1]", "ok[2]"], log
    assert "gpu_suite: process 1" not in log


def test_a_cut_names_a_test_whose_id_holds_a_space(tmp_path, monkeypatch, capfd, fast) -> None:
    rc, log, records = _run(tmp_path, monkeypatch, capfd, ["tests/gpu/t.py::crash[a b]", "tests/gpu/t.py::ok[1]"])
    assert rc == 9 and _cuts(records) == [("crash[a b]", "exit 9")]
    [(node, _, reason, _)] = shards.shard_report(log)["cuts"]
    assert (node, reason) == ("tests/gpu/t.py::crash[a b]", "exit 9")


def test_the_deadline_ends_the_shard(tmp_path, monkeypatch, capfd, fast) -> None:
    ids = ["tests/gpu/t.py::ok[0]", "tests/gpu/t.py::hang[1]", "tests/gpu/t.py::ok[2]"]
    rc, log, records = _run(tmp_path, monkeypatch, capfd, ids, seconds=6.0)
    assert rc == runner.DEADLINE_EXIT and _cuts(records) == [("hang[1]", "deadline")], log
    assert "gpu_suite: process 1" not in log  # no process after the deadline
    line, failed = shards.summary_line("racecheck", [("a.log", shards.shard_report(log))])
    assert failed and "timed out (exit 124)" in line and "cut hang[1]" in line, line


def test_a_deadline_before_the_first_test_starts_is_a_deadline(tmp_path, monkeypatch, capfd, fast) -> None:
    times = tmp_path / "shard.times.jsonl"
    monkeypatch.setenv("DDTREE_TEST_TIMES", str(times))
    rc = runner.run_shard(["bash", "-c", "sleep 30"], ROOT, ["tests/gpu/t.py::ok[0]"], times, "racecheck",
                          time.time() + 2.0, 0.0, 0)
    out = capfd.readouterr().out
    assert rc == runner.DEADLINE_EXIT and "ended process 0 (deadline), no test in flight" in out, out


def test_a_process_that_starts_no_test_ends_the_shard(tmp_path, monkeypatch, capfd, fast) -> None:
    times = tmp_path / "shard.times.jsonl"
    monkeypatch.setenv("DDTREE_TEST_TIMES", str(times))
    rc = runner.run_shard([sys.executable, "-c", "import sys; sys.exit(4)"], ROOT, ["tests/gpu/t.py::ok[0]"],
                          times, "racecheck", time.time() + 60, 0.0, 0)
    out = capfd.readouterr().out
    assert rc == 4 and "process 1" not in out and "1 tests not run" in out and not times.exists()


def test_nothing_of_a_process_outlives_it(tmp_path, capfd, fast) -> None:
    # the leader exits and leaves a child running: the child is ended before the next process could start
    child = tmp_path / "child.pid"
    rc, reason, _ = process.supervise(["bash", "-c", f"sleep 60 & echo $! > {child}; exit 3"], None,
                                      lambda used: None)
    assert (rc, reason) == (3, None)
    pid = int(child.read_text())
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_pytest_prints_the_stacks_of_a_test_it_is_capturing(tmp_path, monkeypatch, capfd, fast) -> None:
    """The real thing: pytest with tests/gpu/conftest.py's hooks in the sanitizer mode, a test stuck past the limit
    while pytest captures its output."""
    gpu_tests = ROOT / "tests" / "gpu"
    (tmp_path / "conftest.py").write_text(
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(gpu_tests)!r})\n"
        f"spec = importlib.util.spec_from_file_location('gpu_conftest', {str(gpu_tests / 'conftest.py')!r})\n"
        "gpu = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(gpu)\n"
        "pytest_configure = gpu.pytest_configure\n"
        "pytest_runtest_logstart = gpu.pytest_runtest_logstart\n"
        "pytest_runtest_logreport = gpu.pytest_runtest_logreport\n")
    (tmp_path / "test_stuck.py").write_text(
        "import time\n\ndef stuck_in_here():\n    time.sleep(60)\n\n"
        "def test_stuck():\n    print('captured')\n    stuck_in_here()\n\ndef test_after():\n    pass\n")
    monkeypatch.setenv("DDTREE_SANITIZE", "1")
    times = tmp_path / "times.jsonl"
    monkeypatch.setenv("DDTREE_TEST_TIMES", str(times))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)]
    rc = runner.run_shard(command, tmp_path, ["test_stuck.py::test_stuck", "test_stuck.py::test_after"], times,
                          "racecheck", time.time() + 120, 3.0, 0)
    log = capfd.readouterr()
    out = log.out + log.err
    records = [json.loads(line) for line in times.read_text().splitlines()]
    assert "in stuck_in_here" in out, out
    assert rc == 1 and _cuts(records) == [("test_stuck", "test limit 3 s")] and _finished(records) == ["test_after"]


def test_every_tool_runs_with_the_common_options_then_its_own_then_the_callers() -> None:
    for tool in ("memcheck", "racecheck", "initcheck", "synccheck"):
        command = process.sanitizer_command(tool, ["--kernel-name", "kns=ddtree"])
        assert command[:3] == ["compute-sanitizer", "--tool", tool] and command[-2:] == ["--kernel-name", "kns=ddtree"]
        assert "--error-exitcode" in command and "device" in command
    # only a process with a SIGUSR1 handler gets the signal for the stacks: it would end one without
    handled = subprocess.Popen([sys.executable, "-c", "import faulthandler, signal, sys, time; "
                                "faulthandler.register(signal.SIGUSR1); print(flush=True); time.sleep(30)"],
                               stdout=subprocess.PIPE)
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        handled.stdout.readline()  # registered
        assert process.catches_sigusr1(handled.pid) and not process.catches_sigusr1(sleeper.pid)
    finally:
        for proc in (handled, sleeper):
            proc.kill()
            proc.wait()
