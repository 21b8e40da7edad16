"""The chaos fault records: the replicated record of faults asked for through the chaos API.

Chaos is not part of running a cluster, so its bookkeeping lives here, not in the state machine:
raft/machine.py dispatches the `inject_fault` and `report_fault` commands to this module, calls
`fail_faults_of` when a node is declared dead and `heal_kills` when a task runs again, and keeps
the records in its replicated `faults` table (so dumps, snapshots and digests are unchanged).
Replicas only record a fault; the node it names executes it, once, and reports the outcome:
requested -> injected (-> healed) or failed. Deterministic like the machine: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Protocol

from shoal.raft.model import Fault, Job, Node, Task
from shoal.raft.results import Result, ok, refused

FAULT_KINDS = ("task-kill", "task-pause", "node-kill", "gpu-xid", "clock-skew")
TASK_FAULTS = ("task-kill", "task-pause")
HEALED_BY_NODE = ("task-pause", "clock-skew")
"""Faults whose heal only the node can do and report (SIGCONT, the clock made true again)."""
FAULT_STATES = ("requested", "injected", "healed", "failed")
FAULT_FINAL = ("healed", "failed")
DEFAULT_XID = 79
MAX_FAULTS = 1000
"""Faults kept, newest last: the oldest is dropped past this."""
_FAULT_ORDER = {"requested": 0, "injected": 1, "healed": 2, "failed": 2}


class Cluster(Protocol):
    """What the fault records read and write of the state machine: its records, the replicated fault
    table, the node index and the event log."""

    nodes: dict[str, Node]
    jobs: dict[str, Job]
    tasks: dict[str, Task]
    faults: dict[str, Fault]

    def tasks_on(self, node_id: str) -> list[str]: ...

    def append_event(self, at: float, kind: str, message: str, fields: dict[str, Any]) -> None: ...


# -- commands ----------------------------------------------------------------------------------


def inject_fault(m: Cluster, args: dict[str, Any], at: float) -> Result:
    fault_id = args["fault_id"]
    if fault_id in m.faults:
        return refused("conflict", f"fault {fault_id!r} exists; pick another id", "fault_id")
    kind, target = args["kind"], args["target"]
    if kind in TASK_FAULTS:
        where = _fault_task(m, target)
    else:
        where = _fault_node(m, target, args.get("gpu") if kind == "gpu-xid" else None)
    if "ok" in where:
        return where
    fault = Fault(
        fault_id,
        kind,
        target,
        where["node"],
        at,
        float(args.get("duration_s", 0.0)),
        where.get("generation", 0),
        args.get("gpu"),
        args.get("xid", DEFAULT_XID) if kind == "gpu-xid" else None,
        args.get("offset_s"),
        updated_at=at,
        tasks=_stopped_by(m, kind, where),
    )
    m.faults[fault_id] = fault
    while len(m.faults) > MAX_FAULTS:
        del m.faults[next(iter(m.faults))]
    _fault_event(m, at, fault, f"{kind} of {target} on node {fault.node} requested")
    return ok(fault=asdict(fault))


def report_fault(m: Cluster, args: dict[str, Any], at: float) -> Result:
    """A node's outcome. States only move forward; the same state again is a no-op, so a
    node that re-sends a report it is unsure was applied changes nothing."""
    fault = m.faults.get(args["fault_id"])
    if fault is None:
        return refused("not_found", f"no fault {args['fault_id']!r}", "fault_id")
    state = args["state"]
    if state == fault.state:
        return ok(fault=asdict(fault), changed=False)
    if fault.state in FAULT_FINAL or _FAULT_ORDER[state] < _FAULT_ORDER[fault.state]:
        return refused(
            "conflict", f"fault {fault.id!r} is already {fault.state}, not {state}", "state"
        )
    fault.state, fault.message, fault.updated_at = state, args.get("message", ""), at
    if state == "injected":
        fault.injected_at = at
    elif state == "healed" and fault.injected_at is not None:
        fault.recovery_s = at - fault.injected_at
    _fault_event(m, at, fault, f"{state}: {fault.message}" if fault.message else state)
    if state == "injected":
        heal_kills(m, at)
    return ok(fault=asdict(fault), changed=True)


# -- what the machine calls on other changes ------------------------------------------------------


def fail_faults_of(m: Cluster, node_id: str, at: float) -> None:
    """A node declared dead never executes what it was sent: those faults fail now, rather
    than fire late when the node comes back. A node-kill is left alone, since its node
    dying is the fault (its report may come when the node is back). A pause or skew in
    effect fails too: only the node could heal it and report so, and a heal reported after
    the node returns would time the node's outage, not the fault."""
    for fault in faults_for(m, node_id):
        if fault.kind != "node-kill":
            _fail_fault(m, fault, at, "was declared dead before it executed the fault")
    for fault in m.faults.values():
        if fault.node == node_id and fault.state == "injected" and fault.kind in HEALED_BY_NODE:
            _fail_fault(m, fault, at, "was declared dead while the fault was in effect")


