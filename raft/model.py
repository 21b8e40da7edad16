"""The records ClusterState holds: plain typed data, JSON-able with `dataclasses.asdict`.

Times are seconds since the epoch, stamped by the replica that proposed the command (never read
from a clock while applying). Assignments are not stored as records: `Task.node` (the current
copy) and `Task.incoming.node` (a make-before-break migration's new copy) are the placements,
and the machine's node -> task ids index is derived from them alone.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

LEARNER_KIND = "learner-rank"
"""A learner rank: the leader gang-places all of a job's ranks and restarts them together."""
ROLLOUT_KIND = "rollout-worker"
"""A rollout worker: placed one by one, spread over the nodes."""
PROCESS_KINDS = frozenset({LEARNER_KIND, ROLLOUT_KIND})
"""Task kinds a node runs as a child process (`shoal.tasks`); any other kind is an actor."""
LIVENESS = ("alive", "suspect", "dead")
TASK_STATES = ("pending", "running", "stopped", "failed")
JOB_STATES = ("running", "stopped", "failed")
DEFAULT_MAX_RESTARTS = 5
DEFAULT_RESTART_WINDOW_S = 600.0
DEFAULT_BACKOFF_S = 1.0
DEFAULT_BACKOFF_MAX_S = 60.0


class Restorable:
    """A record unpickled from a data dir written by an older shoal (pysyncobj's dump pickles
    the records) gets its missing fields' defaults, instead of failing on first use."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            if f.name in state:
                continue
            if f.default is not MISSING:
                state[f.name] = f.default
            elif f.default_factory is not MISSING:
                state[f.name] = f.default_factory()
        self.__dict__.update(state)


@dataclass
class Gpu(Restorable):
    index: int
    uuid: str
    island: str
    domain: str


@dataclass
class Resources(Restorable):
    cpus: float
    memory: int
    gpus: list[Gpu] = field(default_factory=list)


@dataclass
class Node(Restorable):
    id: str
    address: str
    resources: Resources
    labels: dict[str, str]
    registered_at: float
    liveness: str = "alive"
    cordoned: bool = False
    draining: bool = False
    health: dict[str, Any] = field(default_factory=dict)
    last_heartbeat: float = 0.0


@dataclass
class TaskResources(Restorable):
    cpus: float = 0.0
    memory: int = 0
    gpus: int = 0


@dataclass
class Incoming(Restorable):
    """The new copy of a task being migrated make-before-break: it runs beside the current
    copy, under its own generation, until it reports running (promoted) or fails (dropped)."""

    node: str
    generation: int
    state: str = "pending"
    gpus: list[int] = field(default_factory=list)
    """The GPU indices on `node` the copy was given (see `Task.gpus`)."""
    published: dict[str, Any] = field(default_factory=dict)
    """What this copy published (see `Task.published`); the task's own once it is promoted."""


@dataclass
class Task(Restorable):
    id: str
    job_id: str
    kind: str
    actor: str
    args: dict[str, Any]
    resources: TaskResources
    node: str | None = None
    state: str = "pending"
    restarts: int = 0
    generation: int = 0
    message: str = ""
    incoming: Incoming | None = None
    issued: int = 0
    """The highest generation ever handed out, so an abandoned incoming copy's generation is
    never reused and its late reports stay stale."""
    due: float = 0.0
    """When a restarted task may be placed again (its job's restart back-off; the leader's
    clock, carried by the restart command): the scheduler leaves it pending until then."""
    gpus: list[int] = field(default_factory=list)
    """The GPU indices on `node` this generation was placed on: replicated, so the node runs
    the task on exactly these and a new leader reserves the same ones. Empty when unplaced."""
    published: dict[str, Any] = field(default_factory=dict)
    """A small flat object the running task published (a learner rank's addresses, rank 0's
    progress), for its job's other tasks and the submitter: it belongs to this generation and
    is cleared whenever the task gets a new one, so a stale address is never read."""
    pending_reason: str = ""
    """Why the leader cannot place this generation (the refusal's reason), else empty."""


@dataclass
class Job(Restorable):
    id: str
    spec: dict[str, Any]
    submitted_at: float
    state: str = "running"
    stopped_at: float | None = None
    message: str = ""
    """Why the job failed (its last failure and the restart count), else empty."""
    restarts: int = 0
    """Every restart of its tasks: a failed task, or a learner group started again as one."""
    restart_times: list[float] = field(default_factory=list)
    """When the restarts that count toward `spec.restart` happened, within its window."""

    def restart_policy(self) -> tuple[int, float]:
        """(max_restarts, window_s) from `spec.restart` (validated at submit), else defaults."""
        policy = self.spec.get("restart") or {}
        return (
            int(policy.get("max_restarts", DEFAULT_MAX_RESTARTS)),
            float(policy.get("window_s", DEFAULT_RESTART_WINDOW_S)),
        )

    def backoff(self, earlier: int) -> float:
        """Seconds a counted restart waits when `earlier` counted restarts are already in the
        window: none for the first, then `backoff_s` doubling up to `backoff_max_s`, so a
        crash loop spreads its restarts out instead of spending its intensity in seconds."""
        if earlier <= 0:
            return 0.0
        policy = self.spec.get("restart") or {}
        base = float(policy.get("backoff_s", DEFAULT_BACKOFF_S))
        cap = float(policy.get("backoff_max_s", DEFAULT_BACKOFF_MAX_S))
        return min(base * 2.0 ** min(earlier - 1, 64), cap)


@dataclass
class Checkpoint(Restorable):
    job_id: str
    path: str
    step: int
    sha256: str
    complete: bool
    recorded_at: float


@dataclass
class Event(Restorable):
    seq: int
    at: float
    kind: str
    message: str
    fields: dict[str, Any]


@dataclass
class LeaderRecord(Restorable):
    """The replica that last announced itself leader, so followers can reach its admin API."""

    replica_id: str
    raft: str
    api: str
    term: int
    since: float


@dataclass
class Fault(Restorable):
    """A fault asked for through the chaos API, addressed to the node that executes it (the
    task's node, or the node itself). Replicas only record it; the node acts, once, and
    reports the outcome: requested -> injected (-> healed, for a pause) or failed.

    Its kinds, states and rules are in raft/fault_records.py; the record stays here with the
    others because pysyncobj's dumps pickle it by this module's path (`shoal.raft.model.Fault`),
    so a data directory written before the fault records moved still restores."""

    id: str
    kind: str
    target: str
    node: str
    requested_at: float
    duration_s: float = 0.0
    generation: int = 0
    """For a task fault, the task's generation when asked: a later incarnation is spared."""
    gpu: int | None = None
    xid: int | None = None
    offset_s: float | None = None
    """For clock-skew, the seconds added to the node's clock until `duration_s` has passed."""
    state: str = "requested"
    message: str = ""
    updated_at: float = 0.0
    tasks: dict[str, int] = field(default_factory=dict)
    """What a kill stops: task id -> its generation then. The fault is healed when each runs
    again at a later generation (or its job ended), the recovery the leader measures."""
    injected_at: float | None = None
    recovery_s: float | None = None
    """Seconds from the node's `injected` report to the fault healed (kills: tasks running)."""
