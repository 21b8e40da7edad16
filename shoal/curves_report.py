"""The evaluation report's "Learning curves" section, drawn from a run's curves.csv: return,
losses, throughput and policy lag over env steps and wall time, as inline SVG.

Apart from shoal/learning_curves.py (which writes and reads the file) because this is
presentation: which columns become which chart, with what axes and units. A file that is
missing gives no section; one that cannot be read gives a section saying why, never a
broken report.
"""

from __future__ import annotations

import html
from pathlib import Path

from shoal.envs import report_html
from shoal.learning_curves import CURVES_FILE, TENSORBOARD_DIR, Curves, CurvesError, read_curves

MAX_POINTS = 1000
"""Points per drawn line: enough for the eye at 480 px; the CSV keeps every row."""

# (column on x, column on y, title, x label, y label)
CHARTS = (
    ("env_steps", "return", "Return", "env steps", "mean episode return (recent window)"),
    ("time_s", "return", "Return over time", "wall time (s)", "mean episode return"),
    ("env_steps", "policy_loss", "Policy loss", "env steps", "PPO policy loss"),
    ("env_steps", "value_loss", "Value loss", "env steps", "value loss (squared error)"),
    ("env_steps", "entropy", "Policy entropy", "env steps", "entropy (nats)"),
    ("time_s", "sps", "Throughput", "wall time (s)", "env steps per second"),
    ("time_s", "policy_lag", "Policy lag", "wall time (s)", "policy lag (versions)"),
    ("time_s", "env_steps", "Env steps", "wall time (s)", "env steps"),
)


def curves_section(run_dir: Path) -> tuple[str, str] | None:
    """("Learning curves", its HTML) for the run in `run_dir`; None when it has no curves."""
    path = run_dir / CURVES_FILE
    if not path.exists():
        return None
    try:
        curves = read_curves(path)
    except (OSError, CurvesError) as exc:
        why = html.escape(str(exc))
        return "Learning curves", _note(f"The learning curves could not be read: {why}")
    return "Learning curves", render(curves, run_dir)


def render(curves: Curves, run_dir: Path) -> str:
    """The charts of every column that has values, and a line on where the data came from."""
    charts = []
    for x, y, title, x_label, y_label in CHARTS:
        lines = [_thin(line) for line in curves.series(x, y)]
        if lines:
            charts.append(report_html.series_svg(lines, title, x_label, y_label))
    runs = len({row["run"] for row in curves.rows})
    source = (
        f"{len(curves.rows)} rows of {CURVES_FILE} ({runs} run{'s' if runs != 1 else ''} in "
        f"this directory); the same scalars are TensorBoard event files: "
        f"<code>tensorboard --logdir {html.escape(str(run_dir / TENSORBOARD_DIR))}</code>."
    )
    if curves.skipped:
        source += f" {curves.skipped} unreadable lines were skipped."
    if curves.truncated:
        source += " The file is large: only its newest rows are drawn."
    if not charts:
        return _note(f"No curve has a value yet. {source}")
    return f'<div class="plots">{"".join(charts)}</div>{_note(source)}'


def _thin(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """At most MAX_POINTS of `points`, evenly spaced, the last always kept."""
    if len(points) <= MAX_POINTS:
        return points
    stride = -(-len(points) // MAX_POINTS)
    return points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])


def _note(text: str) -> str:
    return f'<p class="note">{text}</p>'
