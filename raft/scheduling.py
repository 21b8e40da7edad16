"""The leader's scheduler loop: replicated state in, replicated commands out.

Each round reads the state machine into the scheduler's plain inputs (`read_inputs`, pure),
decides (`decide`, pure: same inputs and memory, same commands) and commits the commands in one
batch through the same write path the API uses. What it decides:
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
import hashlib
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from shoal.raft.context import ApiContext
from shoal.raft.errors import RaftError
from shoal.raft.machine import StateMachine
from shoal.raft.model import LEARNER_KIND
from shoal.raft.model import Node as RaftNode
from shoal.raft.model import Task as RaftTask
from shoal.scheduler.balancer import balance
from shoal.scheduler.errors import SchedulerError
from shoal.scheduler.model import (
    BalancerState,
    Gpu,
    LearnerGroup,
    Migration,
    Node,
    NodeHealth,
    Placement,
    RolloutActor,
)
from shoal.scheduler.placement import place
from shoal.scheduler.signals import BalancerConfig
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
BATCH_SIZE = 256
"""Commands per committed batch: a placement event is under 1 KB, the limit is 1 MiB."""


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


@dataclass
class Memory:
    """What the leader remembers between rounds (lost on failover, by design)."""

    balancer: BalancerState = field(default_factory=BalancerState)
    said: dict[tuple[str, str, str], str] = field(default_factory=dict)
    """(what, node or job, task) of a repeating decision (bad mode, hold, stuck) -> the reason
    last posted. A refused placement needs none: its reason is replicated on the task."""
    health_stamp: str = ""
    """The health batch the balancer last ran on: it runs once per batch (once per report)."""
    applied: int = -1
    """The state's applied-command count at the last round: an unchanged state is not re-read
    (the conversion holds the state's lock), since only a change or `wake` can alter a decision."""
    wake: float = 0.0
    """The earliest time a restarted task waiting out its back-off becomes due (0: none waits):
    the round re-reads the state then even if nothing changed."""


@dataclass(frozen=True)
class Command:
    """One replicated command; an event naming `needs` (the op id of the placement or drain it
    explains) is posted only if that command was applied."""

    op: str
    args: dict[str, Any]
    op_id: str
    needs: str = ""


@dataclass(frozen=True)
class Round:
    """One round's commands, in order; the memory they leave is in `Memory` (updated in place)."""

    commands: tuple[Command, ...]


def op_id(*parts: object) -> str:
    """A deterministic operation id for a decision, so a repeated decision is applied once."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return "sched-" + hashlib.sha256(text.encode()).hexdigest()[:40]


# -- state -> scheduler inputs -----------------------------------------------------------------


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


# -- decisions -----------------------------------------------------------------------------------


def decide(inputs: Inputs, memory: Memory, now: float, config: BalancerConfig) -> Round:
    """One round: restart what failed or stopped, place what is pending and due, else balance
    on a new health batch. Updates `memory` (including when to wake for the next due task)."""
    restarts, restarting = _restarts(inputs)
    waiting = [inputs.tasks[t].due for t in inputs.pending if inputs.tasks[t].due > now]
    memory.wake = min(waiting, default=0.0)
    placed = _place_pending(inputs, restarting, now)
    commands = _bad_modes(inputs, memory) + restarts + placed
    if not commands and inputs.health_stamp != memory.health_stamp:
        memory.health_stamp = inputs.health_stamp
        commands = _balance(inputs, memory, now, config)
    return Round(tuple(commands))


def _bad_modes(inputs: Inputs, memory: Memory) -> list[Command]:
    out = []
    for job, mode in inputs.bad_modes:
        reason = (
            f"job {job}: spec.placement={mode!r} is neither 'auto' nor 'manual'; its tasks are "
            "left where they are: resubmit with 'auto' (the scheduler places them) or 'manual'"
        )
        if memory.said.get(("mode", job, "")) != reason:
            memory.said[("mode", job, "")] = reason
            out.append(_event("refused", reason, ("mode", job, mode), {"job": job}))
    return out


def _restarts(inputs: Inputs) -> tuple[list[Command], set[str]]:
    """Restart each task that failed or stopped while its job runs; a learner rank that ended,
    or one whose node died while the rest of its group runs, restarts its whole group (once
    per job per round: one failure usually takes the peers down too). A restart is counted
    toward the job's intensity unless its node went away (drained or dead). Also returns the
    jobs whose group restarts, which the round does not place until the restart is applied."""
    commands = []
    ranks_failed: dict[str, list[Failure]] = {}
    for f in inputs.failures:
        if f.learner:
            ranks_failed.setdefault(f.job, []).append(f)
            continue
        reason = _why(f)
        commands.append(_restart(f.job, f.id, f.generation, (f.id,), reason, not f.gone))
    for job, failed in ranks_failed.items():
        # Which rank failed first is not recorded (a peer's death fails the others' next
        # collective): every failed rank is named, the first by id is the cause.
        why = "; ".join(_why(f) for f in failed)
        reason = f"{why} (its learner group of {len(inputs.ranks[job])} restarts as one)"
        first = failed[0]
        counted = job not in inputs.gone_ranks
        commands.append(
            _restart(job, first.id, first.generation, inputs.ranks[job], reason, counted)
        )
    gangs = set(ranks_failed)
    for task_id in inputs.pending:
        t = inputs.tasks[task_id]
        if not t.learner or t.node is None or t.job in gangs:
            continue
        if all(r in inputs.pending for r in inputs.ranks[t.job] if r in inputs.tasks):
            continue  # the whole group needs a place: it is gang-placed as it is
        gangs.add(t.job)
        reason = (
            f"learner rank {t.id} was on dead node {t.node}; its group of "
            f"{len(inputs.ranks[t.job])} restarts as one"
        )
        commands.append(_restart(t.job, t.id, t.generation, inputs.ranks[t.job], reason, False))
    return commands, gangs


def _why(f: Failure) -> str:
    why = f"task {f.id} {f.state}: {f.message or 'no reason given'}"
    if f.gone:
        why += f" (its node {f.gone} went away: drained or dead)"
    elif f.state == "stopped":
        why += " (it ended on its own while its job runs)"
    return why


def _restart(
    job: str, cause: str, generation: int, tasks: Iterable[str], reason: str, counted: bool
) -> Command:
    args = {
        "job_id": job,
        "cause": cause,
        "generation": generation,
        "tasks": list(tasks),
        "reason": reason[:4096],
        "counted": counted,
    }
    return Command("restart_tasks", args, op_id("restart", cause, generation))


def _requests(
    inputs: Inputs, skip: set[str], now: float
) -> tuple[list[LearnerGroup], list[RolloutActor], dict[str, str]]:
    """Pending tasks that are due at `now` (but the learner ranks of jobs in `skip`) as
    placement requests; also the request name -> task id map."""
    names: dict[str, str] = {}
    ranks: dict[str, list[TaskInfo]] = {}
    actors = []
    for task_id in inputs.pending:
        t = inputs.tasks[task_id]
        if (t.learner and t.job in skip) or t.due > now:
            continue
        if t.learner:
            ranks.setdefault(t.job, []).append(t)
        else:
            actors.append(RolloutActor(t.id, t.cpus, t.memory_mb, t.gpus))
            names[t.id] = t.id
    groups = []
    for job, members in sorted(ranks.items()):
        group = LearnerGroup(
            job,
            len(members),
            max(t.gpus for t in members),
            max(t.cpus for t in members),
            max(t.memory_mb for t in members),
        )
        groups.append(group)
        for r, t in enumerate(members):
            names[group.rank_task(r)] = t.id
    return groups, actors, names


def _place_pending(inputs: Inputs, skip: set[str], now: float) -> list[Command]:
    groups, actors, names = _requests(inputs, skip, now)
    if not groups and not actors:
        return []
    plan = place(inputs.topology, inputs.placements, groups, actors)
    commands: list[Command] = []
    by_group: dict[str, list[Placement]] = {}
    for p in plan.placements:
        by_group.setdefault(f"group:{p.group}" if p.group else f"actor:{p.task}", []).append(p)
    islands = {(n.name, g.index): g.island for n in inputs.topology.nodes for g in n.gpus}
    domains = {n.name: n.domain for n in inputs.topology.nodes}
    for members in by_group.values():
        tasks = [inputs.tasks[names[p.task]] for p in members]
        placements = [_placement(t.id, p.node, p.gpus) for t, p in zip(tasks, members)]
        place_id = op_id([(t.id, t.generation, p.node, p.gpus) for t, p in zip(tasks, members)])
        commands.append(Command("place_tasks", {"placements": placements}, place_id))
        where = _where(members, islands, domains)
        for t, p in zip(tasks, members):
            kind, reason = _placement_reason(t, p, where)
            fields = {"task": t.id, "job": t.job, "node": p.node, "generation": t.generation + 1}
            commands.append(_event(kind, reason, (kind, t.id, t.generation), fields, place_id))
    for refusal in plan.refused:
        members_ids = [task_id for n, task_id in names.items() if _rank_of(n, refusal.task)]
        for task_id in members_ids or [names.get(refusal.task, refusal.task)]:
            commands += _refuse(inputs.tasks[task_id], refusal.reason)
    return commands


def _placement(task_id: str, node: str, gpus: tuple[int, ...]) -> dict[str, Any]:
    return {"task_id": task_id, "node_id": node, "gpus": list(gpus)}


def _refuse(t: TaskInfo, reason: str) -> list[Command]:
    """Record why `t` stays pending on the task (the machine posts the `refused` event), unless
    that is already its reason: a refusal repeated every round writes nothing."""
    reason = reason[:4096]
    if t.pending_reason == reason:
        return []
    args = {"task_id": t.id, "generation": t.generation, "reason": reason}
    key = op_id("refused", t.id, t.generation, t.pending_reason, reason)
    return [Command("set_pending_reason", args, key)]


def _rank_of(name: str, group: str) -> bool:
    return name.startswith(f"{group}/rank") and name[len(group) + 5 :].isdigit()


def _where(
    members: list[Placement], islands: dict[tuple[str, int], str], domains: dict[str, str]
) -> str:
    if members[0].kind != "learner":
        return ""
    used = {islands[(p.node, g)] for p in members for g in p.gpus}
    if len(used) == 1:
        return f"gang-placed on NVLink island {used.pop()}"
    doms = {domains[p.node] for p in members}
    why = "no single NVLink island had room; " if used else ""
    return f"gang-placed in RDMA domain {doms.pop()} ({why}{len(members)} ranks)"


def _placement_reason(t: TaskInfo, p: Placement, where: str) -> tuple[str, str]:
    what = (
        f"learner rank {t.id} of job {t.job}: {where}"
        if t.learner
        else f"rollout actor {t.id} spread to the least loaded ready node"
    )
    if t.node is not None:
        return "replace", f"{t.id} was on dead node {t.node}; re-placed on {p.node} ({what})"
    return "placement", f"{t.id} -> {p.node} ({what})"


def _event(
    kind: str, message: str, key: Iterable[object], fields: dict[str, Any], needs: str = ""
) -> Command:
    args = {"kind": kind, "message": message[:4096], "fields": {**fields, "reason": message}}
    return Command("add_event", args, op_id("event", *key), needs)


def _balance(inputs: Inputs, memory: Memory, now: float, config: BalancerConfig) -> list[Command]:
    if not inputs.health:
        return []
    plan = balance(
        inputs.topology,
        inputs.placements,
        inputs.health,
        memory.balancer,
        now,
        config,
        inputs.checkpoint_groups,
    )
    memory.balancer = plan.state
    commands: list[Command] = []
    stamp = inputs.health_stamp
    for d in plan.decisions:
        if d.action == "drain":
            drain_id = op_id(d, stamp)
            commands.append(
                Command("set_draining", {"node_id": d.node, "draining": True}, drain_id)
            )
            commands.append(_event("cordon", d.reason, (d, stamp), {"node": d.node}, drain_id))
            continue
        key = (d.action, d.node, d.task)
        if d.action in ("hold", "stuck"):
            if memory.said.get(key) == d.reason:
                continue
            memory.said[key] = d.reason
        fields = {"node": d.node, "task": d.task, "action": d.action}
        commands.append(_event("balance", d.reason, (d, stamp), fields))
    gangs: dict[str, list[Migration]] = {}
    for mig in plan.migrations:
        t = inputs.tasks[mig.task]
        if t.learner:
            gangs.setdefault(t.job, []).append(mig)
            continue
        move_id, move = _move(t, mig.target, mig.gpus)
        commands.append(move)
        fields = {"task": mig.task, "source": mig.source, "target": mig.target}
        event_key = ("migration", mig.task, t.generation)
        commands.append(_event("migration", mig.reason, event_key, fields, move_id))
    for job, migs in gangs.items():
        commands += _move_group(inputs, job, migs)
    return commands


def _move_group(inputs: Inputs, job: str, migs: list[Migration]) -> list[Command]:
    """Learner ranks move only as their whole group: the moved ranks go to their targets and
    the others are placed again where they are, all at new generations in one command, so
    the group restarts as one from its checkpoint (a lone rank cannot rejoin a group)."""
    targets = {m.task: m for m in migs}
    where = {p.task: p for p in inputs.placements}
    members = [r for r in inputs.ranks.get(job, ()) if r in targets or r in where]
    placements = []
    for r in members:
        node = targets[r].target if r in targets else where[r].node
        gpus = targets[r].gpus if r in targets else where[r].gpus
        placements.append(_placement(r, node, gpus))
    key = [
        (r, inputs.tasks[r].generation, p["node_id"], p["gpus"])
        for r, p in zip(members, placements)
    ]
    move_id = op_id(key)
    commands = [Command("place_tasks", {"placements": placements}, move_id)]
    for m in migs:
        fields = {"task": m.task, "source": m.source, "target": m.target}
        key_m = ("migration", m.task, inputs.tasks[m.task].generation)
        commands.append(_event("migration", m.reason, key_m, fields, move_id))
    reason = (
        f"job {job}: learner rank(s) {', '.join(sorted(targets))} moved; its group of "
        f"{len(members)} restarts as one from its checkpoint"
    )
    restart_fields: dict[str, Any] = {"job": job, "tasks": members, "counted": False}
    commands.append(_event("restart", reason, ("restart", *key), restart_fields, move_id))
    return commands


def _move(t: TaskInfo, target: str, gpus: tuple[int, ...]) -> tuple[str, Command]:
    """A running rollout actor moves make-before-break (an incoming copy starts on `target`
    and the current one stops once it runs); a learner rank, or a task not yet running, is
    re-placed outright (a rank only moves at a checkpoint boundary, so it resumes from it)."""
    if t.running and not t.learner:
        move_id = op_id("migrate", t.id, t.next_generation, target, gpus)
        args = {"task_id": t.id, "node_id": target, "gpus": list(gpus)}
        return move_id, Command("migrate_task", args, move_id)
    move_id = op_id(t.id, t.generation, target, gpus)
    placements = [_placement(t.id, target, gpus)]
    return move_id, Command("place_tasks", {"placements": placements}, move_id)


# -- the loop ------------------------------------------------------------------------------------


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
