#!/usr/bin/env python3
"""One sanitizer shard: its tests under compute-sanitizer, in as many processes as it takes to get past the tests
that have to be cut.

    sanitize_run.py --tool TOOL --nodeids SHARD --root DIR --times JSONL --until EPOCH
                    [--test-limit SECONDS] [--memory-limit-mb MB] [--sanitizer-args ARGS] -- COMMAND ...

COMMAND (`python3 -m pytest ...`) runs under compute-sanitizer (tools/sanitizer_process.py: the tool, the options
every run takes, then ARGS, split at spaces) over the shard's node ids (relative to DIR, as the tests record them;
given to pytest under DIR), in a session of its own. The tests record in JSONL when each starts and each phase as it
ends (DDTREE_TEST_TIMES, which the caller sets; tests/gpu/conftest.py writes it), and this script reads it while they
run. A process is ended when the deadline EPOCH passes, when its test has run --test-limit seconds since it started,
or when its processes' resident memory passes --memory-limit-mb: the shards share the host's memory, and one test's
growth would otherwise bring the kernel's OOM killer onto whichever process it picks. Before the end, SIGUSR1 makes
the test process print its Python stacks (conftest registers it with faulthandler in the sanitizer mode): where the
test was. A test that a process ends inside (by such an end, or by itself: a crash) gets a `cut` record in JSONL
with how long it ran and why (tools/sanitize_shards.py takes it as a lower bound of its time), and a new process
runs the shard's tests that have not run. The deadline ends the shard, and so does a process that starts no test
(a collection error, say: its log says; the shard then fails).

Everything goes to stdout, the shard's log: each process between `gpu_suite: process I over N tests` and
`gpu_suite: process I exit RC after S s`, each cut as `gpu_suite: cut NODE after S s (REASON)`, and last
`gpu_suite: shard exit RC after S s`: 124 when the deadline ended a process, else the first non-zero exit of a
process that ended by itself or by a limit outside any test, else 1 when a test was cut, else 0. SIGTERM ends the
running session and this script (exit 143, without that last line).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import NotRequired, TypedDict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sanitize_shards import DEADLINE_EXIT, cut_line, exit_line, node_ids, process_line  # noqa: E402
from sanitizer_process import TOOL_OPTIONS, end_live_sessions, sanitizer_command, supervise  # noqa: E402

MIN_PROCESS_SECONDS = 20.0  # no new process with less time left than this before the deadline


class TestRecord(TypedDict):
    """A line of the tests' JSONL (tests/gpu/conftest.py; `cut` ones from here): `when` is start, setup, call,
    teardown or cut."""

    nodeid: str
    when: str
    seconds: float
    outcome: str
    tool: str
    at: float
    reason: NotRequired[str]  # a cut's


def read_records(path: Path, offset: int = 0) -> list[TestRecord]:
    """The records from byte `offset` on: whole lines only (a last line still being written waits for the next
    read), and none that does not parse."""
    if not path.exists():
        return []
    with path.open("rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").split("\n")[:-1]
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def in_flight(records: list[TestRecord]) -> TestRecord | None:
    """The start record of the test running in the process that wrote `records`: started, not torn down."""
    ended = {r["nodeid"] for r in records if r["when"] == "teardown"}
    starts = [r for r in records if r["when"] == "start" and r["nodeid"] not in ended]
    return starts[-1] if starts else None


def cut_record(start: TestRecord, ended_at: float, tool: str, reason: str) -> TestRecord:
    """The test `start` began, cut at `ended_at`: its seconds are a lower bound of its time (with the few seconds
    that ending its process took)."""
    return {"nodeid": start["nodeid"], "when": "cut", "seconds": max(0.0, ended_at - start["at"]), "outcome": "cut",
            "tool": tool, "at": ended_at, "reason": reason}


def run_shard(command: list[str], root: Path, ids: list[str], times: Path, tool: str, until: float,
              test_limit: float, memory_limit_mb: int) -> int:
    t0 = time.time()
    first_failure, cut_any, deadline = 0, False, False
    remaining = list(ids)
    index = 0
    while remaining:
        if until - time.time() < MIN_PROCESS_SECONDS:
            deadline = True  # tests left that no process has the time to run
            break
        print(process_line(index, len(remaining)), flush=True)
        started = time.time()
        offset = times.stat().st_size if times.exists() else 0  # this process's records come after

        def reason_to_end(used_mb: int) -> str | None:
            if time.time() >= until:
                return "deadline"
            running = in_flight(read_records(times, offset))
            if test_limit > 0 and running is not None and time.time() - running["at"] > test_limit:
                return f"test limit {test_limit:.0f} s"
            if 0 < memory_limit_mb < used_mb:
                return f"memory {used_mb} MB over {memory_limit_mb} MB"
            return None

        rc, reason, _ = supervise(command + [f"{root}/{i}" for i in remaining], sys.stdout, reason_to_end)
        ended = time.time()
        print(f"gpu_suite: process {index} exit {rc} after {ended - started:.0f} s", flush=True)
        running = in_flight(read_records(times, offset))
        if reason is not None:
            print(f"gpu_suite: ended process {index} ({reason})"
                  + ("" if running is not None else ", no test in flight"), flush=True)
        if rc != 0 and first_failure == 0 and (reason is None or running is None):
            first_failure = rc  # ended by itself, or by a limit outside any test: the process's own failure
        if running is not None:
            record = cut_record(running, ended, tool, reason or f"exit {rc}")
            with times.open("a") as out:
                out.write(json.dumps(record) + "\n")
            print(cut_line(record["nodeid"], record["seconds"], record["reason"]), flush=True)
            cut_any = True
        finished = {r["nodeid"] for r in read_records(times) if r["when"] == "teardown"}
        left = [i for i in remaining if i not in finished and (running is None or i != running["nodeid"])]
        stalled = len(left) == len(remaining)  # it started no test: a collection error, or an end before the first
        remaining = left
        if reason == "deadline":
            deadline = True
            break
        if stalled:
            print(f"gpu_suite: {len(left)} tests not run (no test started in process {index}; its log says why)",
                  flush=True)
            first_failure = first_failure or 1
            break
        index += 1
    rc = DEADLINE_EXIT if deadline else first_failure or (1 if cut_any else 0)
    print(exit_line(rc, time.time() - t0), flush=True)
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
    signal.signal(signal.SIGTERM, end_live_sessions)  # timeout(1)'s: the running session ends with this script
    ids = node_ids(Path(args.nodeids).read_text().splitlines())
    return run_shard(sanitizer_command(args.tool, args.sanitizer_args.split()) + command, Path(args.root), ids,
                     Path(args.times), args.tool, args.until, args.test_limit, args.memory_limit_mb)


if __name__ == "__main__":
    sys.exit(main())
