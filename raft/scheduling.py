"""The leader's scheduler loop (the I/O): replicated state in, replicated commands out.

Each round reads the state machine into the scheduler's plain inputs
(`scheduling_inputs.read_inputs`, pure), decides (`scheduling_decide.decide`, pure: same inputs
and memory, same commands) and commits the commands here, in batches, through the same write
path the API uses. What it decides:
- failed tasks of running auto jobs, and tasks that stopped while their job runs (their node
  drained, or the process exited 0 on its own), are restarted (`restart_tasks`; the state
  machine counts them against the job's `spec.restart` intensity and fails the job past it,
  except when the task's node went away: drained or dead): a rollout task alone, a learner
  rank with its whole group, as is a group one of whose ranks' node died;
- a counted restart waits out its job's back-off: its tasks stay pending until their `due`
  time (replicated, from the restart command's time), then are placed like any other;
- pending tasks, and the active tasks of dead nodes, are placed: a job's learner ranks as one
  gang (one NVLink island, else one RDMA domain, else refused with the reason, which is set on
  each task as its `pending_reason`), rollout actors spread; tasks of suspect nodes stay where
  they are. A placement names the GPU indices it gives each task, so the replicated `Task.gpus`
  is what the node runs the task on and what every later round (on any leader) reserves;
- on each new batch of health summaries the balancer runs; its migrations are committed as
  re-placements (a moved learner rank re-places its whole group), a node with an XID/ECC
  fault is set draining (which cordons it);
- every decision is posted as an event (placement, replace, refused, migration, cordon,
  balance) with its reason, so /v1/events says why.
Operation ids derive from the decision (task, generation, target), so a new leader that makes the
same decision again is applied once. Only the balancer's state and what was already said live in
the leader's memory (`Memory`); a failover starts them afresh and changes no placement.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from shoal.raft.context import ApiContext
from shoal.raft.errors import RaftError
from shoal.raft.scheduling_decide import Command, Memory, Round, decide, op_id
from shoal.raft.scheduling_inputs import Inputs, read_inputs
from shoal.scheduler.errors import SchedulerError

log = logging.getLogger(__name__)

BATCH_SIZE = 256
"""Commands per committed batch: a placement event is under 1 KB, the limit is 1 MiB."""


class SchedulerLoop:
    """Runs rounds every `config.scheduling.period` while this replica leads (event loop)."""

    def __init__(self, ctx: ApiContext) -> None:
        self._ctx = ctx
        self.memory = Memory()

    async def run(self) -> None:
        period = self._ctx.config.scheduling.period
        while True:
            try:
                await self.round(time.time())
            except RaftError as exc:
                self.memory.applied = -1
                log.warning("scheduling round not committed, retrying: %s", exc)
            except SchedulerError as exc:
                log.error("scheduling round refused its inputs: %s", exc)
            except Exception:  # a bug here must not end the leader's other duties (liveness)
                self.memory.applied = -1
                log.exception("scheduling round failed; retrying next period")
            await asyncio.sleep(period)

    async def round(self, now: float) -> Round:
        ctx = self._ctx
        waking = 0.0 < self.memory.wake <= now
        if ctx.read(lambda m: m.applied_count) == self.memory.applied and not waking:
            return Round(())
        self.memory.applied, inputs = ctx.read(lambda m: (m.applied_count, read_inputs(m)))
        self._forget(inputs)
        decision = decide(inputs, self.memory, now, ctx.config.scheduling.balancer)
        if decision.commands:
            await self._commit(decision.commands)
        return decision

    def _forget(self, inputs: Inputs) -> None:
        """Drop the memory of tasks that ended, so it does not grow without bound."""
        bad = {job for job, _ in inputs.bad_modes}
        for key in list(self.memory.said):
            what, where, task = key
            if (task and task not in inputs.tasks) or (what == "mode" and where not in bad):
                del self.memory.said[key]

    async def _commit(self, commands: tuple[Command, ...]) -> None:
        """Actions first, in one batch; then, in a second, the events of those that applied."""
        actions = [c for c in commands if c.op != "add_event"]
        applied = {""}
        for command, outcome in zip(actions, await self._batch(actions)):
            if outcome["ok"]:
                applied.add(command.op_id)
                continue
            log.warning("scheduler %s refused: %s", command.op, outcome["message"])
        await self._batch([c for c in commands if c.op == "add_event" and c.needs in applied])

    async def _batch(self, commands: list[Command]) -> list[dict[str, Any]]:
        """Commit in batches of BATCH_SIZE, so a large job stays under the command size limit."""
        results: list[dict[str, Any]] = []
        for start in range(0, len(commands), BATCH_SIZE):
            chunk = commands[start : start + BATCH_SIZE]
            at = time.time()
            members = [{"op": c.op, "op_id": c.op_id, "at": at, "args": c.args} for c in chunk]
            batch_id = op_id("batch", [c.op_id for c in chunk])
            result = await self._ctx.write("batch", {"commands": members}, batch_id)
            results.extend(result["results"])
        return results
