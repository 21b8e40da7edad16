"""A run's learning curves: one row each time the ranks report something new, written as
`curves.csv` (for people, spreadsheets and the HTML report) and as TensorBoard event files
under `tensorboard/` (for `tensorboard --logdir`), both in the run directory.

`ClusterRun` records from its poll loop; the report reads the CSV back with `read_curves`,
which treats the file as hostile (it sits in a directory anyone with the run's files can
edit): a bounded read, a header that must be ours, and rows that do not parse skipped and
counted. A run that reuses its directory (a resume) appends under the next `run` number with
its clock continuing from the last row, so one file holds the whole history.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.errors import ShoalError

if TYPE_CHECKING:
    from shoal.run_status import RunStatus

log = logging.getLogger("shoal.curves")

CURVES_FILE = "curves.csv"
TENSORBOARD_DIR = "tensorboard"
METRICS = ("policy_loss", "value_loss", "entropy", "approx_kl", "explained_variance")
"""The PPO update's statistics kept per row (rank 0's, from its status record)."""
COLUMNS = ("run", "time_s", "env_steps", "version", "return", "sps", "policy_lag", *METRICS)
HEADER = ",".join(COLUMNS)
MAX_CURVES_BYTES = 8 << 20
"""A run records a row every few seconds (~100 bytes): days of training fit. From a larger
file only the newest MAX_CURVES_BYTES are read."""
MAX_LINE_BYTES = 4096


class CurvesError(ShoalError):
    """curves.csv is not a learning-curves file this version of shoal wrote."""


@dataclass(frozen=True)
class Curves:
    """The rows of curves.csv as columns (None where a row had no value), and how many lines
    were skipped as unreadable."""

    rows: list[dict[str, float | None]] = field(default_factory=list)
    skipped: int = 0
    truncated: bool = False
    """Only the newest MAX_CURVES_BYTES of a larger file were read."""

    def series(self, x: str, y: str) -> list[list[tuple[float, float]]]:
        """(x, y) points of column `y` against column `x`, one list per run (so a resumed
        run's line starts afresh), leaving out rows without either value."""
        runs: dict[float, list[tuple[float, float]]] = {}
        for row in self.rows:
            xv, yv, run = row.get(x), row.get(y), row.get("run")
            if xv is not None and yv is not None and run is not None:
                runs.setdefault(run, []).append((xv, yv))
        return [points for _, points in sorted(runs.items()) if points]


def read_curves(path: Path) -> Curves:
    """The rows of `path` (curves.csv). OSError when it cannot be read; CurvesError when its
    header is not COLUMNS. Lines that are too long, have the wrong number of cells or a cell
    that is not a finite number (or empty) are skipped and counted."""
    with path.open("rb") as handle:
        size = handle.seek(0, 2)
        truncated = size > MAX_CURVES_BYTES
        handle.seek(max(0, size - MAX_CURVES_BYTES))
        data = handle.read(MAX_CURVES_BYTES)
    with path.open("rb") as handle:
        first = handle.readline(MAX_LINE_BYTES + 1)
    header = first.decode("utf-8", errors="replace").strip()
    if header != HEADER:
        raise CurvesError(
            f"{path} does not start with the header {HEADER!r}; it is not a shoal "
            "learning-curves file (move it away and the next run writes a new one)"
        )
    lines = data.split(b"\n")
    lines = lines[1:] if truncated else lines  # the first may be cut in the middle
    rows, skipped = [], 0
    for line in lines:
        text = line.decode("utf-8", errors="replace").strip()
        if not text or text == HEADER:
            continue
        row = _parse_row(text) if len(line) <= MAX_LINE_BYTES else None
        if row is None:
            skipped += 1
        else:
            rows.append(row)
    return Curves(rows, skipped, truncated)


def _parse_row(text: str) -> dict[str, float | None] | None:
    cells = text.split(",")
    if len(cells) != len(COLUMNS):
        return None
    row: dict[str, float | None] = {}
    for name, cell in zip(COLUMNS, cells, strict=True):
        if not cell:
            row[name] = None
            continue
        try:
            value = float(cell)
        except ValueError:
            return None
        if not math.isfinite(value):
            return None
        row[name] = value
    return row if row["run"] is not None and row["time_s"] is not None else None


def _cell(value: float | None) -> str:
    """Counts as integers (exact at any size), measurements to 8 significant digits."""
    if isinstance(value, int):
        return str(value)
    return "" if value is None or not math.isfinite(value) else f"{value:.8g}"


class LearningCurves:
    """Writes the curves of the run in `run_dir`; `record` from the run's poll loop (one
    thread), `close` once at the end. Nothing is created before the first row."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / CURVES_FILE
        self.tensorboard = run_dir / TENSORBOARD_DIR
        self.run, self.clock_offset = self._continue_from()
        self._last: tuple[int, int] | None = None
        self._writer: Any = None

    def _continue_from(self) -> tuple[int, float]:
        """(this run's number, seconds to add to its clock): after the last row of an earlier
        run in the same directory. A file that is not ours is moved aside, not appended to."""
        try:
            rows = read_curves(self.path).rows
        except FileNotFoundError:
            return 1, 0.0
        except (OSError, CurvesError) as exc:
            aside = self.path.with_name(CURVES_FILE + ".unreadable")
            log.warning("%s; moving it to %s and starting a new one", exc, aside)
            with contextlib.suppress(OSError):
                self.path.replace(aside)
            return 1, 0.0
        if not rows:
            return 1, 0.0
        last = rows[-1]
        return int(last["run"] or 0) + 1, float(last["time_s"] or 0.0)

    def record(self, elapsed_s: float, status: RunStatus) -> bool:
        """Append a row (and TensorBoard scalars at step = env steps) when the env steps or
        the policy version moved since the last one; True when it did. A write that fails (a
        full disk) is logged and skipped: curves never end a run. On a nearly full disk nothing
        is tried: TensorBoard's writer thread would print its failure on the terminal, through
        the run's one-line ending (the run's own checks report the full disk)."""
        from shoal.learner.diskfull import has_no_room

        steps, version = status.env_steps(), status.version()
        if (steps, version) == self._last or (steps == 0 and version == 0):
            return False
        self._last = (steps, version)
        if has_no_room(self.path.parent):
            log.info("learning curves skipped: the disk holding %s is full", self.path.parent)
            return False
        values = self._values(status)
        time_s = round(self.clock_offset + elapsed_s, 3)
        cells = (self.run, time_s, steps, version, *values.values())
        try:
            self._append(",".join(_cell(v) for v in cells))
            self._scalars(steps, version, values)
        except OSError as exc:
            from shoal.learner.diskfull import is_disk_full

            (log.info if is_disk_full(exc) else log.warning)(
                "could not record learning curves in %s: %s", self.path.parent, exc
            )
            return False
        return True

    @staticmethod
    def _values(status: RunStatus) -> dict[str, float | None]:
        lead = status.statuses.get(0) or next(iter(status.statuses.values()), None)
        metrics = {} if lead is None else lead.metrics
        return {
            "return": status.recent_return(),
            "sps": sum(s.sps for s in status.statuses.values()),
            "policy_lag": status.policy_lag(),
            **{name: metrics.get(name) for name in METRICS},
        }

    def _append(self, line: str) -> None:
        new = not self.path.exists()
        with self.path.open("a") as handle:
            handle.write((HEADER + "\n" if new else "") + line + "\n")

    def _scalars(self, steps: int, version: int, values: dict[str, float | None]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            _log_writer_thread_failures()
            self._writer = SummaryWriter(log_dir=str(self.tensorboard))
        self._writer.add_scalar("train/version", version, steps)
        for name, value in values.items():
            if value is not None and math.isfinite(value):
                group = "losses" if name in METRICS else "train"
                self._writer.add_scalar(f"{group}/{name}", value, steps)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


_hooked = False


def _log_writer_thread_failures() -> None:
    """TensorBoard writes from a thread of its own; when that write fails (the disk filled
    between two records) Python prints the thread's traceback on stderr, through the run's
    progress line and its one-line ending. Such a failure is logged instead (idempotent)."""
    global _hooked
    if _hooked:
        return
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(
            args.exc_value, OSError
        ):
            log.info("TensorBoard's event writer stopped: %s", args.exc_value)
            return
        previous(args)

    threading.excepthook = hook
    _hooked = True
