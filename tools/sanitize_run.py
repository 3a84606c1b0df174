#!/usr/bin/env python3
"""One sanitizer shard: its tests under compute-sanitizer, in as many processes as it takes to get past the tests
that have to be cut.

    sanitize_run.py --tool TOOL --nodeids SHARD --root DIR --times JSONL --until EPOCH
                    [--test-limit SECONDS] [--memory-limit-mb MB] [--sanitizer-args ARGS] -- COMMAND ...

COMMAND (`python3 -m pytest ...`) runs under compute-sanitizer (sanitizer_command: the tool, the options every run
takes, then ARGS) over the shard's node ids (relative to DIR, as the tests record them; given to pytest under DIR),
appended to it, in a session of its own. The tests record each phase in JSONL as it ends (DDTREE_TEST_TIMES, which the
caller sets; tests/gpu/conftest.py writes it). A process is ended when the deadline EPOCH passes, when its test
has run --test-limit seconds, or when its processes' resident memory passes --memory-limit-mb: the shards share
the host's memory, and one test's growth would otherwise bring the kernel's OOM killer onto whichever process it
picks. Before the kill, SIGUSR1 makes the test process print its Python stacks (conftest registers it with
faulthandler in the sanitizer mode): where the test was. A process that ends inside a test, by such a kill or by
itself (a crash), leaves a `cut` record of that test in JSONL, with how long it ran and why it was cut
(tools/sanitize_shards.py takes it as a lower bound of the test's time), and a new process runs the shard's tests
after it; the deadline ends the shard.

Everything goes to stdout, the shard's log: each process between `gpu_suite: process I over N tests` and
`gpu_suite: process I exit RC after S s`, each cut as `gpu_suite: cut NODE after S s (REASON)`, and last
`gpu_suite: shard exit RC after S s`: 124 when the deadline cut it, else the first non-zero exit of a process that
ended by itself, else 1 when a test was cut, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sanitize_shards import cut_record, node_ids  # noqa: E402

# Every run's options. Host backtraces off: to print them, compute-sanitizer keeps a reference to the Python frames of
# every CUDA call, which keeps each frame's locals (engines and their device memory) alive until exit; a kernel's
# errors still come with its device backtrace. API errors unreported: NCCL's initialization asks
# cudaFuncGetAttributes about each of its kernels and skips those without an sm_90 image (error 209, 8 reports per
# communicator); the runtime checks every CUDA call it makes outside destructors and raises, failing the test.
COMMON_OPTIONS = ("--show-backtrace", "device", "--report-api-errors", "no", "--error-exitcode", "86")
TOOL_OPTIONS = {
    "memcheck": ("--leak-check", "no"),  # leaks are caught a level up: nanobind reports engines alive at exit
    "racecheck": ("--racecheck-report", "all"),  # each hazard, not only the analysis
    "initcheck": (),
    "synccheck": (),
}
POLL_SECONDS = 2.0
DUMP_SECONDS = 3.0  # for the stacks to be written before the kill
TERM_SECONDS = 10.0  # SIGTERM, then SIGKILL
MIN_PROCESS_SECONDS = 20.0  # no new process with less time left than this before the deadline
DEADLINE_EXIT = 124  # as timeout(1): tools/sanitize_shards.py reads it as the shard timed out


def sanitizer_command(tool: str, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """compute-sanitizer with `tool`, the options every run takes, then `extra`."""
    return ["compute-sanitizer", "--tool", tool, *COMMON_OPTIONS, *TOOL_OPTIONS[tool], *extra]


def session_pids(sid: int) -> list[int]:
    """The processes of session `sid` (compute-sanitizer and the test process it started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


def resident_mb(pids: list[int]) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
    return total // 2**20


def is_test_process(pid: int) -> bool:
    """The Python process of the tests (not compute-sanitizer, whose command line names pytest too, and which
    SIGUSR1 would end)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return Path(argv[0].decode(errors="replace")).name.startswith("python")


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def end_session(proc: subprocess.Popen) -> None:
    """Python stacks of the test process, then SIGTERM to the session, then SIGKILL."""
    signal_all([p for p in session_pids(proc.pid) if is_test_process(p)], signal.SIGUSR1)
    time.sleep(DUMP_SECONDS)
    signal_all(session_pids(proc.pid), signal.SIGTERM)
    try:
        proc.wait(TERM_SECONDS)
    except subprocess.TimeoutExpired:
        pass
    signal_all(session_pids(proc.pid), signal.SIGKILL)
    proc.wait()


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def running_since(ids: list[str], records: list[dict], started: float) -> float:
    """When the test now running in a process over `ids` started: the end of the last phase recorded, or the
    process's start."""
    ats = [float(r["at"]) for r in records if r["nodeid"] in ids and float(r["at"]) >= started]
    return max(ats, default=started)


def run_process(command: list[str], root: Path, ids: list[str], times: Path, until: float, test_limit: float,
                memory_limit_mb: int) -> tuple[int, str | None]:
    """One process over `ids`; its exit status (128 + the signal for a killed one) and, when this script ended
    it, why."""
    started = time.time()
    proc = subprocess.Popen(command + [str(root / i) for i in ids], start_new_session=True)
    reason = None
    while proc.poll() is None:
        time.sleep(POLL_SECONDS)
        now = time.time()
        if now >= until:
            reason = "deadline"
        elif test_limit > 0 and now - running_since(ids, read_records(times), started) > test_limit:
            reason = f"test limit {test_limit:.0f} s"
        elif memory_limit_mb > 0:
            used = resident_mb(session_pids(proc.pid))
            if used > memory_limit_mb:
                reason = f"memory {used} MB over {memory_limit_mb} MB"
        if reason is not None and proc.poll() is None:
            print(f"gpu_suite: ending process ({reason})", flush=True)
            end_session(proc)
            break
    rc = proc.returncode
    return (128 - rc if rc < 0 else rc), reason


def run_shard(command: list[str], root: Path, ids: list[str], times: Path, tool: str, until: float,
              test_limit: float, memory_limit_mb: int) -> int:
    t0 = time.time()
    first_failure, cut_any, done, deadline = 0, False, False, False
    remaining = list(ids)
    index = 0
    while not done and not deadline:
        if until - time.time() < MIN_PROCESS_SECONDS:
            deadline = True  # tests left that no process has the time to run
            break
        print(f"gpu_suite: process {index} over {len(remaining)} tests", flush=True)
        started = time.time()
        rc, reason = run_process(command, root, remaining, times, until, test_limit, memory_limit_mb)
        ended = time.time()
        print(f"gpu_suite: process {index} exit {rc} after {ended - started:.0f} s", flush=True)
        if reason is None and rc != 0 and first_failure == 0:
            first_failure = rc
        deadline = reason == "deadline"
        records = read_records(times)
        ran = any(r["nodeid"] in remaining and float(r["at"]) >= started for r in records)
        record = cut_record(remaining, records, ended, tool, reason or f"exit {rc}", started)
        if record is None or (not ran and reason is None):
            done = True  # every test ended, or the process ran none (a collection error: its log says)
            break
        with times.open("a") as out:
            out.write(json.dumps(record) + "\n")
        print(f"gpu_suite: cut {record['nodeid']} after {record['seconds']:.0f} s ({record['reason']})", flush=True)
        cut_any = True
        finished = {r["nodeid"] for r in records if r["when"] == "teardown"}
        remaining = [i for i in remaining[remaining.index(record["nodeid"]) + 1:] if i not in finished]
        done = not remaining
        index += 1
    rc = DEADLINE_EXIT if deadline else first_failure or (1 if cut_any else 0)
    print(f"gpu_suite: shard exit {rc} after {time.time() - t0:.0f} s", flush=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tool", required=True, choices=sorted(TOOL_OPTIONS))
    parser.add_argument("--nodeids", required=True, help="the shard's node ids, one a line")
    parser.add_argument("--root", required=True, help="the directory the node ids are relative to")
    parser.add_argument("--times", required=True, help="the shard's .jsonl times (DDTREE_TEST_TIMES)")
    parser.add_argument("--until", type=float, required=True, help="epoch seconds by which the shard ends")
    parser.add_argument("--test-limit", type=float, default=0.0, help="seconds one test may run (0: no limit)")
    parser.add_argument("--memory-limit-mb", type=int, default=0,
                        help="resident memory the shard's processes may hold together (0: no limit)")
    parser.add_argument("--sanitizer-args", default="", help="more compute-sanitizer options (split at spaces)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command the node ids go after")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    if args.test_limit < 0 or args.memory_limit_mb < 0:
        parser.error("--test-limit and --memory-limit-mb must not be negative")
    ids = node_ids(Path(args.nodeids).read_text().splitlines())
    command = sanitizer_command(args.tool, args.sanitizer_args.split()) + command
    return run_shard(command, Path(args.root), ids, Path(args.times), args.tool, args.until, args.test_limit,
                     args.memory_limit_mb)


if __name__ == "__main__":
    sys.exit(main())
