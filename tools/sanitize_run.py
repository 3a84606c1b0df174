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
`gpu_suite: shard exit RC after S s`: 124 when the deadline left tests unrun, else the first non-zero exit of a
process that ended by itself, else 1 when a test was cut, else 0.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import TypedDict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sanitize_shards import node_ids  # noqa: E402
from sanitizer_process import TOOL_OPTIONS, sanitizer_command, supervise  # noqa: E402

MIN_PROCESS_SECONDS = 20.0  # no new process with less time left than this before the deadline
DEADLINE_EXIT = 124  # as timeout(1): tools/sanitize_shards.py reads it as the shard timed out


class TestRecord(TypedDict):
    """A line of the tests' JSONL (tests/gpu/conftest.py; `cut` ones from here): `when` is start, setup, call,
    teardown or cut."""

    nodeid: str
    when: str
    seconds: float
    outcome: str
    tool: str
    at: float


def read_records(path: Path) -> list[TestRecord]:
    """The records so far; a last line still being written is left for the next read."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().split("\n")[:-1]:  # only whole lines (each ends in a newline)
        if line.strip():
            records.append(json.loads(line))
    return records


def in_flight(records: list[TestRecord], since: float) -> TestRecord | None:
    """The start record of the test running in a process that started at `since`: started, not torn down."""
    ended = {r["nodeid"] for r in records if r["when"] == "teardown" and r["at"] >= since}
    starts = [r for r in records if r["when"] == "start" and r["at"] >= since and r["nodeid"] not in ended]
    return starts[-1] if starts else None


def cut_record(start: TestRecord, ended_at: float, tool: str, reason: str) -> dict:
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
        print(f"gpu_suite: process {index} over {len(remaining)} tests", flush=True)
        started = time.time()

        def reason_to_end(used_mb: int) -> str | None:
            if time.time() >= until:
                return "deadline"
            running = in_flight(read_records(times), started)
            if test_limit > 0 and running is not None and time.time() - running["at"] > test_limit:
                return f"test limit {test_limit:.0f} s"
            if 0 < memory_limit_mb < used_mb:
                return f"memory {used_mb} MB over {memory_limit_mb} MB"
            return None

        rc, reason, _ = supervise(command + [str(root / i) for i in remaining], sys.stdout, reason_to_end)
        ended = time.time()
        if reason is not None:
            print(f"gpu_suite: ended process {index} ({reason})", flush=True)
        print(f"gpu_suite: process {index} exit {rc} after {ended - started:.0f} s", flush=True)
        if reason is None and rc != 0 and first_failure == 0:
            first_failure = rc
        records = read_records(times)
        running = in_flight(records, started)
        if running is not None:
            record = cut_record(running, ended, tool, reason or f"exit {rc}")
            with times.open("a") as out:
                out.write(json.dumps(record) + "\n")
            print(f"gpu_suite: cut {record['nodeid']} after {record['seconds']:.0f} s ({record['reason']})",
                  flush=True)
            cut_any = True
        finished = {r["nodeid"] for r in records if r["when"] == "teardown"}
        left = [i for i in remaining if i not in finished and (running is None or i != running["nodeid"])]
        stalled = len(left) == len(remaining)  # it started no test: a collection error, or an end before the first
        remaining = left
        if reason == "deadline":
            deadline = bool(left)
            break
        if stalled:
            print(f"gpu_suite: {len(left)} tests not run (no test started in process {index}; its log says why)",
                  flush=True)
            first_failure = first_failure or 1
            break
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
    # timeout(1) ends this script with SIGTERM: as an exit, so that the running session is ended with it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ids = node_ids(Path(args.nodeids).read_text().splitlines())
    return run_shard(sanitizer_command(args.tool, args.sanitizer_args.split()) + command, Path(args.root), ids,
                     Path(args.times), args.tool, args.until, args.test_limit, args.memory_limit_mb)


if __name__ == "__main__":
    sys.exit(main())
