"""One table format for every `shoal bench` suite: shoal's figure beside a baseline measured
in the same run, and the ratio, or a JSON list of the same rows for scripts.
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Row:
    """One measured figure; `baseline` is what the same work costs without shoal."""

    metric: str
    unit: str
    shoal: float
    baseline: float | None
    baseline_name: str
    higher_is_better: bool

    @property
    def ratio(self) -> float | None:
        """How many times better shoal is than the baseline (>1 is better, either direction)."""
        if self.baseline is None or self.baseline == 0 or self.shoal == 0:
            return None
        return self.shoal / self.baseline if self.higher_is_better else self.baseline / self.shoal


def machine() -> str:
    """The machine a figure was measured on, for docs/benchmarks.md."""
    import os

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def _fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def render_table(title: str, rows: list[Row]) -> str:
    header = ("metric", "unit", "shoal", "baseline", "baseline is", "shoal/baseline")
    cells = [header]
    for row in rows:
        ratio = row.ratio
        cells.append(
            (
                row.metric,
                row.unit,
                _fmt(row.shoal),
                _fmt(row.baseline),
                row.baseline_name,
                "-" if ratio is None else f"{ratio:.2f}x",
            )
        )
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    lines = [f"{title}  ({machine()})"]
    for n, line in enumerate(cells):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def render_json(rows: list[Row]) -> str:
    return json.dumps([asdict(row) for row in rows])
