#!/usr/bin/env python3
"""Shards of the GPU tests for parallel compute-sanitizer processes, and the summary of their logs.

    sanitize_shards.py split --shards N --out-dir DIR [--nodeids FILE] [--times XML_OR_JSONL ...]
    sanitize_shards.py summary --tool TOOL LOG ...

`split` reads pytest node ids (the output of `pytest --collect-only -q`: lines holding `::`, the rest ignored) from
FILE or stdin, and writes at most N files DIR/shard_I.txt, one node id a line, balanced by the tests' durations.
Those of sanitizer runs come first: the .jsonl files that tests/gpu/conftest.py writes per shard (each test's phases
summed, the latest run that finished it, else the longest a cut let it run; with --tool, that tool's runs only), as
a sanitizer slows tests by very different factors. A test split out of a measured one by a new parameter (`t[a-b-c]`
of `t[a-b]`) shares its time. A test they lack takes its duration in the junit xml files (where several hold it, the
run that began last wins, by the testsuite's timestamp) times the median slowdown of the tests in both; a test in
none counts the median of the known ones. Each shard keeps the collection order, so a module's fixtures are built
once per shard. It prints the shard files' paths, one a line, and a line per shard on stderr with its test count and
estimated seconds.

A test that a sanitizer process ended inside (tools/sanitize_run.py: the deadline, a limit, a crash) has a `cut`
record in its shard's .jsonl with how long it had run: a lower bound of its time for the next split.

`summary` reads the shards' logs (tools/sanitize_run.py's, each ending in `gpu_suite: shard exit RC after S s`)
and prints one line: the sanitizer's errors (and racecheck's warnings) over every process's ERROR / RACECHECK
SUMMARY (for a process ended before it, the reports printed until then), the tests passed and failed (where a
process ended before pytest's last line, from the .times.jsonl beside its log), and every shard that failed, timed
out, had a test cut or a process end without its summary, or whose process ended with native objects alive
(nanobind's leak report). Its exit status is 1 if any shard did.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

EXIT_LINE = re.compile(r"gpu_suite: shard exit (\d+) after (\d+) s")
ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
RACECHECK_SUMMARY = re.compile(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
PYTEST_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b")
PYTEST_FINAL = re.compile(r"\bin \d+(\.\d+)?s\b")
NANOBIND_REPORT = "nanobind: leaked"  # its report of objects, types or functions alive at exit
NANOBIND_LEAKS = re.compile(r"nanobind: leaked (\d+) instances?")
PROCESS_LINE = re.compile(r"^gpu_suite: process \d+ over \d+ tests$", re.MULTILINE)
CUT_LINE = re.compile(r"^gpu_suite: cut (.+) after (\d+) s \((.*)\)$", re.MULTILINE)
DEADLINE_EXIT = 124  # a shard's exit when its deadline ended it (timeout(1)'s status)


# The lines of a shard's log that tools/sanitize_run.py writes and `summary` reads (the patterns above).
def process_line(index: int, tests: int) -> str:
    return f"gpu_suite: process {index} over {tests} tests"


def cut_line(node: str, seconds: float, reason: str) -> str:
    return f"gpu_suite: cut {node} after {seconds:.0f} s ({reason})"


def exit_line(rc: int, seconds: float) -> str:
    return f"gpu_suite: shard exit {rc} after {seconds:.0f} s"
# A report's first line is the sanitizer's prefix and an unindented text (its details are indented); these unindented
# lines are the tool's own, not reports. A shard cut before its summary is judged by its reports printed so far.
SANITIZER_LINE = re.compile(r"^========= (\S.*)$", re.MULTILINE)
NOT_A_REPORT = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY",
                "Error: process didn't terminate successfully", "Target application returned an error")


# ---- split ------------------------------------------------------------------------------------------------------

def node_ids(lines) -> list[str]:
    """The node ids among `pytest --collect-only -q` lines (unindented, a .py file before the first `::`), each
    once, in collection order."""
    seen: dict[str, None] = {}
    for line in lines:
        line = line.rstrip("\r\n")
        if line[:1].strip() and line.split("::", 1)[0].endswith(".py") and "::" in line:
            seen.setdefault(line.rstrip(), None)
    return list(seen)


def junit_key(node_id: str) -> tuple[str, str]:
    """(classname, name) of a node id as pytest's junit xml writes it: `tests/gpu/test_a.py::Cls::test_b[x]` is
    (`tests.gpu.test_a.Cls`, `test_b[x]`)."""
    path, *rest = node_id.split("::")
    module = path[:-3] if path.endswith(".py") else path
    return ".".join([module.replace("\\", "/").strip("/").replace("/", "."), *rest[:-1]]), rest[-1] if rest else ""


def junit_times(xml_paths) -> dict[tuple[str, str], float]:
    """Each test's duration, taken from the xml whose run began last (ISO timestamps sort as text; a file with
    none counts as the oldest, in the order given)."""
    runs = []
    for order, path in enumerate(xml_paths):
        root = ET.parse(path).getroot()
        suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
        for suite in suites:
            runs.append((suite.get("timestamp", ""), order, suite))
    times: dict[tuple[str, str], float] = {}
    for _, _, suite in sorted(runs, key=lambda r: (r[0], r[1])):
        for case in suite.iter("testcase"):
            times[(case.get("classname", ""), case.get("name", ""))] = float(case.get("time", 0) or 0)
    return times


def durations(ids: list[str], times: dict[tuple[str, str], float]) -> list[float]:
    """Each node id's duration: its own (known_durations), else the median of the known ones (1 s when none is
    known)."""
    found = known_durations(ids, times)
    known = [t for t in found if t is not None]
    median = statistics.median(known) if known else 1.0
    return [median if t is None else t for t in found]


def known_durations(ids: list[str], times: dict[tuple[str, str], float]) -> list[float | None]:
    """Each node id's duration in `times`, matched also where one classname ends the other (node ids relative to
    another root); None where it has none."""
    by_name: dict[str, list[tuple[str, float]]] = {}
    for (classname, name), t in times.items():
        by_name.setdefault(name, []).append((classname, t))
    found: list[float | None] = []
    for node_id in ids:
        classname, name = junit_key(node_id)
        t = times.get((classname, name))
        if t is None:
            t = next((t for c, t in by_name.get(name, ())
                      if c.endswith("." + classname) or classname.endswith("." + c)), None)
        found.append(t)
    return found


def sanitizer_times(jsonl_paths, tool: str | None = None) -> dict[str, float]:
    """Each node id's seconds over its phases in the .jsonl files (of `tool`'s runs only, when given), from the
    run that ended it last. A test never ended in any of them counts the longest it ran before a cut (its `cut`
    records, tools/sanitize_run.py): its phases alone would make the slowest test look free."""
    phases: dict[tuple[str, str], float] = {}  # (node id, file) -> seconds of the phases seen so far
    ended: dict[str, tuple[float, float]] = {}  # node id -> (teardown time, seconds), the latest
    cut: dict[str, float] = {}  # node id -> the longest it ran before a cut
    for path in jsonl_paths:
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if tool is not None and record.get("tool") != tool:
                continue
            node, at = record["nodeid"], float(record.get("at", 0.0))
            if record["when"] == "cut":
                cut[node] = max(cut.get(node, 0.0), float(record["seconds"]))
                continue
            if record["when"] == "start":
                continue
            key = (node, str(path))
            phases[key] = phases.get(key, 0.0) + float(record["seconds"])
            if record["when"] == "teardown":
                seconds = phases.pop(key)
                if at >= ended.get(node, (-1.0, 0.0))[0]:
                    ended[node] = (at, seconds)
    return {**cut, **{node: seconds for node, (_, seconds) in ended.items()}}


def split_case_times(ids: list[str], measured: dict[str, float]) -> dict[str, float]:
    """Times for tests that a parametrization split out of a measured one (`t[a-b]` measured, `t[a-b-c]` and
    `t[a-b-d]` collected): the measured seconds shared equally among its cases; the longest such parent wins. Ids
    are matched as text, so where `t[a]` was measured and `t[a-x]` was not, the cases of `t[a-x]` go to `t[a]`."""
    parents: dict[str, str] = {}
    for node_id in ids:
        if node_id in measured or not node_id.endswith("]") or "[" not in node_id:
            continue
        base, params = node_id[:-1].split("[", 1)
        candidates = [m for m in measured if m.startswith(base + "[") and m not in ids
                      and params.startswith(m[len(base) + 1:-1] + "-")]
        if candidates:
            parents[node_id] = max(candidates, key=len)
    shares: dict[str, int] = {}
    for parent in parents.values():
        shares[parent] = shares.get(parent, 0) + 1
    return {node_id: measured[parent] / shares[parent] for node_id, parent in parents.items()}


def shard_weights(ids: list[str], xml_times: dict[tuple[str, str], float], measured: dict[str, float]) -> list[float]:
    """Sanitizer seconds where measured (or shared out of a measured test that was split, split_case_times), else
    the xml duration scaled by the median slowdown of the tests known both ways (durations() for the rest)."""
    measured = {**measured, **split_case_times(ids, measured)}
    plain = durations(ids, xml_times)
    if not measured:
        return plain
    slowdowns = [measured[i] / p for i, p in zip(ids, known_durations(ids, xml_times))
                 if i in measured and p is not None and p > 0]
    scale = statistics.median(slowdowns) if slowdowns else 1.0
    return [measured[i] if i in measured else p * scale for i, p in zip(ids, plain)]


def split(ids: list[str], weights: list[float], shards: int) -> list[list[str]]:
    """Longest first onto the least loaded shard; each shard then in collection order; no empty shard."""
    loads = [0.0] * max(1, min(shards, len(ids)))
    members: list[list[int]] = [[] for _ in loads]
    for i in sorted(range(len(ids)), key=lambda i: (-weights[i], i)):
        target = min(range(len(loads)), key=lambda s: (loads[s], s))
        loads[target] += weights[i]
        members[target].append(i)
    return [[ids[i] for i in sorted(m)] for m in members if m]


def cmd_split(args: argparse.Namespace) -> int:
    text = Path(args.nodeids).read_text().splitlines() if args.nodeids != "-" else sys.stdin.read().splitlines()
    ids = node_ids(text)
    if not ids:
        print("sanitize_shards: no node ids in the input", file=sys.stderr)
        return 1
    jsonl = [t for t in args.times if t.endswith(".jsonl")]
    cost = shard_weights(ids, junit_times([t for t in args.times if t not in jsonl]),
                         sanitizer_times(jsonl, args.tool))
    seconds = dict(zip(ids, cost))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for index, shard in enumerate(split(ids, cost, args.shards)):
        path = out / f"shard_{index}.txt"
        path.write_text("".join(f"{node_id}\n" for node_id in shard))
        print(path)
        print(f"shard {index}: {len(shard)} tests, {sum(seconds[i] for i in shard):.1f} s by the known times",
              file=sys.stderr)
    return 0


# ---- summary ----------------------------------------------------------------------------------------------------

def times_counts(jsonl_text: str) -> dict[str, int]:
    """pytest's counts from a shard's .jsonl times (tests/gpu/conftest.py), for a shard cut before pytest's final
    line: each test that reached its teardown, failed if its call failed, an error if its setup or teardown did,
    skipped if any phase skipped, else passed."""
    outcomes: dict[str, dict[str, str]] = {}
    for line in jsonl_text.splitlines():
        if line.strip():
            record = json.loads(line)
            if record["when"] in ("setup", "call", "teardown"):
                outcomes.setdefault(record["nodeid"], {})[record["when"]] = record["outcome"]
    counts: dict[str, int] = {}
    for phases in outcomes.values():
        if "teardown" not in phases:
            continue
        what = ("failed" if phases.get("call") == "failed" else
                "errors" if "failed" in (phases.get("setup"), phases["teardown"]) else
                "skipped" if "skipped" in phases.values() else "passed")
        counts[what] = counts.get(what, 0) + 1
    return counts


def process_counts(text: str) -> tuple[int, int, bool]:
    """One compute-sanitizer process's errors and warnings (without its summary: the reports printed before it
    ended), and whether it printed its summary."""
    race = RACECHECK_SUMMARY.findall(text)
    plain = ERROR_SUMMARY.findall(text)
    if race:
        return int(race[-1][0]), int(race[-1][1]), True
    if plain:
        return int(plain[-1]), 0, True
    reports = [line for line in SANITIZER_LINE.findall(text)
               if not line.startswith(NOT_A_REPORT) and not line.endswith("=")]  # nor a pytest separator
    warnings = sum(line.startswith("Warning") for line in reports)
    return len(reports) - warnings, warnings, False


def shard_report(text: str, times_text: str | None = None) -> dict:
    """What one shard's log says: exit status and seconds (None when the line is missing); the sanitizer's errors
    and warnings summed over its processes (tools/sanitize_run.py runs one after each cut test); the processes that
    ended without their summary, not cut either (`unsummarized`: the errors each printed); the tests cut (node id,
    seconds, reason, errors printed before the cut); pytest's counts (where a process ended before its final line,
    those of the shard's .jsonl times when given); and whether nanobind reported native objects alive at the
    interpreter's exit (an engine kept past its test), with the instances it counted."""
    exits = EXIT_LINE.findall(text)
    rc, seconds = (int(exits[-1][0]), int(exits[-1][1])) if exits else (None, None)
    processes = PROCESS_LINE.split(text)[1:] or [text]  # a log of one process (no such line) is one
    errors = warnings = 0
    cuts, finals, unsummarized = [], [], []
    for out in processes:
        e, w, has_summary = process_counts(out)
        errors, warnings = errors + e, warnings + w
        cut = CUT_LINE.findall(out)
        cuts += [(node, int(sec), reason, e) for node, sec, reason in cut]
        if not has_summary and not cut:
            unsummarized.append(e)
        final = [line for line in out.splitlines() if PYTEST_FINAL.search(line) and PYTEST_COUNTS.search(line)]
        finals.append(final[-1] if final else None)
    counts: dict[str, int] = {}
    if None in finals and times_text is not None:
        counts = times_counts(times_text)
    else:
        for final in filter(None, finals):
            for n, what in PYTEST_COUNTS.findall(final):
                what = "errors" if what.startswith("error") else what
                counts[what] = counts.get(what, 0) + int(n)
    leaked = sum(int(n) for n in NANOBIND_LEAKS.findall(text)) if NANOBIND_REPORT in text else None
    return {"rc": rc, "seconds": seconds, "errors": errors, "warnings": warnings, "unsummarized": unsummarized,
            "cuts": cuts, "counts": counts, "leaked": leaked}


