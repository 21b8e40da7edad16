"""What a failed `shoal chaos run --json` is shown as: the invariants that broke and each fault's
outcome. The end of its output is only the training curve, which names neither."""

from __future__ import annotations

import json
import subprocess


def chaos_failure(done: subprocess.CompletedProcess[str]) -> str:
    """The invariants that broke and each fault's outcome (the report's end is only the
    training timeline), else the output's tails when there is no report."""
    try:
        report = json.loads(done.stdout)
        broken = {k: v for k, v in report["invariants"].items() if not v["held"]}
        faults = [
            {k: f.get(k) for k in ("kind", "detail", "recovered", "progress_s", "unsupported")}
            for f in report["faults"]
        ]
    except (ValueError, KeyError, TypeError, AttributeError):
        return done.stdout[-4000:] + done.stderr[-4000:]
    return json.dumps({"broken": broken, "faults": faults}, indent=1) + done.stderr[-2000:]
