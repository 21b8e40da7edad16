"""The run's lifecycle events (start, resume, checkpoint, stop): one JSON line each in
events.jsonl, appended by learner ranks, rollout workers and `shoal train`. A leaf module, so a
rollout worker does not import the learner's process to write one."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def append_event(run_dir: Path, event: dict[str, Any]) -> None:
    """One line per lifecycle event (start, resume, checkpoint, stop) in events.jsonl."""
    with (run_dir / "events.jsonl").open("a") as handle:
        handle.write(json.dumps({"time": time.time(), **event}) + "\n")
