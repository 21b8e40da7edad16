"""Plain records the scheduler reads and writes: nodes, GPUs, tasks, placements.

They are frozen values, so equal inputs give equal plans. The Raft coordinator replicates its
own records (raft/model.py) and builds these from them each round; only `NodeHealth` crosses
a process boundary, as JSON in a node's heartbeat (`to_dict` there, `from_dict` on the
leader). Nothing here knows about Raft.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from shoal.scheduler.errors import TopologyError

NODE_STATES = ("ready", "cordoned", "draining", "dead")
TASK_KINDS = ("learner", "rollout")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise TopologyError(message)


def _nonneg(name: str, value: float, what: str) -> None:
    _require(
        isinstance(value, int | float) and math.isfinite(value) and value >= 0,
        f"{what}: {name} must be a finite number >= 0, got {value!r}",
    )


@dataclass(frozen=True)
class Gpu:
    """One GPU; `island` names its NVLink island, which may span several nodes."""

    index: int
    island: str

    def __post_init__(self) -> None:
        _require(
            isinstance(self.index, int) and self.index >= 0,
            f"GPU index must be an int >= 0, got {self.index!r}",
        )
        _require(bool(self.island), f"GPU {self.index}: island label must be a non-empty string")


@dataclass(frozen=True)
class Node:
    """A host: its capacity, its GPUs, its RDMA domain and whether it may take new work."""

    name: str
    cpus: float
    memory_mb: int
    gpus: tuple[Gpu, ...] = ()
    domain: str = "default"
    state: str = "ready"

    def __post_init__(self) -> None:
        _require(bool(self.name), "node name must be a non-empty string")
        _nonneg("cpus", self.cpus, f"node {self.name!r}")
        _nonneg("memory_mb", self.memory_mb, f"node {self.name!r}")
        _require(
            self.state in NODE_STATES,
            f"node {self.name!r}: state {self.state!r} is not one of {', '.join(NODE_STATES)}",
        )
        indices = [gpu.index for gpu in self.gpus]
        _require(
            len(set(indices)) == len(indices),
            f"node {self.name!r}: GPU indices {indices} repeat; each GPU needs its own index",
        )

    @property
    def schedulable(self) -> bool:
        """Cordoned, draining and dead nodes take no new tasks."""
        return self.state == "ready"

    def island_of(self, index: int) -> str:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu.island
        raise TopologyError(f"node {self.name!r} has no GPU {index}")


@dataclass(frozen=True)
class LearnerGroup:
    """`ranks` processes with `gpus_per_rank` GPUs each, placed as one gang or not at all.

    A rank's GPUs are always on one node (a rank is one process); the gang as a whole wants one
    NVLink island. `gpus_per_rank=0` is a CPU learner (gloo) and only needs one RDMA domain.
    """

    name: str
    ranks: int
    gpus_per_rank: int
    cpus_per_rank: float = 1.0
    memory_mb_per_rank: int = 0

    def __post_init__(self) -> None:
        _require(bool(self.name), "learner group name must be a non-empty string")
        _require(
            isinstance(self.ranks, int) and self.ranks >= 1,
            f"learner group {self.name!r}: ranks must be an int >= 1, got {self.ranks!r}",
        )
        _require(
            isinstance(self.gpus_per_rank, int) and self.gpus_per_rank >= 0,
            f"learner group {self.name!r}: gpus_per_rank must be an int >= 0, "
            f"got {self.gpus_per_rank!r}",
        )
        _nonneg("cpus_per_rank", self.cpus_per_rank, f"learner group {self.name!r}")
        _nonneg("memory_mb_per_rank", self.memory_mb_per_rank, f"learner group {self.name!r}")

    @property
    def total_gpus(self) -> int:
        return self.ranks * self.gpus_per_rank

    def rank_task(self, rank: int) -> str:
        """The task name of one rank, e.g. `ppo/rank3`."""
        return f"{self.name}/rank{rank}"


@dataclass(frozen=True)
class RolloutActor:
    """A rollout actor's request; it may run on any ready node with room for it."""

    name: str
    cpus: float = 1.0
    memory_mb: int = 0
    gpus: int = 0
    movable: bool = True

    def __post_init__(self) -> None:
        _require(bool(self.name), "rollout actor name must be a non-empty string")
        _nonneg("cpus", self.cpus, f"rollout actor {self.name!r}")
        _nonneg("memory_mb", self.memory_mb, f"rollout actor {self.name!r}")
        _require(
            isinstance(self.gpus, int) and self.gpus >= 0,
            f"rollout actor {self.name!r}: gpus must be an int >= 0, got {self.gpus!r}",
        )


