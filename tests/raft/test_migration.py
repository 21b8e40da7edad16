"""Make-before-break migration in the replicated state: the incoming copy runs beside the
current one until it reports running (promoted) or ends / loses its node (abandoned), and the
scheduler uses it for running rollout actors; jobs are scheduled without a `spec.placement`."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.raft.machine import StateMachine
from shoal.raft.model import Task
from shoal.raft.scheduling_decide import Memory
from shoal.tasks import TaskSpec

from .test_scheduling import BUSY, IDLE, add_node, health, one_round, run, submit

NODES = ("a", "b", "c")


def running_task(m: StateMachine) -> Task:
    """Nodes a, b, c; one manual rollout actor running on a."""
    for name in NODES:
        add_node(m, name, gpus=0)
    submit(m, "job", rollouts=1, mode="manual")
    assert run(m, "place_tasks", {"placements": [{"task_id": "job-r0", "node_id": "a"}]})["ok"]
    assert run(m, "set_task_state", {"task_id": "job-r0", "state": "running", "generation": 1})[
        "ok"
    ]
    return m.tasks["job-r0"]


def migration_events(m: StateMachine) -> list[str]:
    return [e.message for e in m.events if e.kind == "migration"]


def copies(m: StateMachine, task: Task) -> set[tuple[str, int]]:
    """The (node, generation) copies the node agents are told to run, from their assignments."""
    out = set()
    for node, ids in m.assignments().items():
        if task.id in ids:
            record = {"id": task.id, "kind": task.kind, "actor": task.actor}
            record |= {"node": task.node, "generation": task.generation, "state": task.state}
            record["incoming"] = None if task.incoming is None else vars(task.incoming)
            out |= {(node, s.generation) for s in TaskSpec.copies_for(record, node)}
    return out


def test_the_incoming_copy_runs_beside_the_old_one_until_it_reports_running() -> None:
    m = StateMachine()
    task = running_task(m)
    assert run(m, "migrate_task", {"task_id": task.id, "node_id": "b"})["ok"]
    assert (task.node, task.generation, task.state) == ("a", 1, "running")
    assert copies(m, task) == {("a", 1), ("b", 2)}
    pending = {"task_id": task.id, "state": "pending", "generation": 2}
    assert run(m, "set_task_state", pending)["ok"]
    assert copies(m, task) == {("a", 1), ("b", 2)}
    assert run(m, "set_task_state", {**pending, "state": "running"})["ok"]
    assert (task.node, task.generation, task.state, task.incoming) == ("b", 2, "running", None)
    assert copies(m, task) == {("b", 2)}
    assert migration_events(m) == [
        "task job-r0: started incoming copy on b",
        "task job-r0: promoted (the copy on a stops)",
    ]
    stale = run(m, "set_task_state", {"task_id": task.id, "state": "stopped", "generation": 1})
    assert stale["error"] == "conflict"
    assert task.state == "running"


def test_a_failed_incoming_copy_is_abandoned_and_the_old_one_keeps_running() -> None:
    m = StateMachine()
    task = running_task(m)
    assert run(m, "migrate_task", {"task_id": task.id, "node_id": "b"})["ok"]
    failed = {"task_id": task.id, "state": "failed", "generation": 2, "message": "no such env"}
    assert run(m, "set_task_state", failed)["ok"]
    assert (task.node, task.generation, task.state, task.incoming) == ("a", 1, "running", None)
    assert copies(m, task) == {("a", 1)}
    assert migration_events(m)[-1] == (
        "task job-r0: abandoned: the incoming copy failed: no such env"
    )
    # the next migration gets a fresh generation: a late report of the dead copy stays stale
    assert run(m, "migrate_task", {"task_id": task.id, "node_id": "b"})["ok"]
    assert task.incoming is not None
    assert task.incoming.generation == 3
    assert run(m, "set_task_state", failed)["error"] == "conflict"
    assert task.incoming is not None


def test_the_incoming_nodes_death_abandons_the_copy_with_the_reason() -> None:
    m = StateMachine()
    task = running_task(m)
    assert run(m, "migrate_task", {"task_id": task.id, "node_id": "c"})["ok"]
    run(m, "set_liveness", {"changes": [{"node_id": "c", "liveness": "dead"}]})
    assert task.incoming is None
    assert copies(m, task) == {("a", 1)}
    assert migration_events(m)[-1] == "task job-r0: abandoned: node c is dead"


def test_placing_or_stopping_a_migrating_task_abandons_its_incoming_copy() -> None:
    m = StateMachine()
    task = running_task(m)
    assert run(m, "migrate_task", {"task_id": task.id, "node_id": "b"})["ok"]
    assert run(m, "place_tasks", {"placements": [{"task_id": task.id, "node_id": "c"}]})["ok"]
    assert (task.node, task.generation, task.incoming) == ("c", 3, None)
    assert copies(m, task) == {("c", 3)}
    assert run(m, "set_task_state", {"task_id": task.id, "state": "running"})["ok"]
    assert run(m, "migrate_task", {"task_id": task.id, "node_id": "a"})["ok"]
    assert run(m, "stop_job", {"job_id": "job"})["ok"]
    assert task.incoming is None
    assert m.tasks_on("a") == []
    assert migration_events(m)[-1] == "task job-r0: abandoned: job job stopped"


def test_migrations_that_cannot_be_made_are_refused_with_the_reason() -> None:
    m = StateMachine()
    task = running_task(m)
    run(m, "set_cordon", {"node_id": "c", "cordoned": True})
    cases = [
        ({"task_id": "nope", "node_id": "b"}, "not_found", "no task 'nope'"),
        ({"task_id": task.id, "node_id": "zz"}, "not_found", "no node 'zz'"),
        ({"task_id": task.id, "node_id": "c"}, "conflict", "takes no tasks"),
        ({"task_id": task.id, "node_id": "a"}, "conflict", "already runs on 'a'"),
    ]
    for args, error, words in cases:
        result = run(m, "migrate_task", args)
        assert result["error"] == error
        assert words in result["message"]
    assert run(m, "migrate_task", {"task_id": task.id, "node_id": "b"})["ok"]
    again = run(m, "migrate_task", {"task_id": task.id, "node_id": "b"})
    assert "already migrating to 'b'" in again["message"]
    assert (
        run(m, "abandon_incoming", {"task_id": task.id, "generation": 9, "reason": "x"})["error"]
        == "conflict"
    )
    assert run(m, "abandon_incoming", {"task_id": task.id, "generation": 2, "reason": "ops"})["ok"]
    assert migration_events(m)[-1] == "task job-r0: abandoned: ops"
    assert run(m, "set_task_state", {"task_id": task.id, "state": "pending"})["ok"]
    not_running = run(m, "migrate_task", {"task_id": task.id, "node_id": "b"})
    assert "is pending, not running" in not_running["message"]


def test_a_retried_migration_is_applied_once_and_the_digest_covers_it() -> None:
    m = StateMachine()
    running_task(m)
    command = {
        "op": "migrate_task",
        "op_id": "mig-1",
        "at": 5.0,
        "args": {"task_id": "job-r0", "node_id": "b"},
    }
    first = m.apply(dict(command))
    assert m.apply(dict(command)) == first
    incoming = m.tasks["job-r0"].incoming
    assert incoming is not None
    assert (incoming.generation, m.tasks["job-r0"].issued) == (2, 2)
    twin = copy.deepcopy(m)
    assert twin.digest() == m.digest()
    twin_incoming = twin.tasks["job-r0"].incoming
    assert twin_incoming is not None
    twin_incoming.node = "c"
    assert twin.digest() != m.digest()


STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("migrate"), st.sampled_from(NODES)),
        st.tuples(st.just("report"), st.sampled_from(["pending", "running", "failed", "stopped"])),
        st.tuples(st.just("kill"), st.sampled_from(NODES[1:])),
        st.tuples(st.just("abandon"), st.just("")),
    ),
    max_size=20,
)


def step(m: StateMachine, task: Task, what: str, value: str) -> None:
    incoming = task.incoming
    if what == "migrate":
        run(m, "migrate_task", {"task_id": task.id, "node_id": value})
    elif what == "kill":  # the node of the current copy (a) never dies: it would end the task
        run(m, "set_liveness", {"changes": [{"node_id": value, "liveness": "dead"}]})
    elif incoming is not None and what == "report":
        args = {"task_id": task.id, "state": value, "generation": incoming.generation}
        assert run(m, "set_task_state", args)["ok"]
    elif incoming is not None:
        args = {"task_id": task.id, "generation": incoming.generation, "reason": "test"}
        assert run(m, "abandon_incoming", args)["ok"]


@settings(max_examples=150, deadline=None)
@given(STEPS, st.sampled_from(["running", "failed"]))
def test_a_migrating_task_always_has_one_or_two_copies_and_ends_with_one(
    steps: list[tuple[str, str]], last: str
) -> None:
    m = StateMachine()
    task = running_task(m)
    for what, value in steps:
        step(m, task, what, value)
        assert task.state == "running"
        assert (task.node, task.generation) in copies(m, task)
        assert 1 <= len(copies(m, task)) <= 2
        assert len({node for node, _ in copies(m, task)}) == len(copies(m, task))
    step(m, task, "report", last)
    assert copies(m, task) == {(task.node, task.generation)}
    assert task.incoming is None


def test_the_scheduler_relieves_an_overloaded_node_make_before_break() -> None:
    m = StateMachine()
    for name in ("a", "b"):
        add_node(m, name)
    submit(m, "job", rollouts=4)
    memory = Memory()
    one_round(m, memory)
    for t in m.tasks.values():
        run(m, "set_task_state", {"task_id": t.id, "state": "running"})
    health(m, 1001.0, a=BUSY, b=IDLE)
    one_round(m, memory, 1001.0)
    health(m, 1002.0, a=BUSY, b=IDLE)
    reasons = [e for e in one_round(m, memory, 1002.0) if e["kind"] == "migration"]
    assert reasons
    assert "relieve a" in reasons[0]["message"]
    task = m.tasks[reasons[0]["fields"]["task"]]
    assert (task.node, task.generation, task.state) == ("a", 1, "running")
    assert task.incoming is not None
    assert task.incoming.node == "b"
    assert f"task {task.id}: started incoming copy on b" in migration_events(m)
    health(m, 1003.0, a=BUSY, b=IDLE)
    again = [e for e in one_round(m, memory, 1100.0) if e["kind"] == "migration"]
    assert task.id not in [e["fields"]["task"] for e in again]  # not moved while migrating
    report = {"task_id": task.id, "state": "running", "generation": task.incoming.generation}
    assert run(m, "set_task_state", report)["ok"]
    assert (task.node, task.incoming) == ("b", None)


def test_when_the_old_node_dies_mid_migration_the_incoming_copy_takes_over() -> None:
    m = StateMachine()
    for name in NODES:
        add_node(m, name, gpus=0)
    submit(m, "job", rollouts=1)
    memory = Memory()
    one_round(m, memory)
    task = m.tasks["job-r0"]
    source = task.node
    assert source is not None
    run(m, "set_task_state", {"task_id": task.id, "state": "running"})
    target = next(n for n in NODES if n != source)
    assert run(m, "migrate_task", {"task_id": task.id, "node_id": target})["ok"]
    run(m, "set_liveness", {"changes": [{"node_id": source, "liveness": "dead"}]})
    assert one_round(m, memory, 1001.0) == []  # not re-placed: the incoming copy is on its way
    assert task.incoming is not None
    report = {"task_id": task.id, "state": "running", "generation": task.incoming.generation}
    assert run(m, "set_task_state", report)["ok"]
    assert (task.node, task.incoming) == (target, None)
    assert m.tasks_on(source) == []


def test_a_job_without_a_placement_mode_is_scheduled() -> None:
    m = StateMachine()
    add_node(m, "a")
    tasks: list[dict[str, Any]] = [{"task_id": "t", "kind": "rollout", "actor": "a.b:C"}]
    assert run(m, "submit_job", {"job_id": "plain", "tasks": tasks})["ok"]
    events = one_round(m, Memory())
    assert [e["kind"] for e in events] == ["placement"]
    assert m.tasks["t"].node == "a"
