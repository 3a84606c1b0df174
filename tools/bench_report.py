"""What the benchmark reports share: the JSON beside the Markdown, the Markdown's header (device and the copy
bandwidth every floor is measured against), and matplotlib for the plots when it is installed."""

from __future__ import annotations

import json
from pathlib import Path

from ddtree.bench.report import pyplot  # noqa: F401  (the benchmarks' plots, and bench's, use one)


def start_report(out: Path, stem: str, title: str, report: dict) -> list[str]:
    """Writes `report` to out/stem.json and returns the Markdown's first lines: `title` with the report's model,
    its device and its copy bandwidth."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    return [f"# {title} ({report['model']})", "", f"Device: {report['device']}  ",
            f"Copy bandwidth (measured in this run): {report['copy_bandwidth_gbs']:.0f} GB/s", ""]