@dataclass(frozen=True)
class Placement:
    """One task on one node with the resources reserved for it there.

    `group` is the learner group a rank belongs to ("" for rollout actors); the balancer needs
    it to know whether the group is at a checkpoint boundary.
    """

    task: str
    node: str
    kind: str
    gpus: tuple[int, ...] = ()
    cpus: float = 0.0
    memory_mb: int = 0
    group: str = ""
    movable: bool = True

    def __post_init__(self) -> None:
        _require(bool(self.task), "placement task name must be a non-empty string")
        _require(
            self.kind in TASK_KINDS,
            f"task {self.task!r}: kind {self.kind!r} is not one of {', '.join(TASK_KINDS)}",
        )
        _require(
            len(set(self.gpus)) == len(self.gpus),
            f"task {self.task!r}: GPU list {list(self.gpus)} repeats a GPU",
        )
        _nonneg("cpus", self.cpus, f"task {self.task!r}")
        _nonneg("memory_mb", self.memory_mb, f"task {self.task!r}")

    def moved_to(self, node: str, gpus: tuple[int, ...]) -> Placement:
        """The same task and reservation on another node."""
        return Placement(
            task=self.task,
            node=node,
            kind=self.kind,
            gpus=gpus,
            cpus=self.cpus,
            memory_mb=self.memory_mb,
            group=self.group,
            movable=self.movable,
        )


@dataclass(frozen=True)
class Refusal:
    """A task that was not placed, and why, in words a user can act on."""

    task: str
    reason: str


@dataclass(frozen=True)
class PlacementPlan:
    """What `place` decided: new placements, and the tasks it refused."""

    placements: tuple[Placement, ...] = ()
    refused: tuple[Refusal, ...] = field(default=())


@dataclass(frozen=True)
class NodeHealth:
    """One node's latest health summary, as its daemon reported it with the heartbeat.

    Fractions are 0..1 (utilisation may exceed 1 when a node is oversubscribed). `xid_errors`
    and `ecc_errors` count NEW events since the previous report, `xid_total` and `ecc_total`
    the running counts they add to (how a repeated report is told from a new one); `steps_baseline` is the node's
    own recent env steps/s, so a slowdown is judged against itself, not against other hardware.
    """

    node: str
    cpu: float = 0.0
    memory: float = 0.0
    gpu_util: float = 0.0
    gpu_memory: float = 0.0
    xid_errors: int = 0
    ecc_errors: int = 0
    xid_total: int = 0
    ecc_total: int = 0
    latency_ms: float = 0.0
    clock_offset_ms: float = 0.0
    steps_per_s: float | None = None
    steps_baseline: float | None = None

    def __post_init__(self) -> None:
        for name in ("cpu", "memory", "gpu_util", "gpu_memory", "latency_ms"):
            _nonneg(name, getattr(self, name), f"health of {self.node!r}")
        for name in ("xid_errors", "ecc_errors", "xid_total", "ecc_total"):
            value = getattr(self, name)
            _require(
                isinstance(value, int) and value >= 0,
                f"health of {self.node!r}: {name} must be an int >= 0, got {value!r}",
            )
        _require(
            isinstance(self.clock_offset_ms, int | float) and math.isfinite(self.clock_offset_ms),
            f"health of {self.node!r}: clock_offset_ms must be finite, got {self.clock_offset_ms!r}",
        )
        for name in ("steps_per_s", "steps_baseline"):
            value = getattr(self, name)
            if value is not None:
                _nonneg(name, value, f"health of {self.node!r}")

    def load(self) -> tuple[float, str]:
        """The busiest resource fraction and its name: what overload is judged on."""
        return max(
            (self.cpu, "cpu"),
            (self.memory, "memory"),
            (self.gpu_util, "gpu_util"),
            (self.gpu_memory, "gpu_memory"),
        )

    def steps_ratio(self) -> float | None:
        """Env steps/s as a fraction of the node's own baseline, or None when unknown."""
        if self.steps_per_s is None or not self.steps_baseline:
            return None
        return self.steps_per_s / self.steps_baseline

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeHealth:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


@dataclass(frozen=True)
class Migration:
    """Make-before-break: start `task` on `target` first, stop it on `source` only once the new
    copy runs, so a migration never leaves a gap in rollout throughput."""

    task: str
    source: str
    target: str
    gpus: tuple[int, ...]
    reason: str

    @property
    def steps(self) -> tuple[tuple[str, str], ...]:
        return (("start", self.target), ("stop", self.source))


DECISION_ACTIONS = ("overloaded", "recovered", "drain", "degraded", "hold", "stuck")


@dataclass(frozen=True)
class Decision:
    """Something the balancer concluded about a node (or one task on it), with the reason the
    leader posts to /v1/events. `drain` asks the leader to cordon and drain the node."""

    node: str
    action: str
    reason: str
    task: str = ""

    def __post_init__(self) -> None:
        _require(
            self.action in DECISION_ACTIONS,
            f"decision action {self.action!r} is not one of {', '.join(DECISION_ACTIONS)}",
        )


@dataclass(frozen=True)
class BalancerState:
    """What the balancer remembers between rounds; the leader keeps it and passes it back.

    `streak` counts consecutive reports at or above the high threshold (a node must stay there
    for `enter_after` reports to count as overloaded); the two `*_moved_at` maps hold the time
    of the last migration of a task and of a node, for the cooldowns.
    """

    overloaded: frozenset[str] = frozenset()
    degraded: frozenset[str] = frozenset()
    streak: tuple[tuple[str, int], ...] = ()
    task_moved_at: tuple[tuple[str, float], ...] = ()
    node_moved_at: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class BalancePlan:
    """One balancing round: what to move (in order), what was concluded, the state to keep."""

    migrations: tuple[Migration, ...]
    decisions: tuple[Decision, ...]
    state: BalancerState
