"""What `ddtree-run profile` shows: the captured graphs with their device time per replay, the generation that
captured them, and the eager rounds' split by stage; or one JSON document."""

from __future__ import annotations

import json
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from ddtree.bench.profile import ProfileRequest, ProfileResult


def show_profile(header: str, req: ProfileRequest, result: ProfileResult, console: Console, as_json: bool) -> None:
    if as_json:
        console.out(json.dumps({"header": header, "streams": req.streams, "context": req.context,
                                "new_tokens": req.new_tokens, "single": req.single,
                                "graphs": [asdict(g) for g in result.graphs],
                                "generate": [asdict(g) for g in result.generate],
                                "stage_ms_per_round": result.stage_ms, "stage_rounds": result.stage_rounds},
                               indent=2), highlight=False)
        return
    if req.single:
        g = result.graphs[0]
        console.out(f"{header}\nreplayed {g.name!r} ({g.nodes} nodes) once, no warm-up: {g.ms:.3f} ms (device)",
                    highlight=False)
        return
    width = console.width
    if not console.is_terminal:  # a pipe has no width: the tables' natural one
        console.width = max(width, 160)
    try:
        table = Table(title=header, title_justify="left")
        for name in ("graph", "nodes", "replays", "ms per replay"):
            table.add_column(name, justify="left" if name == "graph" else "right")
        for g in result.graphs:
            table.add_row(g.name, str(g.nodes), str(g.replays), f"{g.ms:.3f}")
        console.print(table)
        console.print("ms per replay: the median of the replays' device times (CUDA events), each from the same "
                      "state, after a warm-up replay.", highlight=False)
        for g in result.generate:
            unit = "step" if g.method == "ar" else "round"
            accept = f", mean acceptance {g.mean_accept:.2f}" if g.method == "ddtree" else ""
            console.print(f"generate ({g.method}): {g.ms_per_round:.3f} ms per {unit} over {g.rounds} {unit}s"
                          f"{accept}", highlight=False)
        if result.stage_ms:
            stages = Table(title=f"DDTree stages, eager rounds (one launch at a time), mean of {result.stage_rounds} "
                                 "rounds", title_justify="left")
            for name in ("stage", "ms per round", "share"):
                stages.add_column(name, justify="left" if name == "stage" else "right")
            total = sum(result.stage_ms.values())
            for name, ms in result.stage_ms.items():
                stages.add_row(name, f"{ms:.3f}", f"{ms / total:.1%}" if total else "-")
            stages.add_row("sum", f"{total:.3f}", "100.0%", style="bold")
            console.print(stages)
    finally:
        console.width = width
