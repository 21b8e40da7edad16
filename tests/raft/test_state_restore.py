"""A coordinator data dir written by an older shoal, whose records lack fields added since
(a job's restart_times, restarts and message; a task's due, GPUs, published state and pending
reason; the machine's node and publisher indices), loads: missing fields take their defaults,
and the restored state works on."""

from __future__ import annotations

import copy
import pickle
import threading
import time
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pysyncobj import SyncObj, SyncObjConf

from shoal.raft.commands import make_command
from shoal.raft.machine import StateMachine
from shoal.raft.state import ClusterState
from tests.raft.inprocess import free_port
from tests.raft.strategies import any_command
from tests.raft.test_scheduling import add_node, run
from tests.support.waiting import eventually

OLD_JOB = ("restart_times", "restarts", "message")
OLD_TASK = ("due", "gpus", "published", "pending_reason")


def populated() -> StateMachine:
    m = StateMachine()
    add_node(m, "a", gpus=2)
    tasks = [{"task_id": f"t{i}", "kind": "rollout", "actor": "a.b:C"} for i in range(3)]
    assert run(m, "submit_job", {"job_id": "j", "tasks": tasks}, 1.0)["ok"]
    placements = [{"task_id": f"t{i}", "node_id": "a"} for i in range(3)]
    assert run(m, "place_tasks", {"placements": placements}, 2.0)["ok"]
    return m


def make_old(m: StateMachine) -> None:
    """Strip what an older shoal's records did not have (all at their defaults here)."""
    for job in m.jobs.values():
        for name in OLD_JOB:
            del job.__dict__[name]
    for task in m.tasks.values():
        for name in OLD_TASK:
            del task.__dict__[name]
    del m.__dict__["_by_node"]
    del m.__dict__["_published"]


def test_an_old_shaped_machine_unpickles_with_defaults_and_the_same_digest() -> None:
    m = populated()
    digest, assignments = m.digest(), m.assignments()
    make_old(m)
    restored: StateMachine = pickle.loads(pickle.dumps(m))
    job = restored.jobs["j"]
    assert (job.restart_times, job.restarts, job.message) == ([], 0, "")
    assert all(t.due == 0.0 for t in restored.tasks.values())
    assert all(
        (t.gpus, t.published, t.pending_reason) == ([], {}, "") for t in restored.tasks.values()
    )
    assert restored.digest() == digest
    assert restored.assignments() == assignments
    fail = {"task_id": "t0", "state": "failed", "generation": restored.tasks["t0"].generation}
    assert run(restored, "set_task_state", fail, 4.0)["ok"]
    restart = {
        "job_id": "j",
        "cause": "t0",
        "generation": restored.tasks["t0"].generation,
        "tasks": ["t0"],
        "reason": "t0 failed",
        "counted": True,
    }
    assert run(restored, "restart_tasks", restart, 5.0)["ok"]
    assert restored.jobs["j"].restart_times == [5.0]
    assert restored.tasks_on("a") == ["t1", "t2"]
    publish = {"task_id": "t1", "generation": restored.tasks["t1"].generation, "state": {"p": 1}}
    assert run(restored, "publish_task_state", publish, 6.0)["ok"]
    assert [p["id"] for p in restored.peers("a")["j"]] == ["t1"]


def _replica(tmp_path: Path, addr: str) -> tuple[SyncObj, ClusterState]:
    """A replica whose only record is its dump: a restart loads exactly what the dump holds."""
    state = ClusterState()
    conf = SyncObjConf(
        fullDumpFile=str(tmp_path / "raft.dump"),
        logCompactionMinEntries=10,
        useFork=False,
        appendEntriesUseBatch=False,
    )
    return SyncObj(addr, [], conf, consumers=[state]), state


def _apply(state: ClusterState, op: str, args: dict[str, Any], op_id: str) -> dict[str, Any]:
    done = threading.Event()
    box: list[tuple[dict[str, Any], int]] = []

    def callback(result: dict[str, Any], reason: int) -> None:
        box.append((result, reason))
        done.set()

    state.propose(make_command(op, args, op_id, 1000.0), callback)
    assert done.wait(10), "command not applied"
    assert box[0][1] == 0
    return box[0][0]


@pytest.mark.timeout(60)
def test_a_replica_restarts_from_a_dump_an_older_shoal_wrote(tmp_path: Path) -> None:
    addr = f"127.0.0.1:{free_port()}"
    sync, state = _replica(tmp_path, addr)
    try:
        tasks = [{"task_id": "t0", "kind": "rollout", "actor": "a.b:C"}]
        _apply(state, "submit_job", {"job_id": "j", "tasks": tasks}, "op-job")
        for i in range(12):
            _apply(state, "add_event", {"kind": "note", "message": str(i)}, f"op-{i}")
        state.read(make_old)  # what the older shoal held, under the lock
        sync.forceLogCompaction()
        eventually((tmp_path / "raft.dump").exists, "a dump written")
        time.sleep(0.3)  # the dump is renamed into place once complete
    finally:
        sync.destroy()
        time.sleep(0.3)
    sync2, state2 = _replica(tmp_path, addr)
    try:
        eventually(
            lambda: state2.read(lambda m: "j" in m.jobs), "the restarted replica loaded the dump"
        )
        job = state2.read(lambda m: m.jobs["j"])
        assert "restart_times" in job.__dict__  # filled on load, not by a class attribute
        assert (job.restart_times, job.restarts, job.message) == ([], 0, "")
        assert state2.read(lambda m: m.tasks["t0"].due) == 0.0
        state2.digest()
        assert _apply(state2, "stop_job", {"job_id": "j"}, "op-stop")["job"]["restart_times"] == []
    finally:
        sync2.destroy()


def strip_defaults(record: object) -> None:
    """Drop every field still at its default, recursively: what a dump from before those
    fields existed would hold."""
    if not is_dataclass(record):
        return
    for f in fields(record):
        value = record.__dict__[f.name]
        strip_defaults(value)
        if isinstance(value, list):
            for item in value:
                strip_defaults(item)
        if f.default_factory is not MISSING:
            default = f.default_factory()
        elif f.default is not MISSING:
            default = f.default
        else:
            continue  # a required field: every version had it
        if value == default:
            del record.__dict__[f.name]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(any_command, max_size=25), any_command)
def test_any_state_whose_defaulted_fields_are_missing_restores_to_the_same_state(
    log: list[dict[str, Any]], then: dict[str, Any]
) -> None:
    m = StateMachine()
    for command in log:
        m.apply(copy.deepcopy(command))
    digest, assignments = m.digest(), m.assignments()
    old = copy.deepcopy(m)
    for record in [*old.nodes.values(), *old.jobs.values(), *old.tasks.values()]:
        strip_defaults(record)
    del old.__dict__["_by_node"]
    del old.__dict__["_published"]
    restored: StateMachine = pickle.loads(pickle.dumps(old))
    assert restored.digest() == digest
    assert restored.assignments() == assignments
    assert restored.apply(copy.deepcopy(then)) == m.apply(copy.deepcopy(then))
    assert restored.digest() == m.digest()
