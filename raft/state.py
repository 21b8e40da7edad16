"""ClusterState: the pure StateMachine made a pysyncobj consumer, with one replicated writer.

pysyncobj applies log entries on its tick thread while the admin API reads from the event
loop, so every access goes through one short lock; readers get copies, never live records.
pysyncobj pickles the consumer's attributes set after `SyncObjConsumer.__init__` into its dump
file, which is why the lock is created before it and the machine after.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeVar

from pysyncobj import SyncObjConsumer, replicated

from shoal.raft.machine import Result, StateMachine

ApplyCallback = Callable[[Any, int], None]
T = TypeVar("T")


class ClusterState(SyncObjConsumer):
    """Replicated cluster records. `apply` may be called from any thread; reads likewise."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        super().__init__()
        self._machine = StateMachine()

    @replicated
    def apply(self, command: dict[str, Any]) -> Result:
        """Runs on pysyncobj's thread once the command is committed; never raises on a valid one."""
        with self._lock:
            return self._machine.apply(command)

    def propose(self, command: dict[str, Any], callback: ApplyCallback) -> None:
        """Hand a validated command to pysyncobj; `callback(result, fail_reason)` runs on its thread."""
        self.apply(command, callback=callback)

    def _deserialize(self, data: dict[str, Any]) -> None:
        with self._lock:
            super()._deserialize(data)

    # -- reads (copies, taken under the lock) ----------------------------------------------

    def read(self, fn: Callable[[StateMachine], T]) -> T:
        """Run a read-only function over the machine under the lock; it must return copies."""
        with self._lock:
            return fn(self._machine)

    def digest(self) -> str:
        return str(self.read(StateMachine.digest))

    def leader_record(self) -> dict[str, Any] | None:
        return self.read(lambda m: None if m.leader is None else asdict(m.leader))
