"""Which health collectors a node runs, and why the others are missing: what the node sends in
its heartbeat's health object, and how readers (`shoal status`, the dashboard) take it back.

A collector is in one of three states:
- `up`: built, and its last collection had data (a reason may still say something, e.g. a DCGM
  health warning);
- `down`: built, but its last collection had no data (the reason says why: no driver, no reply);
- `absent`: not built, because what it needs is not on this host (no DCGM host engine, no
  ptp4l) or the node was not asked for it (no --clock); the reason says which.

The node's health object is hostile to its readers (any node credential can send one), so
`read_states` keeps only what fits the shape, bounded in count and length, with printable text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from shoal.scheduler.health.collector import Report

UP, DOWN, ABSENT = "up", "down", "absent"
STATES = (UP, DOWN, ABSENT)
MAX_COLLECTORS = 16
MAX_REASON = 300
NAME_RE = re.compile(r"[a-z][a-z0-9_-]{0,31}")


def collector_states(
    reports: Iterable[Report], absent: Mapping[str, str]
) -> dict[str, dict[str, str]]:
    """name -> {"state", "reason"} for the built collectors (from their last reports) and the
    absent ones (from why they were not built), in that order."""
    states = {r.source: {"state": UP if r.available else DOWN, "reason": r.reason} for r in reports}
    for name, reason in absent.items():
        states[name] = {"state": ABSENT, "reason": reason}
    return states


def read_states(health: Any) -> dict[str, dict[str, str]]:
    """The `collectors` of a node's health object as sent: the first MAX_COLLECTORS entries
    whose name and state are valid, reasons cut to MAX_REASON printable characters; {} for
    an old node that sends none, or for anything that is not that shape."""
    listed = health.get("collectors") if isinstance(health, dict) else None
    if not isinstance(listed, dict):
        return {}
    out: dict[str, dict[str, str]] = {}
    for name, entry in listed.items():
        if len(out) >= MAX_COLLECTORS:
            break
        if not isinstance(name, str) or not NAME_RE.fullmatch(name) or not isinstance(entry, dict):
            continue
        state, reason = entry.get("state"), entry.get("reason", "")
        if state not in STATES or not isinstance(reason, str):
            continue
        out[name] = {"state": state, "reason": printable(reason)}
    return out


def read_util_source(health: Any) -> str | None:
    """The health object's `gpu_util_source` (which collector the GPU utilisation came from)
    if it is a valid collector name, else None."""
    source = health.get("gpu_util_source") if isinstance(health, dict) else None
    return source if isinstance(source, str) and NAME_RE.fullmatch(source) else None


def printable(text: str, limit: int = MAX_REASON) -> str:
    """`text` on one line of printable characters (a node's reason must not move a terminal's
    cursor, forge lines in `shoal status` or reorder text), cut to `limit` with an ellipsis.
    Control and format characters (bidi overrides included) become `?`."""
    flat = "".join(c if c.isprintable() else "?" for c in " ".join(text[: 4 * limit].split()))
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def describe(states: Mapping[str, Mapping[str, str]]) -> str:
    """One line for a terminal: `host up, nvml down (no NVIDIA driver), dcgm absent (...)`."""
    parts = []
    for name, entry in states.items():
        reason = entry.get("reason", "").removeprefix("unavailable: ")
        parts.append(f"{name} {entry['state']}" + (f" ({reason})" if reason else ""))
    return ", ".join(parts) or "not reported"
