"""What `ddtree-run bench` shows while it runs: a rich table that grows a row per measured configuration (redrawn
in place on a terminal; printed once, whole, into a pipe)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.live import Live
from rich.table import Table

from ddtree.bench.sweep import BenchRequest, BenchRow

COLUMNS = ("context", "streams", "method", "budget", "oracle accept", "accept", "tok/s", "ms/round", "host us",
           "speedup", "exact")


def cells(row: BenchRow) -> list[str]:
    ddtree = row.method == "ddtree"
    return [str(row.context), str(row.streams), row.method, str(row.budget) if ddtree else "-",
            f"{row.target_accept:g}" if row.target_accept is not None else "-",
            f"{row.mean_accept:.2f}" if ddtree else "-", f"{row.tokens_per_s:.0f}", f"{row.round_ms:.3f}",
            f"{row.host_us_per_round:.1f}" if ddtree else "-", f"{row.speedup:.2f}" if ddtree else "-",
            ("yes" if row.exact else "NO") if ddtree else "-"]


def new_table(title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for name in COLUMNS:
        table.add_column(name, justify="left" if name == "method" else "right")
    return table


@contextmanager
def live_rows(console: Console, title: str, req: BenchRequest, quiet: bool) -> Iterator[Callable[[BenchRow], None]]:
    """A callback that adds one row to the live table (nothing shown when `quiet`)."""
    if quiet:
        yield lambda row: None
        return
    table = new_table(title)
    width = console.width
    if not console.is_terminal:  # a pipe has no width: the table's natural one, not a default 80 columns
        console.width = max(width, 160)
    caption = f"{{}} of {req.points} configurations measured"
    table.caption = caption.format(0)
    try:
        with Live(table, console=console, refresh_per_second=4, auto_refresh=console.is_terminal) as live:
            def add(row: BenchRow) -> None:
                table.add_row(*cells(row))
                table.caption = caption.format(table.row_count)
                live.refresh()

            yield add
        if not console.is_terminal:
            console.line()  # the table's last render, to a pipe, ends without one
    finally:
        console.width = width
