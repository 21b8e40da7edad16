"""The scheduler's adapter: the replicated state machine read into the scheduler's plain inputs.

`read_inputs` is pure (it runs under the state's lock and only reads): it turns the machine's
records (nodes, jobs, tasks, checkpoints) into frozen `Inputs` that `scheduling_decide.decide`
works on, so the decisions never touch a Raft record. See `scheduling.py` for the round.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from dataclasses import dataclass, field

from shoal.raft.machine import StateMachine
from shoal.raft.model import LEARNER_KIND
from shoal.raft.model import Node as RaftNode
from shoal.raft.model import Task as RaftTask
from shoal.scheduler.errors import SchedulerError
from shoal.scheduler.model import Gpu, Node, NodeHealth, Placement
from shoal.scheduler.topology import Topology

log = logging.getLogger(__name__)

ACTIVE = ("pending", "running")
ENDED = ("failed", "stopped")
"""A task of a running job in one of these states is restarted: the job still wants it."""
PLACEMENT_MODES = ("auto", "manual")
"""A job's `spec.placement`: "auto" jobs (the default: a job submitted without the field is
scheduled) are the scheduler's; "manual" ones, whose tasks are placed by hand through
/v1/placements, are never placed or moved by it."""
MB = 1 << 20


@dataclass(frozen=True)
class TaskInfo:
    """What a round needs of one active task besides its reservation."""

    id: str
    job: str
    learner: bool
    generation: int
    node: str | None
    cpus: float
    memory_mb: int
    gpus: int
    auto: bool
    """The job's `spec.placement` is "auto": the scheduler places, moves and re-places it."""
    running: bool = False
    """Its current copy reported running: a move of a rollout actor is then make-before-break."""
    migrating: bool = False
    """An incoming copy is starting elsewhere: the task is not moved again until it resolves."""
    next_generation: int = 1
    """The generation the machine hands out next (to a re-placement or an incoming copy)."""
    due: float = 0.0
    """A restarted task is not placed before this time (its job's restart back-off)."""
    gpu_ids: tuple[int, ...] = ()
    """The GPU indices its copy holding the place was given (replicated `Task.gpus`)."""
    pending_reason: str = ""
    """Why the leader last said it cannot be placed (replicated), else empty."""


@dataclass(frozen=True)
class Failure:
    """A task of a running auto job that ended (reported `failed`, or `stopped` while its job
    still runs) at `generation`: it is still wanted, so it is restarted."""

    id: str
    job: str
    learner: bool
    generation: int
    message: str
    state: str = "failed"
    gone: str = ""
    """The node it ran on when that node went away (draining or dead), else empty: the end is
    the node's doing, not the task's, so its restart is not counted."""


@dataclass(frozen=True)
class Inputs:
    """The scheduler's view of the replicated state at one moment.

    Every active task is in exactly one of `placements` (it holds a place on a live node),
    `pending` (an auto task that needs one: never placed, or its node is dead) and `held` (a
    manual task without a live node: only /v1/placements may place it).
    """

    topology: Topology
    placements: tuple[Placement, ...]
    pending: tuple[str, ...]
    held: tuple[str, ...]
    tasks: dict[str, TaskInfo]
    health: tuple[NodeHealth, ...]
    health_stamp: str
    checkpoint_groups: frozenset[str]
    bad_modes: tuple[tuple[str, str], ...] = ()
    """(job, its spec.placement) where that value is neither "auto" nor "manual"."""
    failures: tuple[Failure, ...] = ()
    """The failed or stopped tasks of running auto jobs, by task id: each is restarted."""
    ranks: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Running auto job -> all its learner-rank tasks (any state): the gang that restarts."""
    gone_ranks: frozenset[str] = frozenset()
    """Running auto jobs one of whose learner ranks sits on a node that went away: a peer
    rank's failure is then that node's doing too (it exits 3 when its peer is stopped)."""


def read_inputs(m: StateMachine) -> Inputs:
    """Convert the machine's records (under its lock) into frozen scheduler inputs."""
    nodes = {n.id: n for n in m.nodes.values()}
    running = {
        j.id: j.spec.get("placement", "auto") for j in m.jobs.values() if j.state == "running"
    }
    live = {nid for nid, n in nodes.items() if n.liveness != "dead"}
    tasks = {
        t.id: _task_info(t, running[t.job_id] == "auto", live)
        for t in sorted(m.tasks.values(), key=lambda t: t.id)
        if t.state in ACTIVE and t.job_id in running
    }
    pending = tuple(t.id for t in tasks.values() if t.auto and t.node not in live)
    held = tuple(t.id for t in tasks.values() if not t.auto and t.node not in live)
    bad = tuple(sorted((j, str(v)) for j, v in running.items() if v not in PLACEMENT_MODES))
    topology = Topology(tuple(_node(nodes[nid]) for nid in sorted(nodes)))
    placements = _reservations(topology, tasks, live)
    hosts = Counter(_host(n.address) for n in nodes.values())
    health = tuple(
        _health(nodes[nid], hosts[_host(nodes[nid].address)] > 1)
        for nid in sorted(live)
        if _has_health(nodes[nid])
    )
    stamp = json.dumps([(nid, nodes[nid].last_heartbeat) for nid in sorted(live)])
    groups = frozenset(
        c.job_id for c in m.checkpoints.values() if c.complete and running.get(c.job_id) == "auto"
    )
    auto = {j for j, mode in running.items() if mode == "auto"}
    failures, ranks, gone_ranks = _failures_and_ranks(m, auto, _gone_nodes(m))
    return Inputs(
        topology,
        placements,
        pending,
        held,
        tasks,
        tuple(h for h in health if h is not None),
        stamp,
        groups,
        bad,
        failures,
        ranks,
        gone_ranks,
    )


