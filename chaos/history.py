"""Client operations as a checker needs them: what was asked, what came back, and when.

A recorder stamps `invoke` before the request leaves and `complete` after the answer arrived,
both from one monotonic clock, so an operation's effect lies somewhere inside its interval. An
operation whose outcome is unknown (timeout, crashed client, lost connection) stays *pending*:
`complete is None`, and the checker lets it take effect at any time after its invocation, or
never. A request the server refused for sure (a validation error) is `discard`ed: it had no effect.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace

from shoal.chaos.errors import HistoryError

KINDS = ("read", "write")


@dataclass(frozen=True)
class Operation:
    """One client call on one key. For a write `value` is what was written; for a completed
    read it is what was read (None: the key did not exist yet)."""

    client: str
    kind: str
    key: str
    value: Hashable
    invoke: float
    complete: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise HistoryError(f"operation kind {self.kind!r} is unknown; use one of {KINDS}")
        if self.complete is not None and self.complete < self.invoke:
            raise HistoryError(
                f"{self.describe()} completes at {self.complete} before its invocation "
                f"at {self.invoke}; stamp both from one monotonic clock"
            )

    @property
    def pending(self) -> bool:
        return self.complete is None

    def describe(self) -> str:
        verb = "wrote" if self.kind == "write" else "read"
        until = "pending" if self.complete is None else f"{self.complete:.6f}"
        return f"{self.client} {verb} {self.key}={self.value!r} [{self.invoke:.6f}, {until}]"


class HistoryRecorder:
    """Collects operations from many client tasks (and threads: every method takes a lock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._ops: list[Operation | None] = []

    def invoke(self, client: str, kind: str, key: str, value: Hashable = None) -> int:
        """Stamp the start of a call; returns a handle for `complete`/`discard`."""
        op = Operation(client, kind, key, value, self._clock())
        with self._lock:
            self._ops.append(op)
            return len(self._ops) - 1

    def complete(self, handle: int, value: Hashable = None) -> None:
        """The call succeeded; a read passes what it read (a write's value is kept)."""
        now = self._clock()
        with self._lock:
            op = self._get(handle)
            result = value if op.kind == "read" else op.value
            self._ops[handle] = replace(op, value=result, complete=now)

    def discard(self, handle: int) -> None:
        """The call certainly had no effect (refused before it was proposed)."""
        with self._lock:
            self._get(handle)
            self._ops[handle] = None

    def _get(self, handle: int) -> Operation:
        op = self._ops[handle] if 0 <= handle < len(self._ops) else None
        if op is None or op.complete is not None:
            raise HistoryError(f"operation handle {handle} is unknown or already finished")
        return op

    def operations(self) -> list[Operation]:
        """Everything recorded; calls never completed stay pending (reads among them tell
        nothing and are left out)."""
        with self._lock:
            ops = [op for op in self._ops if op is not None]
        return [op for op in ops if not (op.pending and op.kind == "read")]
