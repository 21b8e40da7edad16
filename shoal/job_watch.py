"""Whether a training run's job is still going: the rules that end a run and tell when its
processes are gone, apart from the loop that applies them (shoal/cluster_train.py `ClusterRun`).

`RestartPolicy` is the job's `spec.restart`; `JobWatch` turns the coordinator's answers (and
its silences) into the reason to end, if any; `started_pids` and `alive` say whether the
processes the job started on this host have exited; `exit_reason` words why a process of an
embedded cluster stopped. Pure but for reading /proc and the disk's free space.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.errors import ConfigError

RESTART_WINDOW_S = 600.0
JOB_GONE_ANSWERS = 3
MOST_RESTARTS = 1_000_000
LONGEST_WINDOW_S = 1e9
UNREACHABLE_S = 60.0


def started_pids(lines: list[str], job_id: str) -> set[int]:
    """The pids of the processes that announced their start (events.jsonl lines) after job
    `job_id` was submitted; lines that are not such events are skipped."""
    pids: set[int] = set()
    after = False
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        if event.get("event") == "submitted":
            after = event.get("job") == job_id
            pids.clear()
        elif after and event.get("event") == "start" and isinstance(event.get("pid"), int):
            pids.add(event["pid"])
    return pids


def exit_reason(log_tail: str, run_dir: Path) -> str:
    """Why a process of the embedded cluster stopped, in one line: a full disk (its log names
    the errno, or the disk has no room left for it to have logged one) as such, with what to
    do, else the last line of its log."""
    from shoal.learner.diskfull import has_no_room, logs_disk_full

    if logs_disk_full(log_tail) or has_no_room(run_dir):
        return (
            f"the disk holding {run_dir} is full; free space or choose a --run-dir on a larger disk"
        )
    lines = [line.strip() for line in log_tail.splitlines() if line.strip()]
    return lines[-1] if lines else "its log is empty"


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie awaiting its parent's wait counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


@dataclass(frozen=True)
class RestartPolicy:
    """The job's `spec.restart`: the leader restarts failed tasks up to `max_restarts` times
    within `window_s` seconds; one more failure fails the job (and ends the run)."""

    max_restarts: int = 5
    window_s: float = RESTART_WINDOW_S

    def __post_init__(self) -> None:
        count, window = self.max_restarts, self.window_s
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MOST_RESTARTS:
            raise ConfigError(
                f"max_restarts (--max-restarts) = {count!r}: give a whole number from 0 to "
                f"{MOST_RESTARTS:,}"
            )
        if (
            isinstance(window, bool)
            or not isinstance(window, int | float)
            or not 0 < window <= LONGEST_WINDOW_S
        ):
            raise ConfigError(
                f"restart_window (--restart-window) = {window!r}: give seconds > 0 and at most "
                f"{LONGEST_WINDOW_S:g}"
            )

    def to_spec(self) -> dict[str, Any]:
        return {"max_restarts": self.max_restarts, "window_s": float(self.window_s)}


@dataclass
class JobWatch:
    """Decides when the job's state ends the run. One answer never does: a replica just
    restarted after a kill may still be replaying its log, and an unreachable cluster may be
    electing a leader. The run ends only after `needed` consecutive consistent answers that
    the job failed or does not exist, or after `patience_s` without any answer."""

    needed: int = JOB_GONE_ANSWERS
    patience_s: float = UNREACHABLE_S
    bad: int = 0
    answered_at: float | None = None

    def __post_init__(self) -> None:
        if self.needed < 1:
            raise ConfigError(f"needed = {self.needed!r}: give 1 or more answers")
        if self.patience_s <= 0:
            raise ConfigError(f"patience_s = {self.patience_s!r}: give a positive number of s")

    def answer(self, job_id: str, job: dict[str, Any] | None, now: float) -> str | None:
        """A consistent answer (None: the job does not exist); the reason to end, if any."""
        self.answered_at = now
        if job is not None and job.get("state") != "failed":
            self.bad = 0
            return None
        self.bad += 1
        if self.bad < self.needed:
            return None
        if job is None:
            return f"job {job_id} no longer exists on the coordinators ({self.bad} answers)"
        nodes = sorted({str(t.get("node")) for t in job.get("tasks", []) if t.get("node")})
        return (
            f"job {job_id} failed: {job.get('message') or '?'}; read its tasks' logs "
            f"on node(s) {', '.join(nodes) or '?'}"
        )

    def silence(self, error: str, now: float) -> str | None:
        """No answer this time (unreachable, no leader, a timeout); the reason to end, if any."""
        if self.answered_at is None:
            self.answered_at = now
        if now - self.answered_at < self.patience_s:
            return None
        return f"no coordinator answered for {now - self.answered_at:.0f} s: {error}"

    @property
    def doubtful(self) -> bool:
        """A bad answer is pending confirmation: ask again at the next poll."""
        return self.bad > 0
