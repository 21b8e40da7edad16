"""Property tests of the pure state machine: determinism, idempotency, validation before apply."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.raft.commands import ARG_SCHEMAS, validate_command
from shoal.raft.errors import ValidationError
from shoal.raft.machine import MAX_APPLIED_OPS, StateMachine, batch_digest, command_digest
from shoal.raft.model import Task

from .strategies import any_command, args_by_op, json_value, op_ids, stamps

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(st.lists(any_command, max_size=30))
def test_three_replicas_applying_the_same_log_have_equal_digests(log: list[dict[str, Any]]) -> None:
    replicas = [StateMachine() for _ in range(3)]
    for command in log:
        validate_command(command)
        results = [replica.apply(copy.deepcopy(command)) for replica in replicas]
        assert results[0] == results[1] == results[2]
    digests = {replica.digest() for replica in replicas}
    assert len(digests) == 1
    restored = pickle.loads(pickle.dumps(replicas[0]))
    assert restored.digest() == replicas[0].digest()


@FAST
@given(st.lists(any_command, max_size=20), any_command)
def test_a_retried_operation_is_applied_once_and_answers_the_first_result(
    log: list[dict[str, Any]], command: dict[str, Any]
) -> None:
    machine = StateMachine()
    for entry in log:
        machine.apply(entry)
    first = machine.apply(command)
    digest = machine.digest()
    assert machine.apply(copy.deepcopy(command)) == first
    assert machine.digest() == digest


def _bound(command: dict[str, Any]) -> str:
    """The digest an op id is bound to, as the machine computes it."""
    if command["op"] != "batch":
        return command_digest(command["op"], command["args"])
    members = command["args"]["commands"]
    return batch_digest([(m["op_id"], command_digest(m["op"], m["args"])) for m in members])


@FAST
@given(st.lists(any_command, max_size=20), any_command, any_command)
def test_an_operation_id_reused_for_another_command_is_refused_and_changes_nothing(
    log: list[dict[str, Any]], first: dict[str, Any], other: dict[str, Any]
) -> None:
    machine = StateMachine()
    for entry in log:
        machine.apply(entry)
    machine.apply(first)
    reuse = {**copy.deepcopy(other), "op_id": first["op_id"]}
    digest, count = machine.digest(), machine.applied_count
    result = machine.apply(reuse)
    if _bound(reuse) == machine.op_commands[first["op_id"]]:
        assert result == machine.applied[first["op_id"]]
    else:
        assert result["ok"] is False
        assert result["error"] == "conflict"
        assert result["field"] == "op_id"
        assert "fresh X-Shoal-Op-Id" in result["message"]
    assert (machine.digest(), machine.applied_count) == (digest, count)


def test_an_op_id_from_a_dump_older_than_the_binding_is_refused_not_guessed() -> None:
    machine = StateMachine()
    event = {"kind": "k", "message": "m"}
    command = {"op": "add_event", "op_id": "old-op", "at": 1.0, "args": event}
    assert machine.apply(command)["ok"]
    digest = machine.digest()
    del machine.__dict__["op_commands"]  # what a dump written before op ids were bound holds
    restored: StateMachine = pickle.loads(pickle.dumps(machine))
    assert restored.digest() == digest
    again = restored.apply(command)
    assert again["ok"] is False
    assert again["field"] == "op_id"
    assert "fresh X-Shoal-Op-Id" in again["message"]
    assert restored.digest() == digest
    assert restored.apply({**command, "op_id": "new-op"})["ok"]


def test_the_binding_is_forgotten_with_the_applied_op_id() -> None:
    machine = StateMachine()
    for i in range(MAX_APPLIED_OPS + 5):
        command = {"op": "barrier", "op_id": f"op-{i}", "at": 1.0, "args": {}}
        machine.apply(command)
    assert len(machine.op_commands) == len(machine.applied) == MAX_APPLIED_OPS
    assert "op-0" not in machine.op_commands


@FAST
@given(st.lists(any_command, max_size=25))
def test_derived_assignments_match_task_placements(log: list[dict[str, Any]]) -> None:
    machine = StateMachine()
    for entry in log:
        machine.apply(entry)
    assignments = machine.assignments()
    for node_id in machine.nodes:
        expected = {t.id for t in machine.tasks.values() if node_id in _copies(t)}
        assert sorted(assignments[node_id]) == sorted(expected)
    placed = sorted(t for ids in assignments.values() for t in ids)
    assert placed == sorted(t.id for t in machine.tasks.values() for _ in _copies(t))
    assert all(t.node in machine.nodes for t in machine.tasks.values() if t.node is not None)
    assert all(t.job_id in machine.jobs for t in machine.tasks.values())
    seqs = [e.seq for e in machine.events]
    assert seqs == sorted(seqs)
    assert len(set(seqs)) == len(seqs)


@FAST
@given(st.lists(any_command, max_size=25))
def test_published_state_and_gpus_belong_to_placed_generations(log: list[dict[str, Any]]) -> None:
    """Whatever the log: only a placed task holds GPUs or a published state, the job index
    the heartbeat's peers come from lists exactly the tasks that published, and a restored
    machine rebuilds it."""
    machine = StateMachine()
    for entry in log:
        machine.apply(entry)
    for task in machine.tasks.values():
        if task.node is None:
            assert (task.gpus, task.published) == ([], {})
    for m in (machine, _without_published_index(machine)):
        for job_id in machine.jobs:
            expected = {t.id for t in m.tasks.values() if t.job_id == job_id and t.published}
            assert set(m._published.get(job_id, ())) == expected
        for node_id in m.nodes:
            for job_id, peers in m.peers(node_id).items():
                assert m.jobs[job_id].state == "running"
                assert all(m.tasks[p["id"]].published == p["published"] != {} for p in peers)


def _without_published_index(m: StateMachine) -> StateMachine:
    """The machine as a dump from before the index existed restores it."""
    old = copy.deepcopy(m)
    del old.__dict__["_published"]
    restored: StateMachine = pickle.loads(pickle.dumps(old))
    return restored


def _copies(task: Task) -> list[str]:
    """The nodes holding a copy of `task`: its current node and a migration's incoming one."""
    nodes = [] if task.node is None else [task.node]
    return nodes + ([] if task.incoming is None else [task.incoming.node])


