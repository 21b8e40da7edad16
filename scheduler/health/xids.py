"""XID accounting per GPU: a count that only grows, the last XID code, and the events new since
the previous collection.

A summary that carried only "XIDs in this window" lost a burst whenever two windows were folded
into one (the leader keeps one summary per node per batch). With a running total beside the new
events, whoever folds summaries can tell a repeated summary from a new one and add up the new
events of each exactly once (raft/liveness.py does).

Two ways in: `record` for an event stream (NVML's event-set thread), `observe_last` for a
"last XID seen" field that is sampled (DCGM's DCGM_FI_DEV_XID_ERRORS), where a change of value
is the only sign of a new XID.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class XidCount:
    """One GPU's XIDs at one collection."""

    total: int = 0
    """Every XID seen on this GPU since the collector started; never goes down."""
    last: int | None = None
    """The code of the newest XID (79: fallen off the bus, 48: double-bit ECC, ...)."""
    new: tuple[int, ...] = ()
    """The codes seen since the previous `take`, oldest first."""


class XidLedger:
    """Per-GPU XID counts. Thread-safe: an event thread records while a collector takes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._new: dict[int, list[int]] = {}
        self._sampled: dict[int, int] = {}

    def record(self, gpu: int, code: int) -> None:
        """One XID event on `gpu`."""
        with self._lock:
            self._totals[gpu] = self._totals.get(gpu, 0) + 1
            self._last[gpu] = code
            self._new.setdefault(gpu, []).append(code)

    def observe_last(self, gpu: int, code: int | None) -> None:
        """A sampled "last XID" value (0 or None: none yet). The first sample of a GPU is its
        baseline, never new: an XID from before the collector started is history, not a fault
        to drain for. After that a change of value is one new XID; the same code raised twice
        between two samples cannot be told from no XID, which is the field's limit."""
        value = int(code or 0)
        with self._lock:
            before = self._sampled.get(gpu)
            self._sampled[gpu] = value
            if before is None:
                if value:
                    self._last[gpu] = value
                return
        if value and value != before:
            self.record(gpu, value)

    def take(self, gpus: list[int]) -> dict[int, XidCount]:
        """Each of `gpus` with its running total, last code and the XIDs new since the
        previous take (which this call hands out, so each event is new exactly once)."""
        with self._lock:
            out = {
                gpu: XidCount(
                    self._totals.get(gpu, 0),
                    self._last.get(gpu),
                    tuple(self._new.pop(gpu, ())),
                )
                for gpu in gpus
            }
        return out