def heal_kills(m: Cluster, at: float) -> None:
    """Mark healed each injected kill whose tasks all run again at a later generation (or
    whose jobs ended): called whenever a task reports running, and on an injected report."""
    for fault in m.faults.values():
        if fault.state != "injected" or not fault.tasks or fault.injected_at is None:
            continue
        if all(_recovered(m, t, g) for t, g in fault.tasks.items()):
            fault.state, fault.updated_at = "healed", at
            fault.recovery_s = at - fault.injected_at
            fault.message = (
                f"{len(fault.tasks)} task(s) running again {fault.recovery_s:.2f} s after "
                "the fault was injected"
            )
            _fault_event(m, at, fault, f"healed: {fault.message}")


def faults_for(m: Cluster, node_id: str) -> list[Fault]:
    """The faults `node_id` has yet to execute (still `requested`), oldest first."""
    return [f for f in m.faults.values() if f.node == node_id and f.state == "requested"]


# -- helpers -------------------------------------------------------------------------------------


def _fault_task(m: Cluster, task_id: str) -> dict[str, Any]:
    """The node and generation of the task a fault targets, or the refusal."""
    task = m.tasks.get(task_id)
    if task is None:
        return refused("not_found", f"no task {task_id!r}; see GET /v1/tasks", "target")
    if task.node is None or task.state not in ("pending", "running"):
        return refused(
            "conflict",
            f"task {task_id!r} is {task.state} on no node: nothing runs to fault",
            "target",
        )
    return {"node": task.node, "generation": task.generation, "target": task_id}


def _stopped_by(m: Cluster, kind: str, where: dict[str, Any]) -> dict[str, int]:
    """The tasks a kill stops, with their generations: the task itself, or the current
    copies of the active tasks on the node."""
    if kind == "task-kill":
        return {where["target"]: where["generation"]}
    if kind != "node-kill":
        return {}
    on = [m.tasks[t] for t in m.tasks_on(where["node"])]
    return {
        t.id: t.generation
        for t in on
        if t.node == where["node"] and t.state in ("pending", "running")
    }


def _fault_node(m: Cluster, node_id: str, gpu: int | None) -> dict[str, Any]:
    node = m.nodes.get(node_id)
    if node is None:
        return refused("not_found", f"no node {node_id!r}; see GET /v1/nodes", "target")
    if node.liveness == "dead":
        return refused("conflict", f"node {node_id!r} is dead: nothing runs to fault", "target")
    count = len(node.resources.gpus)
    if gpu is not None and gpu >= count:
        have = f"GPUs 0..{count - 1}" if count else "no GPUs"
        return refused("conflict", f"node {node_id!r} registered {have}, not GPU {gpu}", "gpu")
    return {"node": node_id}


def _fail_fault(m: Cluster, fault: Fault, at: float, why: str) -> None:
    fault.state, fault.updated_at = "failed", at
    fault.message = f"node {fault.node} {why}"
    _fault_event(m, at, fault, f"failed: {fault.message}")


def _recovered(m: Cluster, task_id: str, generation: int) -> bool:
    task = m.tasks.get(task_id)
    if task is None or m.jobs[task.job_id].state != "running":
        return True
    return task.generation > generation and task.state == "running"


def _fault_event(m: Cluster, at: float, fault: Fault, message: str) -> None:
    fields = {
        "fault": fault.id,
        "fault_kind": fault.kind,
        "target": fault.target,
        "node": fault.node,
        "state": fault.state,
    }
    m.append_event(at, "chaos_fault", f"fault {fault.id}: {message}", fields)
