"""`ApiContext`: the one explicit object a handler (or the leader's duties) may touch, and the
single write path: validate, stamp, propose, turn a refusal into its error.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from shoal.raft import commands as cmd
from shoal.raft.bridge import RaftBridge
from shoal.raft.config import CoordinatorConfig
from shoal.raft.errors import Conflict, NotFound
from shoal.raft.liveness import LivenessTable
from shoal.raft.machine import Result, StateMachine
from shoal.raft.metrics import Metrics
from shoal.raft.state import ClusterState

T = TypeVar("T")


@dataclass
class ApiContext:
    """Everything a handler may touch; built once per replica (a test can build one in a line)."""

    config: CoordinatorConfig
    state: ClusterState
    bridge: RaftBridge
    liveness: LivenessTable
    metrics: Metrics = field(default_factory=Metrics)
    session: aiohttp.ClientSession | None = None

    async def write(self, op: str, args: dict[str, Any], op_id: str) -> Result:
        command = cmd.make_command(op, args, op_id, time.time())
        started = time.perf_counter()
        result = await self.bridge.propose(command, self.config.write_timeout)
        self.metrics.observe(
            "shoal_raft_commit_seconds",
            "propose-to-applied time of one command",
            time.perf_counter() - started,
        )
        self.metrics.inc(
            "shoal_raft_commands_total", "commands committed", op=op, ok=str(result["ok"]).lower()
        )
        raise_refusal(result)
        return result

    async def barrier(self) -> None:
        """Linearizable read: once a fresh no-op is applied here, every earlier write is too."""
        await self.write("barrier", {}, uuid.uuid4().hex)

    def read(self, fn: Callable[[StateMachine], T]) -> T:
        """Run a read-only function over the state under its lock; `fn` must return copies."""
        return self.state.read(fn)


def raise_refusal(result: Result) -> None:
    if result["ok"]:
        return
    error = NotFound if result["error"] == "not_found" else Conflict
    raise error(result["message"], result.get("field"))
