"""The node agent's decisions, as pure code over the values it is given (shoal/agent.py does
the I/O): which tasks to start and stop (`plan`), in which order to stop them (`stop_waves`),
when a node cut off from the coordinators fences (`FenceClock`), how long to pause between
tries (`Backoff` and its two uses), and the agent's settings with their checks. Kept apart so
each decision is tested without a coordinator, a clock or a child process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any, TypeVar

from shoal.errors import ConfigError
from shoal.raft.model import LEARNER_KIND
from shoal.tasks import TaskSpec

T = TypeVar("T")


@dataclass(frozen=True)
class Plan:
    """What to change locally: tasks to start (in the coordinator's order) and ids to stop."""

    start: tuple[TaskSpec, ...] = ()
    stop: tuple[str, ...] = ()


def plan(
    assigned: Sequence[TaskSpec],
    local: Mapping[str, int],
    done: Set[tuple[str, int]],
    accepting: bool = True,
) -> Plan:
    """Reconcile the coordinator's view with this node's.

    `local` maps each task running here to the generation it was started under; `done` holds
    the (task, generation) pairs that already ended here, which are never started again (their
    end may not be reported yet, and the coordinator may still say "running"). A local task
    stops when the coordinator no longer places it here, moved it (newer generation) or no
    longer wants it active. A task starts when it is wanted, not done and not already running at
    its generation; a draining node (`accepting=False`) starts nothing.
    """
    wanted = {t.id: t for t in assigned if t.active}
    stop = tuple(
        task_id
        for task_id, generation in local.items()
        if task_id not in wanted or wanted[task_id].generation != generation
    )
    start = tuple(
        t
        for t in wanted.values()
        if accepting and t.key not in done and local.get(t.id) != t.generation
    )
    return Plan(start, stop)


@dataclass(frozen=True)
class Registration:
    """What this node tells the coordinator about itself (see `register_node`)."""

    node_id: str
    address: str
    cpus: float
    memory: int
    gpus: list[dict[str, Any]] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class AgentConfig:
    heartbeat_s: float = 1.0
    """Heartbeat period; also how long an assignment may wait before it starts."""
    backoff_max_s: float = 5.0
    """Longest pause between tries while no coordinator answers."""
    stop_timeout_s: float = 20.0
    """How long a task may take to stop (a learner rank checkpoints) before SIGKILL."""
    fence_after_s: float | None = None
    """Stop every task here once no heartbeat was accepted for this long; None never does.
    Below the coordinators' dead-after minus a heartbeat, the node's copies are stopped before
    the leader places them elsewhere, so no task runs twice through a partition."""

    def __post_init__(self) -> None:
        for key in ("heartbeat_s", "backoff_max_s", "stop_timeout_s"):
            if not _seconds(getattr(self, key)):
                raise ConfigError(
                    f"{key}={getattr(self, key)!r} is invalid: use a number of seconds > 0"
                )
        if self.fence_after_s is not None and not _seconds(self.fence_after_s):
            raise ConfigError(
                f"fence_after_s={self.fence_after_s!r} is invalid: use a number of seconds > 0 "
                "(below the coordinators' dead-after minus a heartbeat), or leave it unset "
                "to never fence"
            )


def _seconds(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and 0 < value < math.inf


class FenceClock:
    """When a node cut off from the coordinators fences, as a pure function of the times it
    is given (monotonic seconds): once per silence of `after` seconds since the last contact,
    and lifted by the next contact. The agent's clock starts at registration."""

    def __init__(self, after: float, now: float) -> None:
        self.after = after
        self.last = now
        self.fenced = False

    def contact(self, now: float) -> bool:
        """A coordinator accepted a heartbeat at `now`; True when that lifts a fence."""
        self.last = max(self.last, now)
        lifted, self.fenced = self.fenced, False
        return lifted

    def check(self, now: float) -> bool:
        """True exactly when the node must fence now: silent for `after` and not yet fenced."""
        if self.fenced or now < self.last + self.after:
            return False
        self.fenced = True
        return True

    def wait(self, now: float) -> float:
        """How long to sleep before checking again: until the silence would reach `after`; a
        whole `after` while fenced (only a contact, which moves `last`, changes anything)."""
        return self.after if self.fenced else max(0.0, self.last + self.after - now)


class Backoff:
    """Doubling pauses from `first` up to `most`; `reset` after a success."""

    def __init__(self, first: float, most: float) -> None:
        self.first, self.most = first, most
        self.next = first

    def take(self) -> float:
        pause, self.next = self.next, min(self.most, self.next * 2)
        return pause

    def reset(self) -> None:
        self.next = self.first


STOP_FIRST = LEARNER_KIND
FIRST_REGISTRATION_PERIOD_S = 0.1


def registration_backoff(first: bool, most: float) -> Backoff:
    """The pauses between registration tries. The node's first registration is what a
    starting cluster (an embedded `shoal train`) waits on, and its coordinator is usually a
    moment from ready: retry at a steady short period. Later ones (the coordinator forgot us)
    back off, doubling, as the heartbeat does."""
    if first:
        return Backoff(FIRST_REGISTRATION_PERIOD_S, FIRST_REGISTRATION_PERIOD_S)
    return Backoff(FIRST_REGISTRATION_PERIOD_S, most)


def heartbeat_backoff(config: AgentConfig) -> Backoff:
    """The pauses between failed heartbeats: doubling from the period to `backoff_max_s`, or,
    on a fencing node, the period itself (as often as a healthy node sends them): doubling
    pauses could by themselves outlast `fence_after_s` after a leader election and fence a
    node that no coordinator lost."""
    most = config.backoff_max_s if config.fence_after_s is None else config.heartbeat_s
    return Backoff(config.heartbeat_s, most)


def stop_waves(tasks: Sequence[T], kind: Callable[[T], str]) -> list[list[T]]:
    """The order tasks stopped together stop in: learner ranks first, then the rest once
    they are gone. A rank told to stop may be inside an all-reduce that needs one more batch
    from a rollout worker; stopping the workers with it can leave it stuck until SIGKILL,
    without its final checkpoint and ledger. Empty waves are left out."""
    first = [t for t in tasks if kind(t) == STOP_FIRST]
    rest = [t for t in tasks if kind(t) != STOP_FIRST]
    return [wave for wave in (first, rest) if wave]
