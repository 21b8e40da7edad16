"""The node agent's outbox of task states: what it tells the coordinator about the tasks that
started, stopped or failed here, delivered in order of arrival, retried with growing pauses
while no coordinator answers, and dropped when the coordinator says it no longer applies.

Only the newest state of each task is kept: a task that fails while its "running" report still
waits is reported failed, once. Event-loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from shoal.agent_policy import Backoff
from shoal.raft.client import RETRYABLE, CoordinatorClient
from shoal.raft.errors import Conflict, NotFound, RaftError
from shoal.tasks import TaskSpec

log = logging.getLogger("shoal.node")

MAX_MESSAGE = 4000
"""Characters of a report's message kept (a child's last words can be long)."""
FIRST_RETRY_S = 0.1


class TaskReports:
    """`add` queues a task's state; `run` (a task of its own) delivers them; `flush` waits until
    none is left or a time runs out."""

    def __init__(self, client: CoordinatorClient, backoff_max_s: float) -> None:
        self.client = client
        self.backoff_max_s = backoff_max_s
        self.pending: dict[str, tuple[int, str, str]] = {}
        """Each task's newest undelivered (generation, state, message)."""
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def add(self, spec: TaskSpec, state: str, message: str) -> None:
        self.pending[spec.id] = (spec.generation, state, message[:MAX_MESSAGE])
        self._idle.clear()
        self._wake.set()

    async def run(self) -> None:
        backoff = Backoff(FIRST_RETRY_S, self.backoff_max_s)
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.pending:
                task_id, report = next(iter(self.pending.items()))
                if await self._send(task_id, *report):
                    backoff.reset()
                    if self.pending.get(task_id) == report:
                        del self.pending[task_id]
                else:
                    await asyncio.sleep(backoff.take())
            self._idle.set()

    async def flush(self, timeout: float) -> None:
        """Wait until every report is delivered, or `timeout` seconds passed."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)

    async def _send(self, task_id: str, generation: int, state: str, message: str) -> bool:
        """Report one state; False when it should be retried later."""
        try:
            await self.client.set_task_state(task_id, state, generation, message)
        except (NotFound, Conflict) as exc:
            log.info("dropped the %s report of task %s: %s", state, task_id, exc)
        except RETRYABLE as exc:
            log.warning("cannot report task %s %s yet (%s); will retry", task_id, state, exc)
            return False
        except RaftError as exc:
            log.error("the coordinator refused the %s report of task %s: %s", state, task_id, exc)
        return True
