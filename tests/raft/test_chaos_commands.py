"""Properties of the chaos commands in the pure state machine: a fault names the node that runs
it, recording one changes nothing else, outcomes only move forward, the table stays bounded."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.raft.commands import make_command, validate_args
from shoal.raft.errors import ValidationError
from shoal.raft.fault_records import FAULT_STATES, MAX_FAULTS
from shoal.raft.machine import StateMachine

from .strategies import any_command, args_by_op, stamps

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RANK = {"requested": 0, "injected": 1, "healed": 2, "failed": 2}


def apply(m: StateMachine, op: str, args: dict[str, Any], at: float = 1.0) -> dict[str, Any]:
    return m.apply(make_command(op, args, f"op-{m.applied_count}-{op}", at))


def cluster() -> StateMachine:
    """Nodes n1 (2 GPUs) and n2 (none); job j1 with t1 placed on n1 and t2 unplaced."""
    m = StateMachine()
    for node, gpus in (("n1", 2), ("n2", 0)):
        resources = {
            "cpus": 4,
            "memory": 2**30,
            "gpus": [{"index": i, "uuid": f"GPU-{node}-{i}"} for i in range(gpus)],
        }
        apply(m, "register_node", {"node_id": node, "address": "a:1", "resources": resources})
    tasks = [{"task_id": t, "kind": "rollout-worker", "actor": "a.b:main"} for t in ("t1", "t2")]
    apply(m, "submit_job", {"job_id": "j1", "spec": {"placement": "manual"}, "tasks": tasks})
    apply(m, "place_tasks", {"placements": [{"task_id": "t1", "node_id": "n1"}]})
    return m


def without_chaos(m: StateMachine) -> dict[str, Any]:
    snap = m.snapshot()
    for key in ("faults", "events", "event_seq", "applied", "applied_count"):
        snap.pop(key)
    return snap


def without_faults(command: dict[str, Any]) -> dict[str, Any]:
    if command["op"] == "batch":
        members = [without_faults(m) for m in command["args"]["commands"]]
        return {**command, "args": {"commands": members}}
    if command["op"] in ("inject_fault", "report_fault"):
        return {**command, "op": "barrier", "args": {}}
    return copy.deepcopy(command)


def test_a_task_fault_is_addressed_to_the_tasks_node_at_its_generation() -> None:
    m = cluster()
    result = apply(m, "inject_fault", {"fault_id": "f1", "kind": "task-kill", "target": "t1"})
    assert result["ok"], result
    fault = result["fault"]
    assert (fault["node"], fault["generation"], fault["state"]) == ("n1", 1, "requested")
    assert [f.id for f in m.faults_for("n1")] == ["f1"]
    assert m.faults_for("n2") == []
    assert m.events[-1].kind == "chaos_fault"


def test_refusals_name_the_target_and_the_fix() -> None:
    m = cluster()
    cases = [
        ({"kind": "task-kill", "target": "nope"}, "not_found", "no task 'nope'"),
        ({"kind": "task-kill", "target": "t2"}, "conflict", "on no node"),
        ({"kind": "node-kill", "target": "n9"}, "not_found", "no node 'n9'"),
        ({"kind": "gpu-xid", "target": "n1", "gpu": 2}, "conflict", "GPUs 0..1, not GPU 2"),
        ({"kind": "gpu-xid", "target": "n2", "gpu": 0}, "conflict", "no GPUs"),
    ]
    for i, (args, error, text) in enumerate(cases):
        result = apply(m, "inject_fault", {"fault_id": f"f{i}", **args})
        assert (result["ok"], result["error"]) == (False, error), args
        assert text in result["message"]
    assert m.faults == {}
    apply(m, "set_liveness", {"changes": [{"node_id": "n2", "liveness": "dead"}]})
    result = apply(m, "inject_fault", {"fault_id": "fd", "kind": "node-kill", "target": "n2"})
    assert result["error"] == "conflict"
    assert "dead" in result["message"]


def test_a_duplicate_fault_id_is_a_conflict() -> None:
    m = cluster()
    args = {"fault_id": "f1", "kind": "node-kill", "target": "n1"}
    assert apply(m, "inject_fault", args)["ok"]
    assert apply(m, "inject_fault", args)["error"] == "conflict"


@pytest.mark.parametrize(
    ("args", "field", "text"),
    [
        ({"kind": "task-pause", "target": "t1"}, "duration_s", "needs duration_s > 0"),
        ({"kind": "task-pause", "target": "t1", "duration_s": 0}, "duration_s", "> 0"),
        ({"kind": "task-kill", "target": "t1", "duration_s": -1}, "duration_s", ">= 0"),
        ({"kind": "gpu-xid", "target": "n1"}, "gpu", "needs gpu"),
        ({"kind": "task-kill", "target": "t1", "gpu": 0}, "gpu", "only gpu-xid"),
        ({"kind": "node-kill", "target": "n1", "xid": 79}, "xid", "only gpu-xid"),
        ({"kind": "clock-skew", "target": "n1", "offset_s": 2}, "duration_s", "> 0"),
        ({"kind": "clock-skew", "target": "n1", "duration_s": 2}, "offset_s", "needs offset_s"),
        ({"kind": "gpu-xid", "target": "n1", "gpu": 0, "offset_s": 1}, "offset_s", "only clock"),
        ({"kind": "disk-melt", "target": "n1"}, "kind", "one of"),
        ({"kind": "node-kill"}, "target", "is required"),
    ],
)
def test_validation_names_the_bad_key(args: dict[str, Any], field: str, text: str) -> None:
    with pytest.raises(ValidationError) as exc:
        validate_args("inject_fault", {"fault_id": "f1", **args})
    assert exc.value.field.endswith(field)
    assert text in str(exc.value)


@FAST
@given(st.lists(any_command, max_size=30))
def test_recording_faults_changes_nothing_but_faults_events_and_applied_ops(
    log: list[dict[str, Any]],
) -> None:
    """Replicas never act on a fault: a log whose chaos commands are replaced by barriers (no
    effect, same op ids) leaves every other record exactly as the full log does."""
    full, plain = StateMachine(), StateMachine()
    for command in log:
        full.apply(copy.deepcopy(command))
        plain.apply(without_faults(command))
    assert without_chaos(full) == without_chaos(plain)
    assert len(full.faults) <= MAX_FAULTS
    assert all(f.state in FAULT_STATES for f in full.faults.values())
    for node in full.nodes:
        assert all(f.node == node and f.state == "requested" for f in full.faults_for(node))


@FAST
@given(
    st.sampled_from(["task-kill", "task-pause", "node-kill", "gpu-xid", "clock-skew"]),
    st.lists(st.tuples(st.sampled_from(["injected", "healed", "failed"]), stamps), max_size=8),
)
def test_outcomes_only_move_forward_and_a_repeat_is_a_no_op(
    kind: str, reports: list[tuple[str, float]]
) -> None:
    m = cluster()
    target = "t1" if kind.startswith("task") else "n1"
    args: dict[str, Any] = {"fault_id": "f1", "kind": kind, "target": target}
    args.update({"duration_s": 1.0} if kind == "task-pause" else {})
    args.update({"gpu": 1} if kind == "gpu-xid" else {})
    args.update({"offset_s": 5.0, "duration_s": 1.0} if kind == "clock-skew" else {})
    assert apply(m, "inject_fault", args)["ok"]
    seen = ["requested"]
    for state, at in reports:
        before = m.faults["f1"].state
        result = apply(m, "report_fault", {"fault_id": "f1", "state": state, "message": "x"}, at)
        after = m.faults["f1"].state
        forward = RANK[state] > RANK[before] and before not in ("healed", "failed")
        if state == before:
            assert result["ok"]
            assert result["changed"] is False
        elif forward:
            assert result["ok"]
            assert result["changed"] is True
            assert after == state
        else:
            assert result["error"] == "conflict"
            assert after == before
        seen.append(after)
    assert [RANK[s] for s in seen] == sorted(RANK[s] for s in seen)
    assert (m.faults_for("n1") != []) == (seen[-1] == "requested")


def test_a_dead_node_fails_its_pending_faults_except_its_own_kill() -> None:
    m = cluster()
    for fid, args in (
        ("kill", {"kind": "node-kill", "target": "n1"}),
        ("xid", {"kind": "gpu-xid", "target": "n1", "gpu": 0}),
        ("task", {"kind": "task-kill", "target": "t1"}),
    ):
        assert apply(m, "inject_fault", {"fault_id": fid, **args})["ok"]
    apply(m, "set_liveness", {"changes": [{"node_id": "n1", "liveness": "dead"}]}, at=5.0)
    assert [f.id for f in m.faults_for("n1")] == ["kill"]
    for fid in ("xid", "task"):
        assert m.faults[fid].state == "failed"
        assert m.faults[fid].message == "node n1 was declared dead before it executed the fault"
        assert m.faults[fid].updated_at == 5.0
    assert apply(m, "report_fault", {"fault_id": "kill", "state": "injected"})["changed"]


def test_a_dead_node_fails_the_pause_and_skew_it_alone_could_heal() -> None:
    m = cluster()
    for fid, args in (
        ("pause", {"kind": "task-pause", "target": "t1", "duration_s": 5.0}),
        ("skew", {"kind": "clock-skew", "target": "n1", "duration_s": 5.0, "offset_s": 2.0}),
        ("xid", {"kind": "gpu-xid", "target": "n1", "gpu": 0}),
    ):
        assert apply(m, "inject_fault", {"fault_id": fid, **args})["ok"]
        assert apply(m, "report_fault", {"fault_id": fid, "state": "injected"}, at=2.0)["ok"]
    apply(m, "set_liveness", {"changes": [{"node_id": "n1", "liveness": "dead"}]}, at=5.0)
    for fid in ("pause", "skew"):
        assert m.faults[fid].state == "failed"
        assert m.faults[fid].message == "node n1 was declared dead while the fault was in effect"
        assert m.faults[fid].recovery_s is None
    assert m.faults["xid"].state == "injected"  # raised once: nothing is left to heal
    late = apply(m, "report_fault", {"fault_id": "pause", "state": "healed"}, at=30.0)
    assert late["error"] == "conflict"


def running(m: StateMachine, task_id: str, at: float) -> None:
    t = m.tasks[task_id]
    report = {"task_id": task_id, "state": "running", "generation": t.generation}
    assert apply(m, "set_task_state", report, at)["ok"]


def test_a_killed_task_heals_its_fault_when_it_runs_again_at_a_later_generation() -> None:
    m = cluster()
    running(m, "t1", 1.0)
    apply(m, "inject_fault", {"fault_id": "f1", "kind": "task-kill", "target": "t1"}, 2.0)
    assert m.faults["f1"].tasks == {"t1": 1}
    apply(m, "report_fault", {"fault_id": "f1", "state": "injected"}, 3.0)
    running(m, "t1", 4.0)  # a late report of the killed incarnation heals nothing
    assert m.faults["f1"].state == "injected"
    apply(m, "place_tasks", {"placements": [{"task_id": "t1", "node_id": "n2"}]}, 5.0)
    running(m, "t1", 7.5)
    fault = m.faults["f1"]
    assert (fault.state, fault.injected_at, fault.recovery_s) == ("healed", 3.0, 4.5)
    assert fault.message == "1 task(s) running again 4.50 s after the fault was injected"


def test_a_killed_node_heals_when_all_its_tasks_run_elsewhere_or_ended() -> None:
    m = cluster()
    tasks = [{"task_id": t, "kind": "rollout-worker", "actor": "a.b:main"} for t in ("t3", "t4")]
    apply(m, "submit_job", {"job_id": "j2", "spec": {"placement": "manual"}, "tasks": tasks})
    for t in ("t3", "t4"):
        apply(m, "place_tasks", {"placements": [{"task_id": t, "node_id": "n1"}]})
        running(m, t, 1.0)
    apply(m, "inject_fault", {"fault_id": "k", "kind": "node-kill", "target": "n1"}, 2.0)
    assert m.faults["k"].tasks == {"t1": 1, "t3": 1, "t4": 1}
    apply(m, "report_fault", {"fault_id": "k", "state": "injected"}, 2.0)
    apply(m, "stop_job", {"job_id": "j2"}, 3.0)
    assert m.faults["k"].state == "injected"
    apply(m, "place_tasks", {"placements": [{"task_id": "t1", "node_id": "n2"}]}, 4.0)
    running(m, "t1", 6.0)
    assert (m.faults["k"].state, m.faults["k"].recovery_s) == ("healed", 4.0)


def test_an_unknown_fault_report_is_not_found() -> None:
    result = apply(StateMachine(), "report_fault", {"fault_id": "nope", "state": "injected"})
    assert result["error"] == "not_found"


def test_the_fault_table_keeps_the_newest() -> None:
    m = cluster()
    for i in range(MAX_FAULTS + 5):
        assert apply(m, "inject_fault", {"fault_id": f"f{i}", "kind": "node-kill", "target": "n1"})[
            "ok"
        ]
    assert len(m.faults) == MAX_FAULTS
    assert next(iter(m.faults)) == "f5"


@FAST
@given(args_by_op["inject_fault"])
def test_generated_faults_validate(args: dict[str, Any]) -> None:
    validate_args("inject_fault", args)
