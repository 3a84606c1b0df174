"""The files `ddtree-run bench --out DIR` writes at the end: bench.json (every row and how it was run), bench.md (the
same table) and bench.png (tokens/s by budget, one panel per context and acceptance profile), where matplotlib is
installed (the `bench` extra)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from ddtree.bench.sweep import BenchRequest, BenchRow
from ddtree.bench.view import COLUMNS, cells
from ddtree.request import AUTO


def pyplot() -> ModuleType | None:
    """matplotlib.pyplot drawing to files, or None where matplotlib is not installed (the plot is then skipped)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_report(out: Path, meta: dict[str, object], req: BenchRequest, rows: Sequence[BenchRow]) -> list[Path]:
    """Writes the report files into `out` (made if missing); the paths written. `meta`: model, device and the
    like, first in the JSON and the Markdown's header."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "bench.json", out / "bench.md"]
    document = {**meta, "new_tokens": req.new_tokens, "streams": list(req.streams), "budgets": list(req.budgets),
                "contexts": list(req.contexts), "oracle_accepts": list(req.accepts),
                "rows": [r.as_dict() for r in rows]}
    written[0].write_text(json.dumps(document, indent=2) + "\n")
    lines = [f"# ddtree-run bench: {meta['model']}", "", f"Device: {meta['device']}  ",
             f"Greedy, {req.new_tokens} new tokens per stream, no stop tokens. tok/s: all streams' tokens after the "
             "prefill's over the decode phase's device time; ms/round: that time over the longest stream's rounds "
             "(AR: steps); speedup: over AR at the same context and streams; exact: DDTree's tokens equal AR's.",
             "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    written[1].write_text("\n".join(lines) + "\n")
    if _plot(out / "bench.png", meta, req, rows):
        written.append(out / "bench.png")
    return written


def _plot(path: Path, meta: dict[str, object], req: BenchRequest, rows: Sequence[BenchRow]) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    profiles = req.accepts or (None,)
    fig, axes = plt.subplots(len(profiles), len(req.contexts), squeeze=False,
                             figsize=(4.5 * len(req.contexts), 3.6 * len(profiles)))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, target in enumerate(profiles):
        for j, context in enumerate(req.contexts):
            ax = axes[i][j]
            for k, streams in enumerate(req.streams):
                color = colors[k % len(colors)]
                pts = [r for r in rows if r.context == context and r.streams == streams and r.method == "ddtree"
                       and r.target_accept == target]
                auto = [r for r in pts if r.budget == AUTO]
                pts = [r for r in pts if r.budget != AUTO]
                for r in auto:
                    ax.axhline(r.tokens_per_s, color=color, linestyle=":", linewidth=1.5)
                ax.plot([r.budget for r in pts], [r.tokens_per_s for r in pts], "o-", color=color,
                        label=f"DDTree, {streams} stream{'s' if streams > 1 else ''}")
                ar = [r for r in rows if r.context == context and r.streams == streams and r.method == "ar"]
                if ar:
                    ax.axhline(ar[0].tokens_per_s, color=color, linestyle="--", linewidth=1)
            ax.set_xscale("log", base=2)
            fixed = [b for b in req.budgets if b != AUTO]
            ax.set_xticks(fixed, [str(b) for b in fixed])
            ax.minorticks_off()
            ax.set_xlabel("budget (nodes per round)")
            ax.set_title(f"context {context}" + ("" if target is None else f", oracle accept {target:g}"),
                         fontsize=10)
            if j == 0:
                ax.set_ylabel("tokens/s (all streams)")
    axes[0][0].legend(fontsize=7, title="dashed: AR" + (", dotted: auto budget" if AUTO in req.budgets else ""),
                      title_fontsize=7)
    fig.suptitle(f"{meta['model']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
