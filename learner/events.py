"""The run's lifecycle events (start, resume, checkpoint, stop): one JSON line each in
events.jsonl (`RunDir.events`), appended by learner ranks, rollout workers and `shoal train`. A
leaf module, so a rollout worker does not import the learner's process to write one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shoal.rundir import RunDir


def append_event(run_dir: Path, event: dict[str, Any]) -> None:
    """One line per lifecycle event (start, resume, checkpoint, stop) in events.jsonl."""
    RunDir(run_dir).append_event(event)
