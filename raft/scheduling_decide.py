"""The scheduler's pure decision: inputs and the leader's memory in, replicated commands out.

`decide` does no I/O and reads no clock (`now` is given): the same `Inputs` and `Memory` give
the same commands, so a new leader that decides again proposes the same operation ids and each
is applied once. What it decides is listed in `scheduling.py`, the loop that runs it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from shoal.raft.scheduling_inputs import Failure, Inputs, TaskInfo
from shoal.scheduler.balancer import balance
from shoal.scheduler.model import (
    BalancerState,
    LearnerGroup,
    Migration,
    Placement,
    RolloutActor,
)
from shoal.scheduler.placement import place
from shoal.scheduler.signals import BalancerConfig


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
