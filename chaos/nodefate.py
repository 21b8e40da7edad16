"""What becomes of a faulted node and of the tasks it ran, read through the coordinator while
the fault lasts: the liveness the leader gives the node (alive -> suspect -> dead -> alive) and
how long after the injection every task of the training job it ran is `running` again where
the leader re-placed it: on another node, or at a newer generation back on the node itself
(a node that returns while its tasks are being placed may get some of them again). The issue's
target for that, for a failed node, is TASKS_ELSEWHERE_TARGET_S.

A node back before the leader declared it dead keeps its tasks (its daemon restarts them in
place, same generation), so then nothing moves and no time is measured: the record says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.chaos.errors import FaultError
from shoal.raft.client import CoordinatorClient
from shoal.raft.errors import RaftError

TASKS_ELSEWHERE_TARGET_S = 10.0
POLL_PERIOD = 0.25

TaskReader = Callable[[CoordinatorClient], Awaitable[list[dict[str, Any]]]]
# A task as it was on the faulted node: its id and generation then.
TaskAt = tuple[str, int]


def moved(before: Sequence[TaskAt], node: str, tasks: Sequence[Mapping[str, Any]]) -> bool:
    """Whether every task in `before` is `running` where the leader re-placed it: on a node
    other than `node`, or at a newer generation than it had there."""
    by_id = {str(t.get("id")): t for t in tasks}

    def replaced(task_id: str, generation: int) -> bool:
        now = by_id.get(task_id)
        if now is None or now.get("state") != "running" or now.get("node") is None:
            return False
        return now["node"] != node or int(now.get("generation", 0)) > generation

    return all(replaced(task_id, generation) for task_id, generation in before)


@dataclass
class NodeFate:
    node: str
    tasks: list[TaskAt]
    """The job's tasks the node ran when the fault was injected."""
    liveness: list[str] = field(default_factory=list)
    elsewhere_s: float | None = None

    def saw(self, liveness: str) -> None:
        """Record one reading of the node's liveness (a repeat of the last one is no news)."""
        if not self.liveness or self.liveness[-1] != liveness:
            self.liveness.append(liveness)

    def done(self, healed: bool) -> bool:
        """Nothing more to learn: the node is alive again after the heal, and its tasks have
        moved, or it never was declared dead (so they stayed), or it ran none."""
        if not healed or not self.liveness or self.liveness[-1] != "alive":
            return False
        return not self.tasks or self.elsewhere_s is not None or "dead" not in self.liveness

    def describe(self) -> str:
        story = " -> ".join(self.liveness) or "liveness never read"
        if not self.tasks:
            return f"{self.node} {story}; it ran no task of the job"
        if self.elsewhere_s is not None:
            return (
                f"{self.node} {story}; its {len(self.tasks)} job tasks re-placed and running after "
                f"{self.elsewhere_s:.2f} s (target {TASKS_ELSEWHERE_TARGET_S:g} s)"
            )
        if "dead" not in self.liveness:
            return f"{self.node} {story}; never declared dead, so its {len(self.tasks)} job tasks stayed"
        return f"{self.node} {story}; its {len(self.tasks)} job tasks were not all re-placed and running"


async def watch(
    client: CoordinatorClient,
    fates: Sequence[NodeFate],
    read_tasks: TaskReader | None,
    start: float,
    deadline: float,
    healed: asyncio.Event,
) -> None:
    """Poll each node's liveness and (with `read_tasks`) the job's tasks until every fate is
    done or `deadline` (monotonic) passes; `start` is the injection's monotonic time."""
    while time.monotonic() < deadline:
        with contextlib.suppress(RaftError, OSError, TimeoutError, FaultError, KeyError):
            tasks = [] if read_tasks is None else await read_tasks(client)
            now = round(time.monotonic() - start, 3)
            for fate in fates:
                fate.saw(str((await client.node(fate.node))["liveness"]))
                if fate.tasks and fate.elsewhere_s is None and moved(fate.tasks, fate.node, tasks):
                    fate.elsewhere_s = now
        if all(f.done(healed.is_set()) for f in fates):
            return
        await asyncio.sleep(POLL_PERIOD)
