"""What only the leader does: announce itself, turn in-memory heartbeats into replicated
liveness changes and batched health summaries, and run the scheduler loop (raft/scheduling.py).

Started when this replica becomes leader and cancelled when it stops being one (event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from shoal.raft.context import ApiContext
from shoal.raft.errors import RaftError
from shoal.raft.scheduling import SchedulerLoop

log = logging.getLogger(__name__)
RETRY_PERIOD = 0.1


class LeaderDuties:
    """Owns the leader-only task; `on_leadership` is a RaftBridge listener (event loop)."""

    def __init__(self, ctx: ApiContext) -> None:
        self._ctx = ctx
        self._task: asyncio.Task[None] | None = None

    def on_leadership(self, leading: bool) -> None:
        if leading and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._lead())
        elif not leading and self._task is not None:
            self._task.cancel()
            self._task = None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _lead(self) -> None:
        ctx = self._ctx
        ctx.liveness.reset(time.time())
        await self._announce()
        async with asyncio.TaskGroup() as duties:
            duties.create_task(SchedulerLoop(ctx).run(), name="shoal-scheduler")
            duties.create_task(self._watch_nodes(), name="shoal-liveness")

    async def _watch_nodes(self) -> None:
        ctx = self._ctx
        last_health = time.monotonic()
        while True:
            await asyncio.sleep(ctx.config.liveness.check_period)
            try:
                await self._check_liveness()
                if time.monotonic() - last_health >= ctx.config.liveness.health_period:
                    last_health = time.monotonic()
                    reports = ctx.liveness.take_health()
                    if reports:
                        await ctx.write("report_health", {"reports": reports}, uuid.uuid4().hex)
            except RaftError as exc:
                log.warning("leader duty failed, retrying: %s", exc)

    async def _announce(self) -> None:
        ctx = self._ctx
        op_id = uuid.uuid4().hex
        while True:
            args = {
                "replica_id": ctx.config.replica_id,
                "raft": ctx.config.raft,
                "api": ctx.config.api_url,
                "term": ctx.bridge.status()["term"],
            }
            try:
                await ctx.write("announce_leader", args, op_id)
                log.info("%s leads term %d", ctx.config.replica_id, args["term"])
                return
            except RaftError as exc:
                log.warning("could not announce leadership yet: %s", exc)
                op_id = uuid.uuid4().hex
                await asyncio.sleep(RETRY_PERIOD)

    async def _check_liveness(self) -> None:
        ctx = self._ctx
        current = ctx.read(lambda m: {n.id: n.liveness for n in m.nodes.values()})
        changes = ctx.liveness.changes(current, time.time())
        if changes:
            await ctx.write("set_liveness", {"changes": changes}, uuid.uuid4().hex)
