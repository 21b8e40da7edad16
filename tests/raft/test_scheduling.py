"""The leader's scheduling rounds over a real StateMachine: conversion of the replicated state
into the scheduler's inputs (hypothesis: no task lost or duplicated), placement, re-placement
of a dead node's tasks, refusals, balancing and draining, idempotence across leaders."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.raft.commands import make_command
from shoal.raft.machine import StateMachine
from shoal.raft.model import LEARNER_KIND
from shoal.raft.scheduling_decide import Memory, Round, decide
from shoal.raft.scheduling_inputs import ACTIVE, read_inputs
from shoal.scheduler.reservations import Reservations
from shoal.scheduler.signals import BalancerConfig

GIB = 1 << 30
_ids = itertools.count()


def run(m: StateMachine, op: str, args: dict[str, Any], at: float = 1000.0) -> dict[str, Any]:
    return m.apply(make_command(op, args, f"t{next(_ids)}", at))


def apply_round(m: StateMachine, rnd: Round, at: float = 1000.0) -> list[dict[str, Any]]:
    """What SchedulerLoop._commit does: actions, then the events of the applied ones. Returns
    the events posted, the `refused` ones the machine posts for a new pending reason last."""
    applied = {""}
    refusals = []
    for c in rnd.commands:
        if c.op == "add_event":
            continue
        result = m.apply(make_command(c.op, c.args, c.op_id, at))
        if result["ok"]:
            applied.add(c.op_id)
        if c.op == "set_pending_reason" and result.get("changed"):
            e = m.events[-1]
            refusals.append({"kind": e.kind, "message": e.message, "fields": e.fields})
    events = [c for c in rnd.commands if c.op == "add_event" and c.needs in applied]
    for c in events:
        m.apply(make_command(c.op, c.args, c.op_id, at))
    return [c.args for c in events] + refusals


def add_node(
    m: StateMachine,
    name: str,
    gpus: int = 8,
    island_size: int = 8,
    cpus: float = 16,
    host: str = "",
) -> None:
    run(
        m,
        "register_node",
        {
            "node_id": name,
            "address": f"shoal://{host or name}:1",
            "resources": {
                "cpus": cpus,
                "memory": 64 * GIB,
                "gpus": [
                    {
                        "index": i,
                        "uuid": f"{name}-{i}",
                        "island": f"{name}/nvl{i // island_size}",
                        "domain": "rdma0",
                    }
                    for i in range(gpus)
                ],
            },
        },
    )


def submit(
    m: StateMachine, job: str, rollouts: int = 0, ranks: int = 0, gpus: int = 0, mode: str = "auto"
) -> None:
    tasks = [
        {"task_id": f"{job}-r{i}", "kind": "rollout", "actor": "a.b:C", "resources": {"cpus": 1}}
        for i in range(rollouts)
    ] + [
        {
            "task_id": f"{job}-l{i}",
            "kind": LEARNER_KIND,
            "actor": "a.b:main",
            "resources": {"cpus": 1, "gpus": gpus},
        }
        for i in range(ranks)
    ]
    spec = {"placement": mode}
    assert run(m, "submit_job", {"job_id": job, "spec": spec, "tasks": tasks})["ok"]


def one_round(m: StateMachine, memory: Memory, now: float = 1000.0) -> list[dict[str, Any]]:
    rnd = decide(read_inputs(m), memory, now, BalancerConfig())
    return apply_round(m, rnd, now)


def health(m: StateMachine, at: float, **per_node: dict[str, Any]) -> None:
    reports = [
        {"node_id": n, "health": {"summary": {"node": n, **h}}, "last_heartbeat": at}
        for n, h in per_node.items()
    ]
    assert run(m, "report_health", {"reports": reports}, at)["ok"]


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["kind"] for e in events]


# -- conversion ------------------------------------------------------------------------------

node_st = st.tuples(st.integers(0, 8), st.sampled_from(["alive", "suspect", "dead"]), st.booleans())
task_st = st.tuples(
    st.booleans(),  # learner
    st.integers(0, 3),  # gpus
    st.one_of(st.none(), st.integers(0, 4)),  # node index (None: unplaced)
    st.sampled_from(["pending", "running", "stopped", "failed"]),
    st.booleans(),  # its job is placed automatically
)


def build(
    nodes: list[tuple[int, str, bool]], tasks: list[tuple[bool, int, int | None, str]]
) -> StateMachine:
    m = StateMachine()
    for i, (gpus, _, _) in enumerate(nodes):
        add_node(m, f"n{i}", gpus, island_size=4, cpus=4)
    specs = [
        {
            "task_id": f"t{i}",
            "kind": LEARNER_KIND if learner else "rollout",
            "actor": "a.b:C",
            "resources": {"cpus": 1, "gpus": gpus, "memory": GIB},
        }
        for i, (learner, gpus, _, _, _) in enumerate(tasks)
    ]
    for mode in ("auto", "manual"):
        mine = [spec for spec, t in zip(specs, tasks) if t[4] == (mode == "auto")]
        run(m, "submit_job", {"job_id": mode, "spec": {"placement": mode}, "tasks": mine})
    for i, (_, _, node, state, _) in enumerate(tasks):
        if node is not None and node < len(nodes):
            run(m, "place_tasks", {"placements": [{"task_id": f"t{i}", "node_id": f"n{node}"}]})
        run(m, "set_task_state", {"task_id": f"t{i}", "state": state})
    for i, (_, liveness, cordoned) in enumerate(nodes):
        run(m, "set_liveness", {"changes": [{"node_id": f"n{i}", "liveness": liveness}]})
        run(m, "set_cordon", {"node_id": f"n{i}", "cordoned": cordoned})
    return m


@settings(max_examples=60, deadline=None)
@given(st.lists(node_st, min_size=1, max_size=5), st.lists(task_st, max_size=12))
def test_every_active_task_is_placed_or_pending_exactly_once(nodes: Any, tasks: Any) -> None:
    m = build(nodes, tasks)
    inputs = read_inputs(m)
    placed = [p.task for p in inputs.placements]
    active = {t.id for t in m.tasks.values() if t.state in ACTIVE}
    assert sorted(placed + list(inputs.pending) + list(inputs.held)) == sorted(active)
    assert all(m.jobs[m.tasks[t].job_id].spec["placement"] == "auto" for t in inputs.pending)
    dead = {n.id for n in m.nodes.values() if n.liveness == "dead"}
    assert all(p.node not in dead for p in inputs.placements)
    for t in inputs.pending + inputs.held:
        assert m.tasks[t].node in dead or m.tasks[t].node is None
    Reservations(inputs.topology, inputs.placements)  # nothing over-committed, no GPU twice


@settings(max_examples=40, deadline=None)
@given(st.lists(node_st, min_size=1, max_size=5), st.lists(task_st, max_size=12))
def test_a_round_places_each_pending_task_once_and_loses_none(nodes: Any, tasks: Any) -> None:
    m = build(nodes, tasks)
    before = {t.id: (t.generation, t.state) for t in m.tasks.values()}
    inputs = read_inputs(m)
    events = one_round(m, Memory())
    after = read_inputs(m)
    restarted = {t for e in m.events if e.kind == "restart" for t in e.fields["tasks"]}
    gave_up = {t.id for t in m.tasks.values() if m.jobs[t.job_id].state == "failed"}
    # every failure of an auto job restarts, unless its job ran out of restarts
    assert restarted | gave_up >= {f.id for f in inputs.failures}
    active_after = [p.task for p in after.placements] + list(after.pending + after.held)
    active_before = [p.task for p in inputs.placements] + list(inputs.pending + inputs.held)
    assert sorted(active_after) == sorted((set(active_before) | restarted) - gave_up)
    for task_id, (generation, _) in before.items():
        moved = m.tasks[task_id].generation - generation
        placed = task_id in inputs.pending and task_id not in {*after.pending, *gave_up}
        assert moved == (1 if task_id in restarted or placed else 0)
    said = {e["fields"]["task"] for e in events if e["kind"] in ("placement", "replace", "refused")}
    assert said == set(inputs.pending) - restarted - gave_up
    Reservations(after.topology, after.placements)


# -- placement ---------------------------------------------------------------------------------


def test_learner_group_is_gang_placed_on_one_island_and_rollouts_spread() -> None:
    m = StateMachine()
    for name in ("a", "b", "c"):
        add_node(m, name, gpus=8, island_size=4)
    submit(m, "job", rollouts=3, ranks=2, gpus=2)
    events = one_round(m, Memory())
    ranks = [m.tasks[f"job-l{i}"] for i in range(2)]
    assert len({t.node for t in ranks}) == 1
    assert all(t.generation == 1 for t in ranks)
    rank_events = [e for e in events if e["fields"]["task"].startswith("job-l")]
    assert all("gang-placed on NVLink island" in e["message"] for e in rank_events)
    spread = {m.tasks[f"job-r{i}"].node for i in range(3)}
    assert spread == {"a", "b", "c"} - {ranks[0].node}  # least reserved load first
    assert one_round(m, Memory()) == []  # nothing pending: nothing decided


def test_group_too_big_is_refused_once_with_the_reason_and_stays_pending() -> None:
    m = StateMachine()
    add_node(m, "a", gpus=4, island_size=4)
    submit(m, "big", ranks=2, gpus=4)
    memory = Memory()
    events = one_round(m, memory)
    assert kinds(events) == ["refused", "refused"]
    assert "needs 8 GPUs" in events[0]["message"]
    assert "stays pending" in events[0]["message"]
    assert all(t.state == "pending" and t.node is None for t in m.tasks.values())
    assert one_round(m, memory) == []  # same reason: not posted again
    assert one_round(m, Memory()) == []  # nor by a new leader: the reason is replicated
    reasons = {t.pending_reason for t in m.tasks.values()}
    assert len(reasons) == 1
    assert f"big-l0 stays pending: {reasons.pop()}" == events[0]["message"]


def test_a_group_no_island_or_domain_could_ever_hold_says_so_and_what_is_largest() -> None:
    m = StateMachine()
    add_node(m, "a", gpus=8, island_size=4)
    add_node(m, "b", gpus=8, island_size=8)
    submit(m, "huge", ranks=1, gpus=16)
    one_round(m, Memory())
    reason = m.tasks["huge-l0"].pending_reason
    assert "learner group 'huge' needs 16 GPUs (1 ranks × 16" in reason
    assert "the largest NVLink island holds 8 GPUs (b/nvl0)" in reason
    assert "the most GPUs on one node is 8" in reason
    assert reason.endswith("ask for fewer GPUs (ranks × GPUs per rank) or add larger nodes")
    add_node(m, "c", gpus=16, island_size=16)  # hardware that can hold it: placed, reason gone
    one_round(m, Memory())
    task = m.tasks["huge-l0"]
    assert (task.node, task.gpus, task.pending_reason) == ("c", list(range(16)), "")


def test_a_full_cluster_says_to_free_resources_not_that_it_never_fits() -> None:
    m = StateMachine()
    add_node(m, "a", gpus=4, island_size=4)
    submit(m, "first", ranks=1, gpus=4)
    one_round(m, Memory())
    submit(m, "second", ranks=1, gpus=4)
    one_round(m, Memory())
    reason = m.tasks["second-l0"].pending_reason
    assert reason.endswith("free resources, add nodes or shrink the group")
    run(m, "stop_job", {"job_id": "first"})
    one_round(m, Memory())
    assert m.tasks["second-l0"].gpus == [0, 1, 2, 3]


def test_placements_carry_their_gpus_and_a_new_leader_reserves_the_same_ones() -> None:
    """GPUs are replicated on the task: a leader that never chose them (a failover) still
    counts them held, so a later placement cannot be given the same GPUs."""
    m = StateMachine()
    add_node(m, "a", gpus=4, island_size=4)
    submit(m, "one", ranks=1, gpus=2)
    submit(m, "two", ranks=1, gpus=2)
    one_round(m, Memory())
    one_gpus, two_gpus = m.tasks["one-l0"].gpus, m.tasks["two-l0"].gpus
    assert sorted(one_gpus + two_gpus) == [0, 1, 2, 3]
    placed = [e for e in m.events if e.kind == "task_placed"]
    assert sorted(e.fields["gpus"] for e in placed) == sorted([one_gpus, two_gpus])
    held = next(p for p in read_inputs(m).placements if p.task == "two-l0")
    assert list(held.gpus) == two_gpus
    run(m, "stop_job", {"job_id": "one"})
    submit(m, "three", ranks=1, gpus=2)
    one_round(m, Memory())  # a fresh leader's memory
    assert m.tasks["three-l0"].gpus == one_gpus
    assert m.tasks["two-l0"].gpus == two_gpus


def test_dead_nodes_tasks_are_replaced_elsewhere_and_suspect_ones_wait() -> None:
    m = StateMachine()
    for name in ("a", "b", "c"):
        add_node(m, name)
    submit(m, "job", rollouts=6)
    one_round(m, Memory())
    on_a = [t.id for t in m.tasks.values() if t.node == "a"]
    on_b = [t.id for t in m.tasks.values() if t.node == "b"]
    run(m, "set_liveness", {"changes": [{"node_id": "b", "liveness": "suspect"}]})
    assert one_round(m, Memory()) == []
    run(m, "set_liveness", {"changes": [{"node_id": "a", "liveness": "dead"}]})
    events = one_round(m, Memory())
    assert kinds(events) == ["replace"] * len(on_a)
    assert all(m.tasks[t].node == "c" and m.tasks[t].generation == 2 for t in on_a)
    assert all(m.tasks[t].node == "b" for t in on_b)  # suspect: left alone
    assert "was on dead node a" in events[0]["message"]


def test_a_new_leader_deciding_from_the_same_state_does_not_place_twice() -> None:
    m = StateMachine()
    add_node(m, "a")
    add_node(m, "b")
    submit(m, "job", rollouts=2, ranks=1, gpus=1)
    stale = read_inputs(m)
    first = decide(stale, Memory(), 1000.0, BalancerConfig())
    second = decide(stale, Memory(), 1000.0, BalancerConfig())
    assert [c.op_id for c in first.commands] == [c.op_id for c in second.commands]
    apply_round(m, first)
    apply_round(m, second)
    assert all(t.generation == 1 for t in m.tasks.values())
    assert sum(e.kind == "placement" for e in m.events) == 3


# -- balancing -----------------------------------------------------------------------------------

IDLE = {"cpu": 0.1, "gpu_util": 0.1}
BUSY = {"cpu": 0.1, "gpu_util": 0.97}


def test_sustained_overload_migrates_a_rollout_with_the_reason() -> None:
    m = StateMachine()
    for name in ("a", "b"):
        add_node(m, name)
    submit(m, "job", rollouts=4)
    memory = Memory()
    one_round(m, memory)
    hot = [t.id for t in m.tasks.values() if t.node == "a"]
    health(m, 1001.0, a=BUSY, b=IDLE)
    assert "migration" not in kinds(one_round(m, memory, 1001.0))  # one report: not yet
    assert one_round(m, memory, 1001.5) == []  # the same health batch: not counted twice
    health(m, 1002.0, a=BUSY, b=IDLE)
    events = one_round(m, memory, 1002.0)
    migrations = [e for e in events if e["kind"] == "migration"]
    assert migrations
    assert "relieve a" in migrations[0]["message"]
    assert any(e["kind"] == "balance" and "gpu_util 0.97" in e["message"] for e in events)
    moved = migrations[0]["fields"]["task"]
    assert moved in hot
    assert m.tasks[moved].node == "b"
    assert m.tasks[moved].generation == 2


def test_an_xid_cordons_and_drains_the_node_and_moves_its_rollouts() -> None:
    m = StateMachine()
    for name in ("a", "b", "c"):
        add_node(m, name)
    submit(m, "job", rollouts=3, ranks=1, gpus=2)
    memory = Memory()
    one_round(m, memory)
    rank_node = m.tasks["job-l0"].node
    assert rank_node is not None
    on_it = [t.id for t in m.tasks.values() if t.node == rank_node and t.kind == "rollout"]
    health(m, 1001.0, **{n: IDLE for n in "abc"} | {rank_node: {**IDLE, "xid_errors": 1}})
    events = one_round(m, memory, 1001.0)
    node = m.nodes[rank_node]
    assert node.draining
    assert node.cordoned
    cordon = [e for e in events if e["kind"] == "cordon"]
    assert cordon
    assert "1 new XID error(s)" in cordon[0]["message"]
    assert all(m.tasks[t].node != rank_node for t in on_it)
    hold = [e for e in events if e["kind"] == "balance" and e["fields"]["action"] == "hold"]
    assert hold
    assert m.tasks["job-l0"].node == rank_node


def test_manual_jobs_are_left_alone_and_a_bad_mode_is_reported_once() -> None:
    m = StateMachine()
    add_node(m, "a")
    submit(m, "hand", rollouts=1, mode="manual")
    submit(m, "typo", rollouts=1, mode="atuo")
    memory = Memory()
    events = one_round(m, memory)
    assert kinds(events) == ["refused"]
    assert "spec.placement='atuo'" in events[0]["message"]
    assert all(t.node is None for t in m.tasks.values())
    assert one_round(m, memory) == []


def test_nodes_sharing_a_host_are_judged_on_their_own_signals_not_the_hosts_cpu() -> None:
    m = StateMachine()
    add_node(m, "a", host="box")
    add_node(m, "b", host="box")
    add_node(m, "c")
    hot = {"cpu": 1.0, "memory": 0.9, "gpu_util": 0.2}
    health(m, 1001.0, a=hot, b=hot, c=hot)
    by_node = {h.node: h for h in read_inputs(m).health}
    assert (by_node["a"].cpu, by_node["a"].memory, by_node["a"].gpu_util) == (0.0, 0.0, 0.2)
    assert by_node["b"].cpu == 0.0
    assert by_node["c"].cpu == 1.0  # alone on its host: the host's CPU is its own
