#!/usr/bin/env python3
"""What each kernel family costs a compute-sanitizer tool, found by leaving one out at a time or checking one alone.

    tools/sanitizer_cost.py --tool racecheck --workload decode [--preset tiny] [--families a,b,..|none]
                            [--mode without|only] [--jobs 8] [--limit 300] [--memory-limit-mb MB] --out DIR

Runs one engine workload plainly, then under the tool in variants: every kernel checked (`all`), and per family (the
kernels of one kernels/*.cu; --families picks some, `none` no family variant):
- --mode without: `none` (no kernel checked), then each family left unchecked in turn (`--kernel-name-exclude`);
  what leaving a family out saves is what checking it costs, and a family whose exclusion alone keeps the memory
  down is the one that grows it;
- --mode only: the cluster kernels alone (`only sample_kernel+topk_kernel`), then each other family checked with
  them and nothing else (`--kernel-name`): each family's own cost, apart from the rest. The cluster kernels are
  always checked there because under racecheck a thread-block-cluster kernel left unchecked fails the run (`Internal
  Sanitizer Error: The Sanitizer failed to handle a hardware exception`, seen on the H200); `none` and `without
  sample` / `without topk` end early there.
The variants run in waves of --jobs processes, each wave with an `all` of its own, since processes that share the
GPU and the host slow each other: a variant is compared with its own wave's `all` only. Each reports its workload
seconds (measured in the child), the end of each of its steps (seconds, the child's memory), wall seconds, the most
resident memory its processes held together, its exit and the tool's summary line; one past --limit seconds or
--memory-limit-mb is ended (tools/sanitizer_process.py, its stacks printed into its log first). sanitizer_cost.md
and sanitizer_cost.json in DIR are rewritten after each wave, so a run cut short keeps the waves it finished.

Workloads (the calls of the tests that racecheck could not get through, shortened):
- decode: a 3-stream engine with its drafter, prompts of 5, 14 and 23 tokens, 4 new tokens of AR twice, then of
  DDTree (budget 16) twice, greedy (test_bad_requests.py's good requests, which are 24 tokens, greedy and sampled);
- prefill: a 4-stream engine, prompts of 5, 1, 17 and 70 tokens, 4 new tokens AR greedy twice, then the 70-token
  stream's logits and expert choices recomputed as prefill chunks of 64 rows (test_engine.py's teacher-forced check,
  which decodes 64).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypedDict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sanitizer_process import TOOL_OPTIONS, end_live_sessions, resident_mb, sanitizer_command, supervise  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("decode", "prefill")
NEW_TOKENS = 4
STAGE = re.compile(r"^stage (.+): ([0-9.]+) s, ([0-9]+) MB$", re.M)
SUMMARY = re.compile(r"(ERROR SUMMARY: .*|RACECHECK SUMMARY: .*)")
# `__global__ void [__cluster_dims__(..)] [__launch_bounds__(..)] name(`, attributes in either order
KERNEL = re.compile(r"__global__\s+(?:(?:void|__(?:cluster_dims|launch_bounds)__\([^)]*\))\s+)*(\w+_kernel)\s*\(")


class Variant(TypedDict):
    variant: str
    wave: int
    workload_s: float | None
    wall_s: float
    peak_mb: int
    exit: int
    ended: str | None
    summary: str | None
    stages: list[tuple[str, float, int]]  # (step, seconds from the workload's start, the child's resident MB)


def kernel_families(kernels_dir: Path = ROOT / "kernels") -> dict[str, list[str]]:
    """Each kernels/*.cu (by stem) and the __global__ functions it defines (all named *_kernel)."""
    families = {}
    for path in sorted(kernels_dir.glob("*.cu")):
        names = sorted(set(KERNEL.findall(path.read_text())))
        if names:
            families[path.stem] = names
    return families


def cluster_kernels(kernels_dir: Path = ROOT / "kernels") -> list[str]:
    """The kernels declared with __cluster_dims__ (each launch runs in thread-block clusters)."""
    return sorted({m.group(1) for path in kernels_dir.glob("*.cu") for m in KERNEL.finditer(path.read_text())
                   if "__cluster_dims__" in m.group(0)})


def name_filter(names: list[str]) -> str:
    """A --kernel-name(-exclude) regex for these functions: in a mangled name each is `<length><name>` (no kernel's
    name ends another's), in a demangled one `::<name>` then its template or parameter list; `.*` on both sides,
    whether the tool searches or matches the whole name."""
    return "regex=.*(" + "|".join(f"{len(n)}{n}|::{n}[<(]" for n in names) + ").*"


def waves(families: dict[str, list[str]], jobs: int, mode: str = "without",
          always: Sequence[str] = ()) -> list[list[tuple[str, list[str]]]]:
    """The variants in waves of at most `jobs` (2 or more), each led by an `all`.
    mode `without`: `none` (in the first wave), then each family left unchecked in turn;
    mode `only`: `only always` (the kernels `always` names: racecheck fails when a cluster kernel goes unchecked),
    then each other family checked with them, all else unchecked."""
    if mode == "without":
        singles = [("none", ["--kernel-name", "kns=no_kernel_has_this_name"])]
        singles += [(f"without {stem}", ["--kernel-name-exclude", name_filter(names)])
                    for stem, names in families.items()]
    else:
        baseline = name_filter(list(always)) if always else "kns=no_kernel_has_this_name"
        singles = [(f"only {'+'.join(always) or 'none'}", ["--kernel-name", baseline])]
        singles += [(f"only {stem}", ["--kernel-name", name_filter([*names, *always])])
                    for stem, names in families.items() if not set(names) <= set(always)]
    per_wave = jobs - 1
    return [[("all", []), *singles[i:i + per_wave]] for i in range(0, len(singles), per_wave)]


# ---- the workload, run in the child process -----------------------------------------------------------------------

def run_workload(workload: str, model_dir: Path, drafter_dir: Path) -> float:
    """Runs the workload, printing a `stage` line as each step ends (a variant ended at its limit shows how far it
    got and what each step cost), and returns its seconds. Each call runs twice: the first pays what happens once
    (graph capture, the tool's patching of each kernel at its first launch), the second only the calls' own work."""
    import numpy as np

    import ddtree

    t0 = time.perf_counter()

    def stage(name: str) -> None:
        # the child's own memory (the sanitizer's front end is another process)
        print(f"stage {name}: {time.perf_counter() - t0:.1f} s, {resident_mb([os.getpid()])} MB", flush=True)

    if workload == "decode":
        engine = ddtree.Engine(model_dir, drafter_dir, streams=3, max_context=96, budget=16)
        stage("create")
        prompts = [np.arange(5 + 9 * i).tolist() for i in range(3)]
        for method in ("ar", "ddtree"):
            for call in (1, 2):
                engine.generate(prompts, NEW_TOKENS, method=method, stop_token_ids=())
                stage(f"{method} {call}")
    else:
        engine = ddtree.Engine(model_dir, streams=4, max_context=160)
        stage("create")
        rng = np.random.default_rng(1)
        prompts = [rng.integers(0, engine.config.vocab_size, n).tolist() for n in (5, 1, 17, 70)]
        for call in (1, 2):
            [*_, last] = engine.generate(prompts, NEW_TOKENS, stop_token_ids=())
            stage(f"generate {call}")
        seq = (prompts[-1] + list(last.tokens))[:-1]
        for begin in range(0, len(seq), 64):
            ids = seq[begin:begin + 64]
            engine.native.forward_logits(ids, [3] * len(ids), list(range(begin, begin + len(ids))), with_routing=True)
            stage(f"forward_logits {begin}")
    return time.perf_counter() - t0


# ---- the variants, run from the parent ----------------------------------------------------------------------------

def run_variant(name: str, wave: int, command: list[str], log: Path, limit: float, memory_limit_mb: int) -> Variant:
    t0 = time.time()

    def reason_to_end(used_mb: int) -> str | None:
        if time.time() - t0 > limit:
            return f"limit {limit:.0f} s"
        return f"memory {used_mb} MB" if 0 < memory_limit_mb < used_mb else None

    with log.open("w") as out:
        rc, reason, peak = supervise(command, out, reason_to_end)
    text = log.read_text(errors="replace")
    summary = SUMMARY.findall(text)
    seconds = re.findall(r"workload seconds: ([0-9.]+)", text)
    return {"variant": name, "wave": wave, "workload_s": float(seconds[-1]) if seconds else None,
            "wall_s": round(time.time() - t0, 1), "peak_mb": peak, "exit": rc, "ended": reason,
            "summary": summary[-1] if summary else None,
            "stages": [(step, float(at), int(mb)) for step, at, mb in STAGE.findall(text)]}


def saves(row: Variant, rows: list[Variant]) -> float | None:
    """The seconds leaving the variant's kernels unchecked saved against its wave's `all`."""
    base = next((r["workload_s"] for r in rows if r["variant"] == "all" and r["wave"] == row["wave"]), None)
    return None if base is None or row["workload_s"] is None else base - row["workload_s"]


def report(tool: str, workload: str, preset: str, plain_s: float, rows: list[Variant]) -> str:
    lines = [f"# {tool} cost by kernel family: workload `{workload}` on `{preset}`", "",
             f"Plain (no sanitizer): {plain_s:.1f} s. `workload s`: the workload's own seconds (engine creation and "
             "calls), measured in the child; `saves s`: its wave's `all` minus it (in `only` variants: what leaving "
             "every other kernel unchecked saves).", "",
             "| variant | wave | workload s | saves s | wall s | peak host MB | exit | ended | summary "
             "| steps ended (s, child MB) |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    leaders = [r for r in rows if r["variant"] in ("all", "none")]
    others = sorted((r for r in rows if r["variant"] not in ("all", "none")), key=lambda r: -(saves(r, rows) or 0.0))
    for r in leaders + others:
        workload_s = "-" if r["workload_s"] is None else f"{r['workload_s']:.1f}"
        saved = saves(r, rows) if r["variant"] != "all" else None
        lines.append(f"| {r['variant']} | {r['wave']} | {workload_s} | {'' if saved is None else f'{saved:.1f}'} | "
                     f"{r['wall_s']:.0f} | {r['peak_mb']} | {r['exit']} | {r['ended'] or ''} | {r['summary'] or ''} | "
                     f"{', '.join(f'{n} {at:.0f} ({mb})' for n, at, mb in r['stages'])} |")
    return "\n".join(lines) + "\n"


def make_models(out: Path, preset: str) -> tuple[Path, Path]:
    from ddtree.drafter import make_drafter
    from ddtree.presets import make_model

    model_dir, drafter_dir = out / "models" / preset, out / "models" / f"{preset}-drafter"
    config = make_model(preset, model_dir, seed=0)
    make_drafter(config, drafter_dir, seed=3, preset=preset)
    return model_dir, drafter_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tool", choices=sorted(TOOL_OPTIONS), default="racecheck")
    parser.add_argument("--workload", choices=WORKLOADS, required=True)
    parser.add_argument("--preset", default="tiny", help="the random target (and drafter) preset")
    parser.add_argument("--families", default="",
                        help="comma-separated kernels/*.cu stems (default: every one; `none`: no family variant)")
    parser.add_argument("--mode", choices=("without", "only"), default="without",
                        help="leave each family unchecked in turn, or check only it (and the cluster kernels)")
    parser.add_argument("--jobs", type=int, default=8, help="processes a wave runs at once, its `all` among them")
    parser.add_argument("--limit", type=float, default=300.0, help="seconds a variant may run")
    parser.add_argument("--memory-limit-mb", type=int, default=0, help="resident memory a variant may hold (0: none)")
    parser.add_argument("--out", type=Path, help="where the report and the variants' logs go")
    parser.add_argument("--run", action="store_true", help="(child) run the workload once and print its seconds")
    parser.add_argument("--model-dir", type=Path, help="(child) the target")
    parser.add_argument("--drafter-dir", type=Path, help="(child) the drafter")
    args = parser.parse_args(argv)
    if args.run:
        if args.model_dir is None or args.drafter_dir is None:
            parser.error("--run needs --model-dir and --drafter-dir")
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # where a variant was when its limit ended it
        print(f"workload seconds: {run_workload(args.workload, args.model_dir, args.drafter_dir):.3f}", flush=True)
        return 0
    if args.out is None:
        parser.error("--out is required")
    if args.jobs < 2 or args.limit <= 0 or args.memory_limit_mb < 0:
        parser.error("--jobs must be at least 2, --limit positive, --memory-limit-mb not negative")
    families = kernel_families()
    if args.families == "none":
        families = {}
    elif args.families:
        chosen = args.families.split(",")
        unknown = sorted(set(chosen) - set(families))
        if unknown:
            parser.error(f"--families: no kernels/{unknown[0]}.cu with kernels; families: {', '.join(families)}")
        families = {stem: families[stem] for stem in chosen}
    signal.signal(signal.SIGTERM, end_live_sessions)  # timeout(1)'s: the variants' sessions end with this script
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir, drafter_dir = make_models(args.out, args.preset)
    child = [sys.executable, str(Path(__file__).resolve()), "--run", "--workload", args.workload,
             "--model-dir", str(model_dir), "--drafter-dir", str(drafter_dir)]
    plain = run_variant("plain", 0, child, args.out / "plain.log", args.limit, 0)
    if plain["exit"] != 0 or plain["workload_s"] is None:
        print(f"the workload failed without a sanitizer; see {args.out / 'plain.log'}", file=sys.stderr)
        return 1
    rows: list[Variant] = []
    for index, wave in enumerate(waves(families, args.jobs, args.mode, cluster_kernels()), start=1):
        with ThreadPoolExecutor(len(wave)) as pool:
            rows += pool.map(lambda v: run_variant(
                v[0], index, sanitizer_command(args.tool, v[1]) + child,
                args.out / f"{args.tool}_{index}_{v[0].replace(' ', '_')}.log", args.limit, args.memory_limit_mb),
                wave)
        text = report(args.tool, args.workload, args.preset, plain["workload_s"], rows)
        (args.out / "sanitizer_cost.md").write_text(text)
        (args.out / "sanitizer_cost.json").write_text(json.dumps(
            {"tool": args.tool, "workload": args.workload, "preset": args.preset, "plain_s": plain["workload_s"],
             "variants": rows}, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
