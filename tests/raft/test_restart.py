"""The leader restarts what failed: OTP-style restart intensity per job, learner groups as one
gang, stopped jobs left alone. Rounds run over a real StateMachine, as the loop commits them
(tests/raft/test_scheduling.py helpers); hypothesis drives failures, time and leader changes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.raft.commands import make_command, validate_args
from shoal.raft.config import LivenessConfig, SchedulingConfig
from shoal.raft.errors import ValidationError
from shoal.raft.machine import StateMachine
from shoal.raft.model import LEARNER_KIND
from shoal.raft.scheduling_decide import Memory, decide
from shoal.raft.scheduling_inputs import read_inputs
from shoal.scheduler.signals import BalancerConfig
from tests.raft.inprocess import InProcessReplica
from tests.raft.test_scheduling import add_node, apply_round, run
from tests.support.waiting import eventually

RANKS = 2
ROLLOUTS = 3


def submit(m: StateMachine, job: str, restart: dict[str, Any] | None, at: float = 0.0) -> None:
    tasks = [
        {"task_id": f"{job}-r{i}", "kind": "rollout", "actor": "a.b:C", "resources": {"cpus": 1}}
        for i in range(ROLLOUTS)
    ] + [
        {
            "task_id": f"{job}-l{i}",
            "kind": LEARNER_KIND,
            "actor": "a.b:main",
            "resources": {"cpus": 1, "gpus": 1},
        }
        for i in range(RANKS)
    ]
    spec: dict[str, Any] = {"placement": "auto"}
    if restart is not None:
        spec["restart"] = restart
    assert run(m, "submit_job", {"job_id": job, "spec": spec, "tasks": tasks}, at)["ok"]


def settle(m: StateMachine, now: float) -> None:
    """Rounds until nothing is decided; every placed copy reports running (as agents do)."""
    for _ in range(5):
        rnd = decide(read_inputs(m), Memory(), now, BalancerConfig())
        apply_round(m, rnd, now)
        for t in m.tasks.values():
            if t.state == "pending" and t.node is not None:
                report = {"task_id": t.id, "state": "running", "generation": t.generation}
                assert run(m, "set_task_state", report, now)["ok"]
        if not rnd.commands:
            return
    raise AssertionError("the rounds did not settle")


def fail(m: StateMachine, task_id: str, now: float, why: str = "killed by SIGKILL") -> None:
    t = m.tasks[task_id]
    report = {"task_id": t.id, "state": "failed", "generation": t.generation, "message": why}
    assert run(m, "set_task_state", report, now)["ok"]


def cluster(restart: dict[str, Any] | None = None) -> StateMachine:
    m = StateMachine()
    for name in ("a", "b", "c"):
        add_node(m, name, gpus=4, island_size=4)
    submit(m, "job", restart)
    settle(m, 0.0)
    return m


def restarts(m: StateMachine) -> list[Any]:
    return [e for e in m.events if e.kind == "restart"]


# -- the contract, example by example -----------------------------------------------------------


def test_a_failed_rollout_restarts_alone_with_the_count_in_the_event() -> None:
    m = cluster()
    ranks_before = {f"job-l{i}": m.tasks[f"job-l{i}"].generation for i in range(RANKS)}
    fail(m, "job-r1", 10.0, "exited with status 3")
    settle(m, 10.0)
    [event] = restarts(m)
    assert event.message == (
        "job job: task job-r1 failed: exited with status 3; restart 1 of 5 in 600 s"
    )
    assert event.fields["tasks"] == ["job-r1"]
    t = m.tasks["job-r1"]
    assert (t.state, t.restarts, t.generation) == ("running", 1, 3)
    assert {r: m.tasks[r].generation for r in ranks_before} == ranks_before
    assert m.jobs["job"].restarts == 1


def test_a_failed_learner_rank_restarts_its_whole_group_as_one_gang() -> None:
    m = cluster()
    before = {t.id: t.generation for t in m.tasks.values()}
    fail(m, "job-l1", 10.0)
    fail(m, "job-l0", 10.0, "collective on rank 0 failed")  # its peer died: it fails too
    settle(m, 10.0)
    [event] = restarts(m)
    assert event.fields["tasks"] == ["job-l0", "job-l1"]
    assert "learner group of 2 restarts as one" in event.message
    assert "task job-l0 failed: collective on rank 0 failed" in event.message
    assert "task job-l1 failed: killed by SIGKILL" in event.message
    ranks = [m.tasks[f"job-l{i}"] for i in range(RANKS)]
    assert all(r.generation == before[r.id] + 2 and r.state == "running" for r in ranks)
    assert len({r.node for r in ranks}) == 1  # gang-placed again on one island
    assert all(m.tasks[f"job-r{i}"].generation == before[f"job-r{i}"] for i in range(ROLLOUTS))
    placed = [e for e in m.events if e.kind == "placement" and e.fields["task"] == "job-l0"]
    assert len(placed) == 2  # the first placement and the restart's


def test_a_dead_node_takes_the_whole_learner_group_down_uncounted() -> None:
    m = StateMachine()
    for name in ("a", "b"):
        add_node(m, name, gpus=1, island_size=1)
    submit(m, "job", None)
    settle(m, 0.0)
    nodes = {m.tasks[f"job-l{i}"].node for i in range(RANKS)}
    assert nodes == {"a", "b"}  # one GPU a node: the group spans both
    add_node(m, "c", gpus=2, island_size=2)
    run(m, "set_liveness", {"changes": [{"node_id": "a", "liveness": "dead"}]})
    settle(m, 5.0)
    [event] = restarts(m)
    assert "was on dead node a" in event.message
    assert "not counted" in event.message
    assert not m.jobs["job"].restart_times
    assert {m.tasks[f"job-l{i}"].node for i in range(RANKS)} == {"c"}


def test_past_the_intensity_the_job_fails_naming_the_last_failure_and_stops_its_tasks() -> None:
    m = cluster({"max_restarts": 2, "window_s": 60})
    for i, now in enumerate((10.0, 20.0)):
        fail(m, "job-r0", now)
        settle(m, now)
        assert f"; restart {i + 1} of 2 in 60 s" in restarts(m)[-1].message
    fail(m, "job-r0", 30.0, "killed by SIGKILL")
    settle(m, 30.0)
    job = m.jobs["job"]
    assert job.state == "failed"
    assert job.message == "task job-r0 failed: killed by SIGKILL; gave up after 2 restarts in 60 s"
    assert all(t.state in ("stopped", "failed") for t in m.tasks.values())
    assert [e.kind for e in m.events][-1] == "job_failed"
    assert run(m, "stop_job", {"job_id": "job"}, 31.0)["job"]["state"] == "failed"


def test_restarts_outside_the_window_do_not_count() -> None:
    m = cluster({"max_restarts": 1, "window_s": 60})
    for now in (10.0, 100.0, 200.0):
        fail(m, "job-r0", now)
        settle(m, now)
    assert m.jobs["job"].state == "running"
    assert m.jobs["job"].restarts == 3


def test_a_new_leader_repeating_a_restart_applies_it_once() -> None:
    m = cluster()
    fail(m, "job-l0", 10.0)
    stale = read_inputs(m)
    first = decide(stale, Memory(), 10.0, BalancerConfig())
    second = decide(stale, Memory(), 10.0, BalancerConfig())
    assert [c.op_id for c in first.commands] == [c.op_id for c in second.commands]
    apply_round(m, first, 10.0)
    # A new leader with a fresh applied-op table still refuses it: the generation moved on.
    for c in second.commands:
        if c.op == "restart_tasks":
            again = m.apply(make_command(c.op, c.args, "other-op-id", 10.0))
            assert again["ok"] is False
            assert "stale restart" in again["message"]
    assert len(restarts(m)) == 1


def test_manual_and_stopped_jobs_never_restart() -> None:
    m = cluster()
    run(m, "stop_job", {"job_id": "job"}, 5.0)
    fail(m, "job-r0", 6.0)
    settle(m, 6.0)
    assert restarts(m) == []
    manual = StateMachine()
    add_node(manual, "a")
    spec = {"placement": "manual"}
    task = {"task_id": "t", "kind": "rollout", "actor": "a.b:C"}
    run(manual, "submit_job", {"job_id": "hand", "spec": spec, "tasks": [task]})
    run(manual, "place_tasks", {"placements": [{"task_id": "t", "node_id": "a"}]})
    fail(manual, "t", 1.0)
    settle(manual, 1.0)
    assert restarts(manual) == []
    assert manual.tasks["t"].state == "failed"


@pytest.mark.parametrize(
    ("restart", "field"),
    [
        ({"max_restarts": -1}, "args.spec.restart.max_restarts"),
        ({"max_restarts": 1.5}, "args.spec.restart.max_restarts"),
        ({"window_s": 0}, "args.spec.restart.window_s"),
        ({"window_s": "10"}, "args.spec.restart.window_s"),
        ({"windows": 10}, "args.spec.restart.windows"),
        ({"backoff_s": -1}, "args.spec.restart.backoff_s"),
        ({"backoff_s": 90}, "args.spec.restart.backoff_max_s"),
        ({"backoff_s": 2, "backoff_max_s": 1}, "args.spec.restart.backoff_max_s"),
        ({"backoff_max_s": "1m"}, "args.spec.restart.backoff_max_s"),
        ("often", "args.spec.restart"),
    ],
)
def test_a_bad_restart_policy_is_refused_at_submit_naming_the_field(
    restart: Any, field: str
) -> None:
    with pytest.raises(ValidationError) as info:
        validate_args("submit_job", {"job_id": "j", "spec": {"restart": restart}})
    assert info.value.field == field


# -- properties -------------------------------------------------------------------------------

TASKS = [f"job-r{i}" for i in range(ROLLOUTS)] + [f"job-l{i}" for i in range(RANKS)]
step_st = st.tuples(
    st.sets(st.sampled_from(TASKS), min_size=1),  # the tasks that fail in this step
    st.floats(0.0, 50.0),  # seconds since the previous step
    st.booleans(),  # a second leader decides again from the same, stale, inputs
)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 4),
    st.floats(1.0, 120.0),
    st.lists(step_st, min_size=1, max_size=8),
)
def test_each_failure_restarts_once_groups_together_and_the_job_fails_exactly_past_the_limit(
    limit: int, window: float, steps: list[tuple[set[str], float, bool]]
) -> None:
    m = cluster({"max_restarts": limit, "window_s": window})
    now, counted = 0.0, []  # the model: when each counted restart happened
    for failing, dt, replay in steps:
        if m.jobs["job"].state != "running":
            break
        now += dt
        before = {t.id: t.generation for t in m.tasks.values()}
        for task_id in sorted(failing):
            fail(m, task_id, now)
        seen = len(restarts(m))
        inputs = read_inputs(m)
        rnd = decide(inputs, Memory(), now, BalancerConfig())
        apply_round(m, rnd, now)
        if replay:
            apply_round(m, decide(inputs, Memory(), now, BalancerConfig()), now)
        units = sorted(t for t in failing if not t.startswith("job-l"))
        if any(t.startswith("job-l") for t in failing):
            units.append("group")
        applied = restarts(m)[seen:]
        for i, _ in enumerate(units):
            counted = [t for t in counted if t > now - window]
            if len(counted) >= limit:
                assert m.jobs["job"].state == "failed"
                assert len(applied) == i
                assert "gave up after" in m.jobs["job"].message
                break
            counted.append(now)
        else:
            assert m.jobs["job"].state == "running"
            assert len(applied) == len(units)
            for task_id in failing:  # exactly one restart covers each failure
                assert sum(task_id in e.fields["tasks"] for e in applied) == 1
            if "group" in units:
                assert all(
                    m.tasks[f"job-l{i}"].generation == before[f"job-l{i}"] + 1 for i in range(RANKS)
                )
        settle(m, now)
    if m.jobs["job"].state == "failed":
        settle(m, now + 1)
        assert all(t.state in ("stopped", "failed") for t in m.tasks.values())


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.sets(st.sampled_from(TASKS)), min_size=1, max_size=4),
    st.sampled_from(["stop_job", "fail_job"]),
)
def test_a_stopped_or_failed_job_never_restarts(failures: list[set[str]], how: str) -> None:
    m = cluster({"max_restarts": 0, "window_s": 60} if how == "fail_job" else None)
    if how == "stop_job":
        assert run(m, "stop_job", {"job_id": "job"}, 1.0)["ok"]
    else:
        fail(m, "job-r0", 1.0)
        settle(m, 1.0)  # max_restarts 0: the first failure fails the job
    ended = m.jobs["job"].state
    assert ended == ("stopped" if how == "stop_job" else "failed")
    seen = len(restarts(m))
    generations = {t.id: t.generation for t in m.tasks.values()}
    for step, failing in enumerate(failures):
        now = 2.0 + step
        for task_id in sorted(failing):
            fail(m, task_id, now)  # late reports from processes still exiting
        settle(m, now)
    assert len(restarts(m)) == seen
    assert {t.id: t.generation for t in m.tasks.values()} == generations
    assert m.jobs["job"].state == ended
    assert all(t.state in ("stopped", "failed") for t in m.tasks.values())


@pytest.mark.timeout(60)
def test_the_api_answers_a_bad_restart_policy_with_422_naming_the_field(tmp_path: Path) -> None:
    replica = InProcessReplica(tmp_path)
    try:
        replica.start()
        body = {"job_id": "j", "spec": {"restart": {"max_restarts": 3, "window_s": -5}}}
        status, answer = replica.request("POST", "/v1/jobs", body)
        assert status == 422  # the API's status for every invalid field
        assert answer["field"].endswith("spec.restart.window_s")
        assert "must be" in answer["message"]
        body["spec"] = {"restart": {"max_restarts": 3, "window_s": 30}}
        status, answer = replica.request("POST", "/v1/jobs", body)
        assert status == 201
        assert answer["spec"]["restart"] == {"max_restarts": 3, "window_s": 30}
    finally:
        replica.close()


def test_a_rank_moved_off_a_faulty_node_restarts_its_whole_group() -> None:
    m = StateMachine()
    for name in ("a", "b", "c"):
        add_node(m, name, gpus=1, island_size=1)
    submit(m, "job", None)
    settle(m, 0.0)
    where = {r: m.tasks[r].node for r in ("job-l0", "job-l1")}
    assert len(set(where.values())) == 2  # one GPU a node: the group spans two
    checkpoint = {
        "job_id": "job",
        "path": "/ck/1",
        "step": 1,
        "sha256": "ab" * 32,
        "complete": True,
    }
    assert run(m, "record_checkpoint", checkpoint, 1.0)["ok"]  # a boundary: ranks may move
    faulty = where["job-l0"]
    before = {r: m.tasks[r].generation for r in where}
    idle = {"cpu": 0.1, "gpu_util": 0.1}
    reports = [
        {
            "node_id": n,
            "health": {"summary": {"node": n, **idle, "xid_errors": int(n == faulty)}},
            "last_heartbeat": 2.0,
        }
        for n in ("a", "b", "c")
    ]
    assert run(m, "report_health", {"reports": reports}, 2.0)["ok"]
    memory = Memory()
    rnd = decide(read_inputs(m), memory, 2.0, BalancerConfig())
    places = [c for c in rnd.commands if c.op == "place_tasks"]
    assert len(places) == 1  # one command for the whole group
    apply_round(m, rnd, 2.0)
    assert m.nodes[faulty].draining
    assert m.tasks["job-l0"].node not in (faulty, None)
    assert m.tasks["job-l1"].node == where["job-l1"]  # placed again where it was
    assert all(m.tasks[r].generation == before[r] + 1 for r in where)
    [event] = restarts(m)
    assert "restarts as one from its checkpoint" in event.message
    assert event.fields["counted"] is False
    assert not m.jobs["job"].restart_times


def test_a_restart_whose_cause_is_not_among_its_tasks_is_refused_before_proposing() -> None:
    args = {
        "job_id": "j",
        "cause": "a",
        "generation": 1,
        "tasks": ["b"],
        "reason": "x",
        "counted": True,
    }
    with pytest.raises(ValidationError) as info:
        validate_args("restart_tasks", args)
    assert info.value.field == "args.cause"


# -- tasks that stop while their job runs ------------------------------------------------------


def stop(m: StateMachine, task_id: str, now: float, why: str) -> None:
    t = m.tasks[task_id]
    report = {"task_id": t.id, "state": "stopped", "generation": t.generation, "message": why}
    assert run(m, "set_task_state", report, now)["ok"]


def drain(m: StateMachine, node: str, now: float) -> list[str]:
    """What a node daemon does on SIGTERM: mark its node draining, stop and report its tasks."""
    assert run(m, "set_draining", {"node_id": node, "draining": True}, now)["ok"]
    there = [t.id for t in m.tasks.values() if t.node == node and t.state == "running"]
    for task_id in there:
        stop(m, task_id, now, f"node {node} drained")
    return there


def test_a_drained_nodes_tasks_run_again_elsewhere_uncounted_a_learner_group_as_one() -> None:
    m = cluster({"max_restarts": 0, "window_s": 60})  # any counted restart would fail the job
    learners = m.tasks["job-l0"].node
    assert learners is not None
    stopped = drain(m, learners, 10.0)
    assert "job-l0" in stopped
    assert "job-l1" in stopped
    settle(m, 10.0)
    job = m.jobs["job"]
    assert (job.state, job.restart_times) == ("running", [])
    assert all(t.state == "running" and t.node != learners for t in m.tasks.values())
    assert len({m.tasks[f"job-l{i}"].node for i in range(RANKS)}) == 1  # one gang again
    group = [e for e in restarts(m) if "job-l0" in e.fields["tasks"]]
    [event] = group
    assert event.fields["tasks"] == ["job-l0", "job-l1"]
    assert event.fields["counted"] is False
    assert f"task job-l0 stopped: node {learners} drained (its node {learners} went away" in (
        event.message
    )
    assert "not counted toward the limit" in event.message
    assert len(restarts(m)) == 1 + sum(1 for t in stopped if t.startswith("job-r"))


def test_a_task_that_exits_0_on_its_own_restarts_and_counts() -> None:
    m = cluster({"max_restarts": 1, "window_s": 60})
    stop(m, "job-r2", 10.0, "exited with status 0")
    settle(m, 10.0)
    [event] = restarts(m)
    assert event.message == (
        "job job: task job-r2 stopped: exited with status 0 (it ended on its own while its job "
        "runs); restart 1 of 1 in 60 s"
    )
    assert m.tasks["job-r2"].state == "running"
    stop(m, "job-l1", 11.0, "exited with status 0")  # a learner rank: its group, counted
    settle(m, 11.0)
    assert m.jobs["job"].state == "failed"
    assert "gave up after 1 restarts in 60 s" in m.jobs["job"].message


def test_a_peer_rank_that_fails_because_its_partner_was_drained_is_not_counted() -> None:
    m = StateMachine()
    for name in ("a", "b", "c", "d"):
        add_node(m, name, gpus=1, island_size=1)
    submit(m, "job", {"max_restarts": 0, "window_s": 60})
    settle(m, 0.0)
    rank0, rank1 = m.tasks["job-l0"].node, m.tasks["job-l1"].node
    assert rank0 is not None
    assert rank0 != rank1
    assert run(m, "set_draining", {"node_id": rank0, "draining": True}, 5.0)["ok"]
    fail(m, "job-l1", 5.0, "exited with status 3")  # its peer's report arrives first
    settle(m, 5.0)
    assert m.jobs["job"].state == "running"
    [event] = restarts(m)
    assert event.fields["counted"] is False
    assert all(m.tasks[f"job-l{i}"].node not in (rank0, None) for i in range(RANKS))


NODES = ("a", "b", "c", "d", "e", "f")
stop_st = st.tuples(
    st.sampled_from((None, *NODES)),  # the node whose daemon gets SIGTERM and drains, if any
    st.sets(st.sampled_from(TASKS)),  # tasks whose process exits 0 on its own
)


@settings(max_examples=50, deadline=None)
@given(st.lists(stop_st, min_size=1, max_size=3))
def test_every_task_that_stops_while_its_job_runs_runs_again_counted_only_on_its_own(
    steps: list[tuple[str | None, set[str]]],
) -> None:
    m = StateMachine()
    for name in NODES:
        add_node(m, name, gpus=4, island_size=4)
    submit(m, "job", {"max_restarts": 1000, "window_s": 1e6, "backoff_s": 0, "backoff_max_s": 0})
    settle(m, 0.0)
    now, counted = 0.0, 0
    for drained, exiting in steps:
        now += 100.0
        before = {t.id: (t.generation, t.node) for t in m.tasks.values()}
        gone = drain(m, drained, now) if drained is not None else []
        quits = sorted(t for t in exiting if t not in gone)
        for task_id in quits:
            stop(m, task_id, now, "exited with status 0")
        seen = len(restarts(m))
        apply_round(m, decide(read_inputs(m), Memory(), now, BalancerConfig()), now)
        ended = set(gone) | set(quits)
        ranks = [f"job-l{i}" for i in range(RANKS)]
        group = any(r in ended for r in ranks)
        group_gone = any(before[r][1] == drained for r in ranks)
        counted += sum(1 for t in quits if t not in ranks) + int(group and not group_gone)
        assert len(m.jobs["job"].restart_times) == counted
        for task_id in ended | (set(ranks) if group else set()):  # each restarted once
            assert m.tasks[task_id].generation == before[task_id][0] + 1
        units = len([t for t in ended if t not in ranks]) + int(group)
        assert len(restarts(m)) - seen == units
        settle(m, now)
        assert m.jobs["job"].state == "running"
        draining = {n.id for n in m.nodes.values() if n.draining}
        assert all(t.state == "running" and t.node not in draining for t in m.tasks.values())


# -- back-off between counted restarts ---------------------------------------------------------


def placed_now(m: StateMachine, task_id: str, now: float) -> bool:
    """Whether a round at `now` places the pending task (applied, as the loop commits it)."""
    apply_round(m, decide(read_inputs(m), Memory(), now, BalancerConfig()), now)
    return m.tasks[task_id].node is not None


def test_a_crash_loop_waits_0_then_1_2_4_seconds_capped_and_uncounted_restarts_never_wait() -> None:
    m = cluster({"max_restarts": 10, "window_s": 600, "backoff_s": 1, "backoff_max_s": 3})
    now = 10.0
    for delay in (0.0, 1.0, 2.0, 3.0, 3.0):
        fail(m, "job-r0", now)
        assert not placed_now(m, "job-r0", now)  # this round restarts it (the next places)
        if delay:
            assert not placed_now(m, "job-r0", now + delay - 0.01)
            assert f"placed again after a {delay:g} s back-off" in restarts(m)[-1].message
        assert m.tasks["job-r0"].due == now + delay
        assert restarts(m)[-1].fields["due"] == now + delay
        now += delay
        assert placed_now(m, "job-r0", now)
        settle(m, now)
        now += 1.0
    learners = m.tasks["job-l0"].node
    assert learners is not None
    drain(m, learners, now)  # the node went away: no back-off, even in a crash loop's window
    assert not placed_now(m, "job-l0", now)
    assert placed_now(m, "job-l0", now)
    assert all(m.tasks[f"job-l{i}"].due == now for i in range(RANKS))


restart_at_st = st.lists(st.floats(0.5, 40.0), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(
    st.one_of(st.just(0.0), st.floats(0.01, 5.0)),
    st.floats(0.0, 20.0),
    st.floats(5.0, 100.0),
    restart_at_st,
    st.sampled_from(["job-r1", "job-l0"]),
)
def test_each_counted_restart_is_due_after_its_back_off_and_placed_only_then(
    base: float, extra: float, window: float, gaps: list[float], task_id: str
) -> None:
    cap = base + extra
    policy = {"max_restarts": 100, "window_s": window, "backoff_s": base, "backoff_max_s": cap}
    m = cluster(policy)
    now, earlier = 0.0, []  # the model: when the counted restarts in the window happened
    for gap in gaps:
        now += gap
        fail(m, task_id, now)
        inputs = read_inputs(m)
        rnd = decide(inputs, Memory(), now, BalancerConfig())
        again = decide(inputs, Memory(), now, BalancerConfig())  # a new leader, same state
        assert [c.op_id for c in rnd.commands] == [c.op_id for c in again.commands]
        apply_round(m, rnd, now)
        earlier = [t for t in earlier if t > now - window]
        delay = 0.0 if not earlier else min(base * 2 ** (len(earlier) - 1), cap)
        earlier.append(now)
        assert m.tasks[task_id].due == now + delay
        assert m.tasks[task_id].node is None
        memory = Memory()
        if delay > 0:
            assert not placed_now(m, task_id, now + delay / 2)
            decide(read_inputs(m), memory, now, BalancerConfig())
            assert memory.wake == now + delay  # the loop re-reads then, with no other change
        now += delay
        assert placed_now(m, task_id, now)
        settle(m, now)
    assert m.jobs["job"].state == "running"


@pytest.mark.timeout(60)
def test_the_leader_places_a_task_when_its_back_off_ends_with_nothing_else_changing(
    tmp_path: Path,
) -> None:
    replica = InProcessReplica(
        tmp_path,
        scheduling=SchedulingConfig(period=0.05),
        liveness=LivenessConfig(suspect_after=60.0, dead_after=120.0),  # no other change
    )
    try:
        replica.start()
        node = {"node_id": "a", "address": "shoal://a:1", "resources": {"cpus": 4, "memory": 0}}
        assert replica.request("POST", "/v1/nodes", node)[0] == 201
        restart = {"max_restarts": 5, "window_s": 600, "backoff_s": 1.5, "backoff_max_s": 1.5}
        task = {"task_id": "t", "kind": "rollout", "actor": "a.b:C"}
        body = {"job_id": "j", "spec": {"restart": restart}, "tasks": [task]}
        assert replica.request("POST", "/v1/jobs", body)[0] == 201
        for _ in range(2):  # the second counted restart waits 1.5 s
            generation = wait_placed(replica)
            report = {"state": "failed", "generation": generation, "message": "exit 1"}
            assert replica.request("PUT", "/v1/tasks/t/state", report)[0] == 200
        failed_at = time.time()
        wait_placed(replica)
        assert time.time() - failed_at > 1.0  # not before its back-off
        _, answer = replica.request("GET", "/v1/tasks/t")
        assert answer["due"] >= failed_at + 1.0
    finally:
        replica.close()


def wait_placed(replica: InProcessReplica) -> int:
    def placed() -> int | None:
        _, task = replica.request("GET", "/v1/tasks/t")
        if task["node"] is not None and task["state"] == "pending":
            return int(task["generation"])
        return None

    return eventually(
        placed, "task t placed", detail=lambda: str(replica.request("GET", "/v1/tasks/t")[1])
    )