def _gone_nodes(m: StateMachine) -> set[str]:
    """Nodes that went away: draining (SIGTERM to its daemon, or an XID/ECC drain) or dead."""
    return {n.id for n in m.nodes.values() if n.draining or n.liveness == "dead"}


def _failures_and_ranks(
    m: StateMachine, auto: set[str], gone: set[str]
) -> tuple[tuple[Failure, ...], dict[str, tuple[str, ...]], frozenset[str]]:
    failures = []
    ranks: dict[str, list[str]] = {}
    gone_ranks: set[str] = set()
    for t in sorted(m.tasks.values(), key=lambda t: t.id):
        if t.job_id not in auto:
            continue
        learner = t.kind == LEARNER_KIND
        node_gone = t.node if t.node is not None and t.node in gone else ""
        if learner:
            ranks.setdefault(t.job_id, []).append(t.id)
            if node_gone:
                gone_ranks.add(t.job_id)
        if t.state in ENDED:
            failures.append(
                Failure(t.id, t.job_id, learner, t.generation, t.message, t.state, node_gone)
            )
    return tuple(failures), {job: tuple(ids) for job, ids in ranks.items()}, frozenset(gone_ranks)


def _task_info(t: RaftTask, auto: bool, live: set[str]) -> TaskInfo:
    """A task whose node died while its incoming copy starts on a live node holds its place
    there: that copy is promoted when it runs, so re-placing the task would only undo it."""
    node, gpus = t.node, t.gpus
    if node not in live and t.incoming is not None and t.incoming.node in live:
        node, gpus = t.incoming.node, t.incoming.gpus
    return TaskInfo(
        t.id,
        t.job_id,
        t.kind == LEARNER_KIND,
        t.generation,
        node,
        float(t.resources.cpus),
        math.ceil(t.resources.memory / MB),
        int(t.resources.gpus),
        auto,
        t.state == "running",
        t.incoming is not None,
        max(t.issued, t.generation) + 1,
        t.due,
        tuple(gpus),
        t.pending_reason,
    )


def _node(n: RaftNode) -> Node:
    gpus = tuple(Gpu(g.index, g.island or f"{n.id}/nvl") for g in n.resources.gpus)
    domains = [g.domain for g in n.resources.gpus if g.domain]
    domain = domains[0] if domains else n.labels.get("domain", "default")
    if n.liveness == "dead":
        state = "dead"
    elif n.draining:
        state = "draining"
    elif n.cordoned or n.liveness == "suspect":
        state = "cordoned"  # a suspect node keeps its tasks but takes no new ones
    else:
        state = "ready"
    return Node(n.id, n.resources.cpus, n.resources.memory // MB, gpus, domain, state)


def _reservations(
    topology: Topology, tasks: dict[str, TaskInfo], live: set[str]
) -> tuple[Placement, ...]:
    """The placements of the tasks on live nodes, with the GPU indices replicated on each task
    (`Task.gpus`), so every leader reserves the same ones. A task that asks for GPUs but has
    none recorded (placed before GPUs were replicated) is counted on the lowest free ones. A
    reservation that no longer fits (a task placed by hand on a full node or on GPUs another
    holds, a node that re-registered smaller) is cut to what is left, so one bad record never
    stops scheduling."""
    out = []
    by_node: dict[str, list[TaskInfo]] = {}
    for t in tasks.values():
        if t.node in live:
            by_node.setdefault(str(t.node), []).append(t)
    for node in topology.nodes:
        mine = by_node.get(node.name, [])
        indices = {g.index for g in node.gpus}
        used: set[int] = set()
        chosen: dict[str, tuple[int, ...]] = {}
        for t in mine:
            if t.gpu_ids:
                chosen[t.id] = tuple(g for g in t.gpu_ids if g in indices and g not in used)
                used.update(chosen[t.id])
        cpus, memory = node.cpus, node.memory_mb
        for t in mine:
            if t.id not in chosen:
                free = sorted(indices - used)[: t.gpus]
                chosen[t.id] = tuple(free)
                used.update(free)
            take_cpus, take_mem = min(t.cpus, max(cpus, 0.0)), min(t.memory_mb, max(memory, 0))
            cpus, memory = cpus - take_cpus, memory - take_mem
            out.append(
                Placement(
                    task=t.id,
                    node=node.name,
                    kind="learner" if t.learner else "rollout",
                    gpus=chosen[t.id],
                    cpus=take_cpus,
                    memory_mb=take_mem,
                    group=t.job if t.learner else "",
                    movable=t.auto and not t.learner and not t.migrating,
                )
            )
    return tuple(out)


def _has_health(n: RaftNode) -> bool:
    return isinstance(n.health.get("summary"), dict)


def _host(address: str) -> str:
    return address.split("://", 1)[-1].rpartition(":")[0] or address


def _health(n: RaftNode, shares_host: bool) -> NodeHealth | None:
    """The node's replicated summary as NodeHealth, or None when it cannot be read (logged).

    CPU and memory fractions are the host's: when several nodes share one host (a local
    cluster), moving a task between them cannot change those, so only their own signals (GPUs,
    errors, latency, clock, env steps) count, or every busy host would look overloaded on all
    its nodes at once."""
    summary = {**n.health["summary"], "node": n.id}
    if shares_host:
        summary.update(cpu=0.0, memory=0.0)
    try:
        return NodeHealth.from_dict(summary)
    except (SchedulerError, TypeError, ValueError) as exc:
        log.warning("ignoring the health of node %s: %s", n.id, exc)
        return None