def summary_line(tool: str, reports: list[tuple[str, dict]]) -> tuple[str, bool]:
    errors = sum(r["errors"] for _, r in reports)
    warnings = sum(r["warnings"] for _, r in reports)
    counts: dict[str, int] = {}
    for _, r in reports:
        for what, n in r["counts"].items():
            counts[what] = counts.get(what, 0) + n
    problems = []
    for name, r in reports:
        if r["rc"] is None:
            problems.append(f"{name}: no exit line")
        elif r["rc"] == DEADLINE_EXIT:
            problems.append(f"{name}: timed out (exit {r['rc']})")
        elif r["rc"] != 0:
            problems.append(f"{name}: exit {r['rc']}")
        for node, sec, reason, printed in r["cuts"]:
            problems.append(f"{name}: cut {node.split('::', 1)[-1]} after {sec} s ({reason}"
                            + (f"; {printed} errors printed before it)" if printed else ")"))
        if r["unsummarized"]:
            printed = sum(r["unsummarized"])
            problems.append(f"{name}: no sanitizer summary ({printed} errors printed before it ended)"
                            if printed else f"{name}: no sanitizer summary")
        elif r["errors"]:
            problems.append(f"{name}: {r['errors']} errors")
        if r["leaked"] is not None:
            problems.append(f"{name}: native objects alive at exit (nanobind: {r['leaked']} instances)")
    slowest = max((r["seconds"] or 0 for _, r in reports), default=0)
    tests = ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "failed", "skipped"))
    extra = "".join(f", {n} {k}" for k, n in counts.items() if k not in ("passed", "failed", "skipped"))
    line = (f"{tool}: {errors} errors" + (f", {warnings} warnings" if tool == "racecheck" else "")
            + f" over {len(reports)} shards (slowest {slowest} s); tests {tests}{extra}")
    failed = bool(problems) or errors > 0 or counts.get("failed", 0) > 0 or counts.get("errors", 0) > 0
    return line + ("; FAILED: " + "; ".join(problems) if problems else ""), failed


def cmd_summary(args: argparse.Namespace) -> int:
    reports = []
    for log in map(Path, args.logs):
        times = log.with_name(log.name.removesuffix(".log") + ".times.jsonl")
        reports.append((log.name, shard_report(log.read_text(errors="replace"),
                                               times.read_text() if times.exists() else None)))
    line, failed = summary_line(args.tool, reports)
    print(line)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("split", help="write balanced shards of node ids")
    p.add_argument("--shards", type=int, required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--times", nargs="*", default=[],
                   help="junit xml files, and .jsonl files of sanitizer runs, with the tests' durations")
    p.add_argument("--nodeids", default="-", help="`pytest --collect-only -q` output (default: stdin)")
    p.add_argument("--tool", default=None, help="use only this sanitizer tool's .jsonl times")
    p.set_defaults(run=cmd_split)
    s = sub.add_parser("summary", help="one line over the shards' logs of one tool")
    s.add_argument("--tool", required=True)
    s.add_argument("logs", nargs="+")
    s.set_defaults(run=cmd_summary)
    args = parser.parse_args(argv)
    if args.command == "split" and args.shards < 1:
        parser.error("--shards must be at least 1")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
