#!/usr/bin/env python3
"""What each kernel family costs a compute-sanitizer tool, found by leaving one out at a time.

    tools/sanitizer_cost.py --tool racecheck --workload decode [--preset tiny] [--jobs 8] [--limit 300]
                            [--memory-limit-mb MB] --out DIR

Runs one engine workload plainly, then under the tool in several variants, --jobs processes at a time: every kernel
checked (`all`), none (`none`), and once per family (the kernels of one kernels/*.cu) left unchecked
(`--kernel-name-exclude`). Each variant reports its wall seconds, the most resident memory its processes held
together, its exit and the tool's summary line; a variant past --limit seconds or --memory-limit-mb is ended (the
memory guard of tools/sanitize_run.py). What leaving a family out saves is what checking it costs, and a family
whose exclusion alone keeps the memory down is the one that grows it. Variants share the GPU and the host, so the
seconds are compared within one run only. Writes sanitizer_cost.md and sanitizer_cost.json to DIR.

Workloads (the calls of the tests that racecheck could not get through, shortened):
- decode: a 3-stream engine with its drafter, prompts of 5, 14 and 23 tokens, 4 new tokens of AR, then of DDTree
  (budget 16), greedy (test_bad_requests.py's good requests, which are 24 tokens, greedy and sampled);
- prefill: a 4-stream engine, prompts of 5, 1, 17 and 70 tokens, 4 new tokens AR greedy, then the 70-token stream's
  logits and expert choices recomputed as prefill chunks of 64 rows (test_engine.py's teacher-forced check, which
  decodes 64).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sanitize_run import end_session, resident_mb, sanitizer_command, session_pids  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("decode", "prefill")
NEW_TOKENS = 4
SUMMARY = re.compile(r"(ERROR SUMMARY: .*|RACECHECK SUMMARY: .*)")
# `__global__ void [__cluster_dims__(..)] [__launch_bounds__(..)] name(`, attributes in either order
KERNEL = re.compile(r"__global__\s+(?:(?:void|__(?:cluster_dims|launch_bounds)__\([^)]*\))\s+)*(\w+_kernel)\s*\(")


def kernel_families(kernels_dir: Path = ROOT / "kernels") -> dict[str, list[str]]:
    """Each kernels/*.cu (by stem) and the __global__ functions it defines (all named *_kernel)."""
    families = {}
    for path in sorted(kernels_dir.glob("*.cu")):
        names = sorted(set(KERNEL.findall(path.read_text())))
        if names:
            families[path.stem] = names
    return families


def exclude_filter(names: list[str]) -> str:
    """A --kernel-name(-exclude) regex matching these functions in mangled names, where each name is `<length><name>`
    (no kernel's name ends another's)."""
    return "regex=" + "|".join(f"{len(n)}{n}" for n in names)


def variants(families: dict[str, list[str]]) -> list[tuple[str, list[str]]]:
    out = [("all", []), ("none", ["--kernel-name", "kns=no_kernel_has_this_name"])]
    out += [(f"without {stem}", ["--kernel-name-exclude", exclude_filter(names)]) for stem, names in families.items()]
    return out


# ---- the workload, run in the child process -----------------------------------------------------------------------

def run_workload(workload: str, model_dir: Path, drafter_dir: Path) -> float:
    import numpy as np

    import ddtree

    t0 = time.perf_counter()
    if workload == "decode":
        engine = ddtree.Engine(model_dir, drafter_dir, streams=3, max_context=96, budget=16)
        prompts = [np.arange(5 + 9 * i).tolist() for i in range(3)]
        for method in ("ar", "ddtree"):
            engine.generate(prompts, NEW_TOKENS, method=method, stop_token_ids=())
    else:
        engine = ddtree.Engine(model_dir, streams=4, max_context=160)
        rng = np.random.default_rng(1)
        prompts = [rng.integers(0, engine.config.vocab_size, n).tolist() for n in (5, 1, 17, 70)]
        [*_, last] = engine.generate(prompts, NEW_TOKENS, stop_token_ids=())
        seq = (prompts[-1] + list(last.tokens))[:-1]
        for begin in range(0, len(seq), 64):
            ids = seq[begin:begin + 64]
            engine.native.forward_logits(ids, [3] * len(ids), list(range(begin, begin + len(ids))), with_routing=True)
    return time.perf_counter() - t0


# ---- the variants, run from the parent ----------------------------------------------------------------------------

def run_variant(name: str, command: list[str], log: Path, limit: float, memory_limit_mb: int) -> dict:
    t0 = time.time()
    peak, reason = 0, None
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None:
            time.sleep(1.0)
            used = resident_mb(session_pids(proc.pid))
            peak = max(peak, used)
            if time.time() - t0 > limit:
                reason = f"limit {limit:.0f} s"
            elif memory_limit_mb and used > memory_limit_mb:
                reason = f"memory {used} MB"
            if reason is not None and proc.poll() is None:
                end_session(proc)
                break
    text = log.read_text(errors="replace")
    summary = SUMMARY.findall(text)
    seconds = re.findall(r"workload seconds: ([0-9.]+)", text)
    return {"variant": name, "wall_s": round(time.time() - t0, 1),
            "workload_s": float(seconds[-1]) if seconds else None, "peak_mb": peak, "exit": proc.returncode,
            "ended": reason, "summary": summary[-1] if summary else None}


def report(tool: str, workload: str, preset: str, plain_s: float, rows: list[dict]) -> str:
    by_name = {r["variant"]: r for r in rows}
    everything = by_name["all"]["workload_s"]
    lines = [f"# {tool} cost by kernel family: workload `{workload}` on `{preset}`", "",
             f"Plain (no sanitizer): {plain_s:.1f} s. Seconds are the workload's own (engine creation and calls), "
             "measured in the child; `saves` is `all` minus the variant.", "",
             "| variant | workload s | saves s | wall s | peak host MB | exit | ended | summary |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    def saves(r: dict) -> float | None:
        return None if everything is None or r["workload_s"] is None else everything - r["workload_s"]
    ordered = [by_name["all"], by_name["none"]] + sorted(
        (r for r in rows if r["variant"] not in ("all", "none")), key=lambda r: -(saves(r) or 0.0))
    for r in ordered:
        workload_s = "-" if r["workload_s"] is None else f"{r['workload_s']:.1f}"
        saved = "" if r["variant"] in ("all", "none") or saves(r) is None else f"{saves(r):.1f}"
        lines.append(f"| {r['variant']} | {workload_s} | {saved} | {r['wall_s']:.0f} | {r['peak_mb']} | {r['exit']} | "
                     f"{r['ended'] or ''} | {r['summary'] or ''} |")
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
    parser.add_argument("--tool", choices=("memcheck", "racecheck", "initcheck", "synccheck"), default="racecheck")
    parser.add_argument("--workload", choices=WORKLOADS, required=True)
    parser.add_argument("--preset", default="tiny", help="the random target (and drafter) preset")
    parser.add_argument("--jobs", type=int, default=8, help="variants run at once")
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
    if args.jobs < 1 or args.limit <= 0 or args.memory_limit_mb < 0:
        parser.error("--jobs and --limit must be positive, --memory-limit-mb not negative")
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir, drafter_dir = make_models(args.out, args.preset)
    child = [sys.executable, str(Path(__file__).resolve()), "--run", "--workload", args.workload,
             "--model-dir", str(model_dir), "--drafter-dir", str(drafter_dir)]
    plain = run_variant("plain", child, args.out / "plain.log", args.limit, 0)
    if plain["exit"] != 0 or plain["workload_s"] is None:
        print(f"the workload failed without a sanitizer; see {args.out / 'plain.log'}", file=sys.stderr)
        return 1
    jobs = variants(kernel_families())
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda v: run_variant(
            v[0], sanitizer_command(args.tool, v[1]) + child,
            args.out / f"{args.tool}_{v[0].replace(' ', '_')}.log", args.limit, args.memory_limit_mb), jobs))
    text = report(args.tool, args.workload, args.preset, plain["workload_s"], rows)
    (args.out / "sanitizer_cost.md").write_text(text)
    (args.out / "sanitizer_cost.json").write_text(json.dumps(
        {"tool": args.tool, "workload": args.workload, "preset": args.preset, "plain_s": plain["workload_s"],
         "variants": rows}, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
