"""The pure cluster state machine: `apply(command)` is the only writer, and it is deterministic.

No clock, randomness or I/O: every time and id arrives inside the command. `apply` never raises
on a command that passed `validate_command`; a refusal that depends on the state (unknown id,
duplicate id, stale generation) is returned as a result, the same on every replica.

An operation id names ONE command: the machine keeps, beside each applied op id, a digest of
the command it carried (its op and canonical arguments, not its time stamp). The same id with
the same command returns the first result again without a second effect (a retry); the same id
with another command is refused as a conflict, so that write is never silently dropped.
Not thread-safe: ClusterState serialises access.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from shoal.raft import fault_records
from shoal.raft.model import (
    Checkpoint,
    Event,
    Fault,
    Gpu,
    Job,
    LeaderRecord,
    Node,
    Resources,
    Task,
    TaskResources,
)
from shoal.raft.results import Result, ok, refused
from shoal.raft.task_copies import TaskCopies

MAX_EVENTS = 5000
MAX_APPLIED_OPS = 20_000
OP_ID_REUSED = (
    "operation id {op_id!r} was already used for a different command ({first}); an operation "
    "id names one command and its retries: send this write with a fresh X-Shoal-Op-Id"
)
OP_ID_UNBOUND = (
    "operation id {op_id!r} was applied before this coordinator recorded which command each "
    "id carried, so a retry cannot be told from a new write: send it with a fresh "
    "X-Shoal-Op-Id (read the state first if the first attempt may have been applied)"
)


class StateMachine(TaskCopies):
    """Nodes, jobs, tasks, checkpoints, events and the table of applied operation ids."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.jobs: dict[str, Job] = {}
        self.tasks: dict[str, Task] = {}
        self.checkpoints: dict[tuple[str, str], Checkpoint] = {}
        self.events: deque[Event] = deque(maxlen=MAX_EVENTS)
        self.event_seq = 0
        self.leader: LeaderRecord | None = None
        self.applied: OrderedDict[str, Result] = OrderedDict()
        self.op_commands: dict[str, str] = {}
        """op id -> `op:digest` of the command it carried (see `command_digest`), for the ids in
        `applied`. Left out of the state digest: it decides only the answer to a reused id, never
        an effect, so a replica restored from a dump older than this table still agrees."""
        self.applied_count = 0
        self.faults: dict[str, Fault] = {}
        """Chaos faults by id, oldest first (raft/fault_records.py keeps and bounds them)."""
        # Derived index node -> task ids (an ordered set), kept so a heartbeat need not scan
        # every task; it is rebuilt from nothing but placements (current and incoming copies)
        # and left out of the digest.
        self._by_node: dict[str, dict[str, None]] = {}
        # Derived index job -> ids of its tasks whose current copy published something, so a
        # heartbeat lists a job's peers without scanning its tasks; left out of the digest.
        self._published: dict[str, dict[str, None]] = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled from a pysyncobj dump, perhaps one an older shoal wrote: attributes it
        lacks start empty, and the node index, derived, is rebuilt when it is missing."""
        self.__dict__.update({**StateMachine().__dict__, **state})
        if "_by_node" not in state:
            for task in self.tasks.values():
                self._index(task.id, task.node)
                if task.incoming is not None:
                    self._index(task.id, task.incoming.node)
        if "_published" not in state:
            for task in self.tasks.values():
                if task.published:
                    self._published.setdefault(task.job_id, {})[task.id] = None

    # -- the one writer -------------------------------------------------------------------

    def apply(self, command: dict[str, Any]) -> Result:
        if command["op"] != "batch":
            return self._apply_once(command, command_digest(command["op"], command["args"]))
        members = [(m, command_digest(m["op"], m["args"])) for m in command["args"]["commands"]]
        digest = batch_digest([(m["op_id"], d) for m, d in members])
        seen = self._seen(command["op_id"], digest)
        if seen is not None:
            return seen
        results = [self._apply_once(member, member_digest) for member, member_digest in members]
        return self._record(command["op_id"], digest, ok(results=results))

    def _apply_once(self, command: dict[str, Any], digest: str) -> Result:
        seen = self._seen(command["op_id"], digest)
        if seen is not None:
            return seen
        result = _HANDLERS[command["op"]](self, command["args"], command["at"])
        return self._record(command["op_id"], digest, result)

    def _seen(self, op_id: str, digest: str) -> Result | None:
        """The first result when `op_id` was applied with this same command, a conflict when
        with another one, None when the id is new."""
        if op_id not in self.applied:
            return None
        first = self.op_commands.get(op_id)
        if first == digest:
            return self.applied[op_id]
        if first is None:
            return refused("conflict", OP_ID_UNBOUND.format(op_id=op_id), "op_id")
        what = first.partition(":")[0]
        return refused("conflict", OP_ID_REUSED.format(op_id=op_id, first=what), "op_id")

    def _record(self, op_id: str, digest: str, result: Result) -> Result:
        self.applied[op_id] = result
        self.op_commands[op_id] = digest
        self.applied_count += 1
        while len(self.applied) > MAX_APPLIED_OPS:
            old, _ = self.applied.popitem(last=False)
            self.op_commands.pop(old, None)
        return result

    def _event(self, at: float, kind: str, message: str, **fields: Any) -> None:
        self.append_event(at, kind, message, fields)

    def append_event(self, at: float, kind: str, message: str, fields: dict[str, Any]) -> None:
        self.event_seq += 1
        self.events.append(Event(self.event_seq, at, kind, message, fields))

    def _task_ran(self, at: float) -> None:
        fault_records.heal_kills(self, at)

    # -- nodes ------------------------------------------------------------------------------

    def _register_node(self, args: dict[str, Any], at: float) -> Result:
        res = args["resources"]
        gpus = [
            Gpu(g["index"], g["uuid"], g.get("island", ""), g.get("domain", ""))
            for g in res.get("gpus", [])
        ]
        resources = Resources(float(res["cpus"]), res["memory"], gpus)
        node_id = args["node_id"]
        node = self.nodes.get(node_id)
        if node is None:
            node = Node(node_id, args["address"], resources, dict(args.get("labels", {})), at)
            self.nodes[node_id] = node
        else:
            node.address, node.resources = args["address"], resources
            node.labels = dict(args.get("labels", {}))
        node.liveness, node.last_heartbeat = "alive", at
        self._event(at, "node_registered", f"node {node_id} registered", node=node_id)
        return ok(node=asdict(node))

    def _set_liveness(self, args: dict[str, Any], at: float) -> Result:
        changed = []
        for change in args["changes"]:
            node = self.nodes.get(change["node_id"])
            if node is None or node.liveness == change["liveness"]:
                continue
            old, node.liveness = node.liveness, change["liveness"]
            changed.append(node.id)
            self._event(
                at,
                "node_liveness",
                f"node {node.id} {old} -> {node.liveness}",
                node=node.id,
                old=old,
                new=node.liveness,
            )
            if node.liveness == "dead":
                self._abandon_on(node.id, at)
                fault_records.fail_faults_of(self, node.id, at)
        return ok(changed=changed)

    def _abandon_on(self, node_id: str, at: float) -> None:
        """Drop the incoming copies on a dead node: their tasks' current copies keep running."""
        for task_id in list(self._by_node.get(node_id, ())):
            task = self.tasks[task_id]
            if task.incoming is not None and task.incoming.node == node_id:
                self._abandon(task, task.incoming, at, f"node {node_id} is dead")

    def _report_health(self, args: dict[str, Any], at: float) -> Result:
        unknown = []
        for report in args["reports"]:
            node = self.nodes.get(report["node_id"])
            if node is None:
                unknown.append(report["node_id"])
                continue
            node.health = report["health"]
            node.last_heartbeat = report.get("last_heartbeat", at)
        return ok(unknown=unknown)

    def _node_flag(self, args: dict[str, Any], at: float, flag: str) -> Result:
        node = self.nodes.get(args["node_id"])
        if node is None:
            return refused("not_found", f"no node {args['node_id']!r}", "node_id")
        value = args[flag]
        setattr(node, flag, value)
        if flag == "draining" and value:
            node.cordoned = True
        self._event(at, f"node_{flag}", f"node {node.id} {flag}={value}", node=node.id, value=value)
        return ok(node=asdict(node))

    def _set_cordon(self, args: dict[str, Any], at: float) -> Result:
        if not args["cordoned"]:
            node = self.nodes.get(args["node_id"])
            if node is not None:
                node.draining = False
        return self._node_flag(args, at, "cordoned")

    def _set_draining(self, args: dict[str, Any], at: float) -> Result:
        return self._node_flag(args, at, "draining")

    # -- jobs and tasks ---------------------------------------------------------------------

    def _new_tasks(self, job: Job, specs: list[dict[str, Any]]) -> Result | None:
        for i, spec in enumerate(specs):
            if spec["task_id"] in self.tasks:
                return refused(
                    "conflict", f"task {spec['task_id']!r} exists", f"tasks[{i}].task_id"
                )
        for spec in specs:
            res = spec.get("resources", {})
            task = Task(
                spec["task_id"],
                job.id,
                spec["kind"],
                spec["actor"],
                dict(spec.get("args", {})),
                TaskResources(
                    float(res.get("cpus", 0.0)), res.get("memory", 0), res.get("gpus", 0)
                ),
            )
            self.tasks[task.id] = task
        return None

    def _submit_job(self, args: dict[str, Any], at: float) -> Result:
        job_id = args["job_id"]
        if job_id in self.jobs:
            return refused("conflict", f"job {job_id!r} exists; pick another id", "job_id")
        job = Job(job_id, dict(args.get("spec", {})), at)
        refusal = self._new_tasks(job, args.get("tasks", []))
        if refusal is not None:
            return refusal
        self.jobs[job_id] = job
        self._event(at, "job_submitted", f"job {job_id} submitted", job=job_id)
        return ok(job=asdict(job))

    def _add_tasks(self, args: dict[str, Any], at: float) -> Result:
        job = self.jobs.get(args["job_id"])
        if job is None:
            return refused("not_found", f"no job {args['job_id']!r}", "job_id")
        if job.state != "running":
            return refused("conflict", f"job {job.id!r} is {job.state}", "job_id")
        refusal = self._new_tasks(job, args["tasks"])
        return refusal or ok(task_ids=[spec["task_id"] for spec in args["tasks"]])

    def _stop_job(self, args: dict[str, Any], at: float) -> Result:
        job = self.jobs.get(args["job_id"])
        if job is None:
            return refused("not_found", f"no job {args['job_id']!r}", "job_id")
        if job.state == "running":
            job.state, job.stopped_at = "stopped", at
            self._end_tasks(job, at, f"job {job.id} stopped")
            self._event(at, "job_stopped", f"job {job.id} stopped", job=job.id)
        return ok(job=asdict(job))

    def _end_tasks(self, job: Job, at: float, why: str) -> None:
        """Mark a job's active tasks stopped (their nodes stop them) and drop incoming copies."""
        for task in self.tasks.values():
            if task.job_id == job.id and task.state in ("pending", "running"):
                task.state, task.pending_reason = "stopped", ""
            if task.job_id == job.id and task.incoming is not None:
                self._abandon(task, task.incoming, at, why)

    def _restart_tasks(self, args: dict[str, Any], at: float) -> Result:
        """Start tasks of a running job again after `cause` ended at `generation`: each becomes
        pending with no node and a new generation (its node stops the old incarnation; the
        scheduler places it again, a learner group as one gang, once its `due` time passed).
        A counted restart past the job's `spec.restart` intensity fails the job instead; one
        within it is due after the job's back-off (`Job.backoff`), from the command's time."""
        job = self.jobs.get(args["job_id"])
        if job is None:
            return refused("not_found", f"no job {args['job_id']!r}", "job_id")
        if job.state != "running":
            return refused("conflict", f"job {job.id!r} is {job.state}: nothing restarts", "job_id")
        ids = list(dict.fromkeys(args["tasks"]))
        for i, task_id in enumerate(ids):
            task = self.tasks.get(task_id)
            if task is None or task.job_id != job.id:
                return refused(
                    "not_found", f"job {job.id!r} has no task {task_id!r}", f"tasks[{i}]"
                )
        cause = self.tasks[args["cause"]]
        if cause.generation != args["generation"]:
            return refused(
                "conflict",
                f"stale restart: task {cause.id!r} is at generation {cause.generation}, "
                f"not {args['generation']}",
                "generation",
            )
        delay = 0.0
        if args["counted"]:
            limit, window = job.restart_policy()
            job.restart_times = [t for t in job.restart_times if t > at - window]
            if len(job.restart_times) >= limit:
                return self._fail_job(
                    job, at, f"{args['reason']}; gave up after {limit} restarts in {window:g} s"
                )
            delay = job.backoff(len(job.restart_times))
            job.restart_times.append(at)
        job.restarts += 1
        for task_id in ids:
            self._unplace(self.tasks[task_id], at, args["reason"])
            self.tasks[task_id].due = at + delay
        # The count stays last: readers (and tests) take it as the message's last "; " part.
        wait = f"placed again after a {delay:g} s back-off; " if delay else ""
        self._event(
            at,
            "restart",
            f"job {job.id}: {args['reason']}; {wait}{self._restart_count(job, args['counted'])}",
            job=job.id,
            cause=cause.id,
            tasks=ids,
            counted=args["counted"],
            restarts=job.restarts,
            due=at + delay,
        )
        return ok(job=asdict(job), tasks=ids)

    @staticmethod
    def _restart_count(job: Job, counted: bool) -> str:
        limit, window = job.restart_policy()
        if not counted:
            return f"restart (not counted toward the limit of {limit} in {window:g} s)"
        return f"restart {len(job.restart_times)} of {limit} in {window:g} s"

    def _unplace(self, task: Task, at: float, why: str) -> None:
        if task.incoming is not None:
            self._abandon(task, task.incoming, at, f"the task restarts: {why}")
        self._unindex(task.id, task.node)
        task.node, task.state, task.message = None, "pending", f"restarting: {why}"
        self._renew(task, self._next_generation(task), [])
        task.restarts += 1

    def _fail_job(self, job: Job, at: float, message: str) -> Result:
        job.state, job.stopped_at, job.message = "failed", at, message
        self._end_tasks(job, at, f"job {job.id} failed")
        self._event(at, "job_failed", f"job {job.id} failed: {message}", job=job.id)
        return ok(job=asdict(job), failed=True)

    # -- checkpoints, events, leadership ------------------------------------------------------

    def _record_checkpoint(self, args: dict[str, Any], at: float) -> Result:
        if args["job_id"] not in self.jobs:
            return refused("not_found", f"no job {args['job_id']!r}", "job_id")
        key = (args["job_id"], args["path"])
        old = self.checkpoints.get(key)
        if old is not None and old.complete and not args["complete"]:
            return refused("conflict", "a complete checkpoint cannot become incomplete", "complete")
        cp = Checkpoint(
            args["job_id"], args["path"], args["step"], args["sha256"], args["complete"], at
        )
        self.checkpoints[key] = cp
        self._event(
            at, "checkpoint", f"checkpoint {cp.path} step {cp.step}", job=cp.job_id, step=cp.step
        )
        return ok(checkpoint=asdict(cp))

    def _add_event(self, args: dict[str, Any], at: float) -> Result:
        self.append_event(at, args["kind"], args["message"], dict(args.get("fields", {})))
        return ok(seq=self.event_seq)

    def _announce_leader(self, args: dict[str, Any], at: float) -> Result:
        if self.leader is not None and args["term"] < self.leader.term:
            return refused(
                "conflict", f"term {args['term']} is older than {self.leader.term}", "term"
            )
        self.leader = LeaderRecord(args["replica_id"], args["raft"], args["api"], args["term"], at)
        self._event(
            at,
            "leader",
            f"{args['replica_id']} leads term {args['term']}",
            replica=args["replica_id"],
        )
        return ok()

    def _barrier(self, args: dict[str, Any], at: float) -> Result:
        return ok(applied=self.applied_count)

    # -- reads ----------------------------------------------------------------------------------

    def faults_for(self, node_id: str) -> list[Fault]:
        """The faults `node_id` has yet to execute (still `requested`), oldest first."""
        return fault_records.faults_for(self, node_id)

    def assignments(self) -> dict[str, list[str]]:
        """node id -> ids of the tasks placed there (derived from the placements)."""
        return {node_id: self.tasks_on(node_id) for node_id in self.nodes}

    def tasks_on(self, node_id: str) -> list[str]:
        return list(self._by_node.get(node_id, ()))

    def peers(self, node_id: str) -> dict[str, list[dict[str, Any]]]:
        """For each running job with a task on `node_id`, its tasks that published something
        (current copies): what the node hands its tasks so they find each other. Costs the
        node's tasks plus the publishers of their jobs, never a scan of all tasks."""
        jobs = dict.fromkeys(self.tasks[t].job_id for t in self._by_node.get(node_id, ()))
        out: dict[str, list[dict[str, Any]]] = {}
        for job_id in jobs:
            if self.jobs[job_id].state == "running":
                ids = sorted(self._published.get(job_id, ()))
                out[job_id] = [_peer(self.tasks[t]) for t in ids]
        return out

    def snapshot(self) -> dict[str, Any]:
        """Everything replicated, as canonical plain data (the digest hashes this)."""
        return {
            "nodes": [asdict(n) for n in self.nodes.values()],
            "jobs": [asdict(j) for j in self.jobs.values()],
            "tasks": [asdict(t) for t in self.tasks.values()],
            "checkpoints": [asdict(c) for c in self.checkpoints.values()],
            "events": [asdict(e) for e in self.events],
            "event_seq": self.event_seq,
            "leader": None if self.leader is None else asdict(self.leader),
            "applied": list(self.applied.items()),
            "applied_count": self.applied_count,
            "faults": [asdict(f) for f in self.faults.values()],
        }

    def digest(self) -> str:
        text = json.dumps(self.snapshot(), sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(text.encode()).hexdigest()


_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def _peer(task: Task) -> dict[str, Any]:
    return {
        "id": task.id,
        "generation": task.generation,
        "node": task.node,
        "state": task.state,
        "published": dict(task.published),
    }


def command_digest(op: str, args: dict[str, Any]) -> str:
    """`op:sha256` of the op and its canonical (sorted, compact) arguments: what an operation
    id is bound to. The time stamp is left out, since a retry is stamped anew."""
    text = _CANONICAL.encode(args)
    return f"{op}:{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def batch_digest(members: list[tuple[str, str]]) -> str:
    """A batch is bound to its members' operation ids and their commands' digests, in order."""
    text = _CANONICAL.encode(members)
    return f"batch:{hashlib.sha256(text.encode()).hexdigest()[:32]}"


_HANDLERS: dict[str, Callable[[StateMachine, dict[str, Any], float], Result]] = {
    "register_node": StateMachine._register_node,
    "set_liveness": StateMachine._set_liveness,
    "report_health": StateMachine._report_health,
    "set_cordon": StateMachine._set_cordon,
    "set_draining": StateMachine._set_draining,
    "submit_job": StateMachine._submit_job,
    "stop_job": StateMachine._stop_job,
    "restart_tasks": StateMachine._restart_tasks,
    "add_tasks": StateMachine._add_tasks,
    "place_tasks": StateMachine._place_tasks,
    "set_task_state": StateMachine._set_task_state,
    "migrate_task": StateMachine._migrate_task,
    "publish_task_state": StateMachine._publish_task_state,
    "set_pending_reason": StateMachine._set_pending_reason,
    "abandon_incoming": StateMachine._abandon_incoming,
    "record_checkpoint": StateMachine._record_checkpoint,
    "add_event": StateMachine._add_event,
    "announce_leader": StateMachine._announce_leader,
    "barrier": StateMachine._barrier,
    "inject_fault": fault_records.inject_fault,
    "report_fault": fault_records.report_fault,
}
