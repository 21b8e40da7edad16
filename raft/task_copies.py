"""Task copies in the state machine: placing, migrating and reporting them.

A mixin of `StateMachine` (raft/machine.py), split out because it is one concern of its own:
generations (each placement or incoming copy gets a fresh one, so a late report of an old copy
stays stale), the GPU indices a copy is given, make-before-break migrations (an incoming copy
beside the current one until it runs or is abandoned), what a copy published, and the derived
node -> tasks and job -> publishers indexes those keep. Deterministic like the machine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from shoal.raft.model import Incoming, Job, Node, Task
from shoal.raft.results import Result, ok, refused


class TaskCopies:
    """The placement, migration and task-report handlers, over the machine's records."""

    nodes: dict[str, Node]
    jobs: dict[str, Job]
    tasks: dict[str, Task]
    _by_node: dict[str, dict[str, None]]
    _published: dict[str, dict[str, None]]

    def _event(self, at: float, kind: str, message: str, **fields: Any) -> None:
        raise NotImplementedError  # StateMachine's event log

    def _task_ran(self, at: float) -> None:
        """A task's current copy reported running (the machine heals the kills it ends)."""

    def _place_tasks(self, args: dict[str, Any], at: float) -> Result:
        for i, placement in enumerate(args["placements"]):
            task = self.tasks.get(placement["task_id"])
            if task is None:
                return refused(
                    "not_found", f"no task {placement['task_id']!r}", f"placements[{i}].task_id"
                )
            node_id = placement["node_id"]
            if node_id is not None:
                node = self.nodes.get(node_id)
                if node is None:
                    return refused("not_found", f"no node {node_id!r}", f"placements[{i}].node_id")
                if node.cordoned or node.liveness == "dead":
                    return refused(
                        "conflict", f"node {node_id!r} takes no tasks", f"placements[{i}].node_id"
                    )
                missing = _missing_gpus(node, placement.get("gpus", ()))
                if missing:
                    return refused("conflict", missing, f"placements[{i}].gpus")
            job_state = self.jobs[task.job_id].state
            if job_state != "running":
                return refused(
                    "conflict", f"job {task.job_id!r} is {job_state}", f"placements[{i}].task_id"
                )
        for placement in args["placements"]:
            task = self.tasks[placement["task_id"]]
            if task.incoming is not None:
                self._abandon(task, task.incoming, at, "the task was placed anew")
            if task.state in ("failed", "stopped") or (task.node and task.state == "running"):
                task.restarts += 1
            self._unindex(task.id, task.node)
            task.node, task.state = placement["node_id"], "pending"
            gpus = self._gpus_for(task, task.node, placement.get("gpus"))
            self._index(task.id, task.node)
            self._renew(task, self._next_generation(task), gpus)
            self._event(
                at,
                "task_placed",
                f"task {task.id} -> {task.node}",
                task=task.id,
                node=task.node,
                generation=task.generation,
                gpus=gpus,
            )
        return ok(placed=len(args["placements"]))

    def _gpus_for(self, task: Task, node_id: str | None, given: list[int] | None) -> list[int]:
        """The GPUs a placement gives `task` on `node_id`: those it names, else (a placement
        by hand) the lowest indices no other active copy there holds, as many as the task asks
        for and the node has free. Deterministic: the same on every replica."""
        if node_id is None:
            return []
        if given is not None:
            return list(given)
        if task.resources.gpus <= 0:
            return []
        held: set[int] = set()
        for other_id in self._by_node.get(node_id, ()):
            other = self.tasks[other_id]
            if other.id == task.id or other.state not in ("pending", "running"):
                continue
            if other.node == node_id:
                held.update(other.gpus)
            if other.incoming is not None and other.incoming.node == node_id:
                held.update(other.incoming.gpus)
        free = sorted(g.index for g in self.nodes[node_id].resources.gpus if g.index not in held)
        return free[: task.resources.gpus]

    def _renew(self, task: Task, generation: int, gpus: list[int]) -> None:
        """A new generation of `task` on its (new) GPUs: what the old one published, and why it
        could not be placed, belong to the old one and are cleared."""
        task.generation, task.gpus, task.pending_reason = generation, gpus, ""
        self._set_published(task, {})

    def _set_published(self, task: Task, state: dict[str, Any]) -> None:
        task.published = state
        if state:
            self._published.setdefault(task.job_id, {})[task.id] = None
        elif task.job_id in self._published:
            self._published[task.job_id].pop(task.id, None)

    def _index(self, task_id: str, node_id: str | None) -> None:
        if node_id is not None:
            self._by_node.setdefault(node_id, {})[task_id] = None

    def _unindex(self, task_id: str, node_id: str | None) -> None:
        if node_id is not None:
            self._by_node[node_id].pop(task_id, None)

    @staticmethod
    def _next_generation(task: Task) -> int:
        task.issued = max(task.issued, task.generation) + 1
        return task.issued

    def _migrate_task(self, args: dict[str, Any], at: float) -> Result:
        """Start an incoming copy of a running task on another node; the current copy keeps
        running until the incoming one reports running (see `_set_task_state`)."""
        task = self.tasks.get(args["task_id"])
        if task is None:
            return refused("not_found", f"no task {args['task_id']!r}", "task_id")
        node = self.nodes.get(args["node_id"])
        if node is None:
            return refused("not_found", f"no node {args['node_id']!r}", "node_id")
        if node.cordoned or node.liveness == "dead":
            return refused("conflict", f"node {node.id!r} takes no tasks", "node_id")
        job_state = self.jobs[task.job_id].state
        if job_state != "running":
            return refused("conflict", f"job {task.job_id!r} is {job_state}", "task_id")
        if task.state != "running" or task.node is None:
            return refused(
                "conflict",
                f"task {task.id!r} is {task.state}, not running on a node: place it instead",
                "task_id",
            )
        if task.node == node.id:
            return refused("conflict", f"task {task.id!r} already runs on {node.id!r}", "node_id")
        if task.incoming is not None:
            return refused(
                "conflict",
                f"task {task.id!r} is already migrating to {task.incoming.node!r}; wait for it",
                "task_id",
            )
        missing = _missing_gpus(node, args.get("gpus", ()))
        if missing:
            return refused("conflict", missing, "gpus")
        gpus = self._gpus_for(task, node.id, args.get("gpus"))
        task.incoming = Incoming(node.id, self._next_generation(task), gpus=gpus)
        self._index(task.id, node.id)
        message = f"started incoming copy on {node.id}"
        self._migration_event(at, task, task.incoming, message, "started")
        return ok(task=asdict(task))

    def _abandon_incoming(self, args: dict[str, Any], at: float) -> Result:
        task = self.tasks.get(args["task_id"])
        if task is None:
            return refused("not_found", f"no task {args['task_id']!r}", "task_id")
        if task.incoming is None or task.incoming.generation != args["generation"]:
            return refused(
                "conflict",
                f"task {task.id!r} has no incoming copy at generation {args['generation']}",
                "generation",
            )
        self._abandon(task, task.incoming, at, args["reason"])
        return ok(task=asdict(task))

    def _abandon(self, task: Task, incoming: Incoming, at: float, reason: str) -> None:
        self._migration_event(at, task, incoming, f"abandoned: {reason}", "abandoned")
        if incoming.node != task.node:
            self._unindex(task.id, incoming.node)
        task.incoming = None

    def _promote(self, task: Task, incoming: Incoming, at: float) -> None:
        source = task.node
        message = f"promoted (the copy on {source} stops)"
        self._migration_event(at, task, incoming, message, "promoted")
        self._unindex(task.id, source)
        task.node, task.incoming = incoming.node, None
        self._renew(task, incoming.generation, incoming.gpus)
        self._set_published(task, incoming.published)
        task.state, task.message = "running", ""
        self._index(task.id, task.node)

    def _migration_event(
        self, at: float, task: Task, incoming: Incoming, message: str, phase: str
    ) -> None:
        self._event(
            at,
            "migration",
            f"task {task.id}: {message}",
            task=task.id,
            phase=phase,
            source=task.node,
            target=incoming.node,
            generation=incoming.generation,
        )

    def _set_task_state(self, args: dict[str, Any], at: float) -> Result:
        task = self.tasks.get(args["task_id"])
        if task is None:
            return refused("not_found", f"no task {args['task_id']!r}", "task_id")
        generation = args.get("generation", task.generation)
        if task.incoming is not None and generation == task.incoming.generation:
            return self._incoming_state(task, task.incoming, args, at)
        if generation != task.generation:
            return refused(
                "conflict",
                f"stale report: generation {generation}, task is at {task.generation}",
                "generation",
            )
        task.state, task.message = args["state"], args.get("message", "")
        self._event(
            at, "task_state", f"task {task.id} {task.state}", task=task.id, state=task.state
        )
        if task.state == "running":
            self._task_ran(at)
        return ok(task=asdict(task))

    def _incoming_state(
        self, task: Task, incoming: Incoming, args: dict[str, Any], at: float
    ) -> Result:
        """A state report of the incoming copy: running promotes it, an end drops it."""
        state = args["state"]
        if state == "running":
            self._promote(task, incoming, at)
            self._task_ran(at)
        elif state == "pending":
            incoming.state = state
        else:
            why = args.get("message", "") or "no reason given"
            self._abandon(task, incoming, at, f"the incoming copy {state}: {why}")
        return ok(task=asdict(task))

    def _publish_task_state(self, args: dict[str, Any], at: float) -> Result:
        """What a copy of a task published replaces what that copy published before; a copy
        of an older generation is refused, so a stale process never overwrites the state its
        successor published."""
        task = self.tasks.get(args["task_id"])
        if task is None:
            return refused("not_found", f"no task {args['task_id']!r}", "task_id")
        generation, state = args["generation"], dict(args["state"])
        if task.incoming is not None and generation == task.incoming.generation:
            task.incoming.published = state
        elif generation == task.generation and task.node is not None:
            self._set_published(task, state)
        else:
            current = f"the task is at generation {task.generation}"
            if task.node is None:
                current += " and placed on no node"
            if task.incoming is not None:
                current += f" (its incoming copy at {task.incoming.generation})"
            return refused(
                "conflict",
                f"stale publication: generation {generation}, but {current}; only the "
                "current copy publishes",
                "generation",
            )
        return ok(task_id=task.id, generation=generation, published=state)

    def _set_pending_reason(self, args: dict[str, Any], at: float) -> Result:
        """The leader could not place this generation of an active task: say why on the task
        (and once in the event log). The same reason again changes nothing."""
        task = self.tasks.get(args["task_id"])
        if task is None:
            return refused("not_found", f"no task {args['task_id']!r}", "task_id")
        if task.generation != args["generation"] or task.state not in ("pending", "running"):
            return refused(
                "conflict",
                f"task {task.id!r} is {task.state} at generation {task.generation}, not "
                f"waiting at {args['generation']}",
                "generation",
            )
        reason = args["reason"]
        if task.pending_reason == reason:
            return ok(changed=False)
        task.pending_reason = reason
        message = f"{task.id} stays pending: {reason}"
        self._event(at, "refused", message, task=task.id, job=task.job_id, reason=message)
        return ok(changed=True)


def _missing_gpus(node: Node, gpus: Iterable[int]) -> str:
    """Why `gpus` cannot be given on `node` (an index it did not register), else ''."""
    have = {g.index for g in node.resources.gpus}
    absent = [g for g in gpus if g not in have]
    if not absent:
        return ""
    held = f"GPUs {sorted(have)}" if have else "no GPUs"
    return f"node {node.id!r} registered {held}, not GPU {absent[0]}; name GPUs it has"