def _mutate(args: dict[str, Any], key: str | None, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(args)
    if key is None:
        return out
    out[key] = value
    return out


@FAST
@given(
    st.sampled_from(sorted(ARG_SCHEMAS)).flatmap(lambda op: st.tuples(st.just(op), args_by_op[op])),
    st.none() | st.text(max_size=10),
    json_value,
    op_ids,
    stamps,
)
def test_validation_rejects_whatever_apply_would_choke_on(
    op_args: tuple[str, dict[str, Any]], key: str | None, junk: Any, op_id: str, at: float
) -> None:
    op, args = op_args
    command = {"op": op, "op_id": op_id, "at": at, "args": _mutate(args, key, junk)}
    try:
        validate_command(command)
    except ValidationError as exc:
        field = exc.field
    else:
        field = None
    if field is not None:
        assert field.startswith("command")
        return
    result = StateMachine().apply(command)
    assert isinstance(result["ok"], bool)


@settings(deadline=None)
@given(json_value)
def test_validation_rejects_arbitrary_junk_as_a_command(junk: Any) -> None:
    try:
        validate_command(junk)
    except ValidationError:
        return
    StateMachine().apply(junk)


def test_validation_names_the_field() -> None:
    bad = {
        "op": "register_node",
        "op_id": "x",
        "at": 1.0,
        "args": {"node_id": "n1", "address": "a", "resources": {"cpus": 1, "memory": -1}},
    }
    with pytest.raises(ValidationError, match=">= 0") as exc:
        validate_command(bad)
    assert exc.value.field == "command.args.resources.memory"


def test_non_finite_numbers_are_rejected() -> None:
    bad = {
        "op": "add_event",
        "op_id": "x",
        "at": 1.0,
        "args": {"kind": "k", "message": "m", "fields": {"v": float("nan")}},
    }
    with pytest.raises(ValidationError, match="finite") as exc:
        validate_command(bad)
    assert exc.value.field == "command.args.fields.v"
