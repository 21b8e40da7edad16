"""Balancer: hysteresis, cooldown, drains, make-before-break plans, and their invariants."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import ConfigError
from shoal.scheduler.balancer import BalancerConfig, balance
from shoal.scheduler.errors import SchedulerError
from shoal.scheduler.model import (
    BalancePlan,
    BalancerState,
    LearnerGroup,
    NodeHealth,
    Placement,
    RolloutActor,
)
from shoal.scheduler.placement import place
from shoal.scheduler.reservations import Reservations
from shoal.scheduler.topology import Topology, simulated_cluster

COOLDOWN = 60.0
LOADS = st.sampled_from([0.0, 0.1, 0.25, 0.4, 0.55, 0.7, 0.8, 0.9, 0.95, 1.0, 1.2])

# --- strategies ------------------------------------------------------------------------------


@st.composite
def clusters(
    draw: st.DrawFn, faults: bool = False
) -> tuple[Topology, tuple[Placement, ...], list[NodeHealth]]:
    """Nodes of equal capacity with rollout actors piled on unevenly, and a load per node;
    with `faults`, also XID errors, learner ranks and nodes already draining."""
    count = draw(st.integers(2, 8))
    topo = simulated_cluster(
        count,
        draw(st.sampled_from([0, 2])),
        island_size=2,
        nodes_per_domain=count,
        cpus=8.0,
        memory_mb=8192,
    )
    if faults:
        for node in topo.nodes:
            if draw(st.integers(0, 5)) == 0:
                topo = topo.with_state(node.name, "draining")
    reservations = Reservations(topo)
    if faults and topo.nodes[0].gpus:
        reservations.add(Placement("g/rank0", "node-0", "learner", gpus=(0,), cpus=1.0, group="g"))
    for i in range(draw(st.integers(0, 30))):
        node = topo.nodes[draw(st.integers(0, count - 1))]
        cpus = draw(st.sampled_from([0.5, 1.0, 2.0]))
        gpus = tuple(reservations.usage[node.name].free_gpus()[: draw(st.integers(0, 1))])
        p = Placement(
            f"a{i}",
            node.name,
            "rollout",
            gpus=gpus,
            cpus=cpus,
            memory_mb=256,
            movable=draw(st.booleans()) or i % 3 != 0,
        )
        if reservations.usage[node.name].fits(p.cpus, p.memory_mb):
            reservations.add(p)
    xids = st.sampled_from([0, 0, 0, 1]) if faults else st.just(0)
    health = [NodeHealth(n.name, cpu=draw(LOADS), xid_errors=draw(xids)) for n in topo.nodes]
    return topo, tuple(reservations.where.values()), health


@st.composite
def states(draw: st.DrawFn, topo: Topology) -> BalancerState:
    names = [n.name for n in topo.nodes]
    over = draw(st.sets(st.sampled_from(names)))
    streak = {n: draw(st.integers(0, 2)) for n in names}
    return BalancerState(
        overloaded=frozenset(over), streak=tuple(sorted((n, k) for n, k in streak.items() if k))
    )


def apply(placements: tuple[Placement, ...], plan: BalancePlan) -> tuple[Placement, ...]:
    moves = {m.task: m for m in plan.migrations}
    return tuple(
        p.moved_to(moves[p.task].target, moves[p.task].gpus) if p.task in moves else p
        for p in placements
    )


def projected_health(
    placements: tuple[Placement, ...], health: list[NodeHealth], plan: BalancePlan
) -> list[NodeHealth]:
    """The load follows the tasks: each task carries its reservation share of its node's load."""
    load = {h.node: h.cpu for h in health}
    by_node: dict[str, list[Placement]] = {}
    for p in placements:
        by_node.setdefault(p.node, []).append(p)
    share = {}
    for node, ps in by_node.items():
        weights = {p.task: p.cpus + len(p.gpus) for p in ps}
        total = sum(weights.values())
        for t, w in weights.items():
            share[t] = load[node] * (w / total if total else 1 / len(ps))
    where = {p.task: p.node for p in placements}
    for m in plan.migrations:
        load[where[m.task]] -= share[m.task]
        load[m.target] += share[m.task]
    return [NodeHealth(n, cpu=max(0.0, v)) for n, v in load.items()]


# --- properties ------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.data(), st.booleans(), st.booleans())
def test_plan_keeps_every_task_once_and_never_overcommits(data, faults, at_checkpoint):
    topo, placements, health = data.draw(clusters(faults))
    state = data.draw(states(topo))
    ckpt = frozenset({"g"}) if at_checkpoint else frozenset()
    plan = balance(topo, placements, health, state, 1000.0, checkpoint_groups=ckpt)
    after = apply(placements, plan)
    Reservations(topo, after)  # refuses over-commit, unknown GPUs and duplicates
    assert sorted(p.task for p in after) == sorted(p.task for p in placements)
    tasks = [m.task for m in plan.migrations]
    assert len(tasks) == len(set(tasks))
    where = {p.task: p for p in placements}
    ready = {n.name for n in topo.nodes if n.state == "ready"}
    faulty = {h.node for h in health if h.xid_errors}
    for m in plan.migrations:
        assert m.source == where[m.task].node != m.target
        assert m.target in ready - faulty
        if where[m.task].kind == "learner":
            assert at_checkpoint
            assert m.source in faulty or topo.node(m.source).state == "draining"
        else:
            assert where[m.task].movable
        assert m.steps == (("start", m.target), ("stop", m.source))
        assert m.reason


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_plan_never_raises_the_maximum_load(data):
    topo, placements, health = data.draw(clusters())
    plan = balance(topo, placements, health, data.draw(states(topo)), now=1000.0)
    before = max(h.cpu for h in health)
    after = max(h.cpu for h in projected_health(placements, health, plan))
    assert after <= before + 1e-9


@settings(max_examples=200, deadline=None)
@given(st.data(), st.floats(0.0, COOLDOWN - 1.0))
def test_no_second_wave_within_cooldown_under_unchanged_health(data, dt):
    topo, placements, health = data.draw(clusters())
    cfg = BalancerConfig(cooldown_s=COOLDOWN, enter_after=1)
    first = balance(topo, placements, health, data.draw(states(topo)), 1000.0, cfg)
    again = balance(topo, apply(placements, first), health, first.state, 1000.0 + dt, cfg)
    assert again.migrations == ()


@settings(max_examples=200, deadline=None)
@given(st.data(), st.floats(0.0, 10 * COOLDOWN))
def test_no_ping_pong_once_the_load_has_followed_the_tasks(data, dt):
    topo, placements, health = data.draw(clusters())
    cfg = BalancerConfig(cooldown_s=COOLDOWN, enter_after=1)
    first = balance(topo, placements, health, data.draw(states(topo)), 1000.0, cfg)
    settled = projected_health(placements, health, first)
    again = balance(topo, apply(placements, first), settled, first.state, 1000.0 + dt, cfg)
    assert again.migrations == ()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_health_roundtrips_through_json(data):
    """NodeHealth travels as JSON in a node's heartbeat; the leader must read back what was sent."""
    _, _, health = data.draw(clusters())
    for h in health:
        assert NodeHealth.from_dict(json.loads(json.dumps(h.to_dict()))) == h


# --- examples --------------------------------------------------------------------------------


def _spread(nodes: int, actors: int, cpus: float = 8.0) -> tuple[Topology, tuple[Placement, ...]]:
    topo = simulated_cluster(nodes, 8, island_size=8, nodes_per_domain=nodes, cpus=cpus)
    plan = place(topo, (), (), [RolloutActor(f"a{i}") for i in range(actors)])
    return topo, plan.placements


def test_overload_is_decided_on_the_second_heartbeat_and_relieved():
    topo, placements = _spread(4, 16)
    health = [NodeHealth("node-0", cpu=1.0)] + [
        NodeHealth(f"node-{i}", cpu=0.2) for i in range(1, 4)
    ]
    state = BalancerState()
    first = balance(topo, placements, health, state, now=0.0)
    assert first.migrations == ()
    second = balance(topo, placements, health, first.state, now=5.0)
    assert {m.source for m in second.migrations} == {"node-0"}
    # four actors share the load 1.0: two moves bring node-0 to 0.5 < low, one per target
    assert len(second.migrations) == 2
    assert len({m.target for m in second.migrations}) == 2
    [decision] = [d for d in second.decisions if d.action == "overloaded"]
    assert "node-0 overloaded: cpu 1.00" in decision.reason
    assert "for 2 report(s)" in decision.reason
    assert "moving 2 rollout actor(s) away" in decision.reason
    relieved = projected_health(placements, health, second)
    assert max(h.cpu for h in relieved if h.node == "node-0") < 0.65


def test_recovers_only_below_low():
    topo, placements = _spread(2, 4)
    state = BalancerState(overloaded=frozenset({"node-0"}), node_moved_at=(("node-0", 0.0),))
    cfg = BalancerConfig(cooldown_s=100.0)
    mid = balance(
        topo, placements, [NodeHealth("node-0", cpu=0.7), NodeHealth("node-1")], state, 1.0, cfg
    )
    assert "node-0" in mid.state.overloaded
    low = balance(
        topo, placements, [NodeHealth("node-0", cpu=0.6), NodeHealth("node-1")], state, 1.0, cfg
    )
    assert "node-0" not in low.state.overloaded
    assert [d.action for d in low.decisions] == ["recovered"]


def test_xid_fault_drains_movable_tasks_and_holds_learners_until_checkpoint():
    topo = simulated_cluster(4, 8, island_size=16, nodes_per_domain=4)
    plan = place(
        topo,
        (),
        [LearnerGroup("ppo", ranks=2, gpus_per_rank=8)],
        [RolloutActor(f"a{i}") for i in range(8)],
    )
    health = [NodeHealth(n.name, cpu=0.2) for n in topo.nodes]
    health[0] = NodeHealth("node-0", cpu=0.2, xid_errors=1)
    out = balance(topo, plan.placements, health, BalancerState(), now=10.0)
    drains = [d for d in out.decisions if d.action == "drain"]
    assert drains[0].node == "node-0"
    assert "1 new XID error(s)" in drains[0].reason
    on_node0 = {p.task for p in plan.placements if p.node == "node-0" and p.kind == "rollout"}
    assert on_node0
    assert {m.task for m in out.migrations} == on_node0
    assert all(m.source == "node-0" and m.target != "node-0" for m in out.migrations)
    [hold] = [d for d in out.decisions if d.action == "hold"]
    assert hold.task == "ppo/rank0"
    assert "checkpoint boundary" in hold.reason

    at_ckpt = balance(
        topo, plan.placements, health, BalancerState(), 10.0, checkpoint_groups=frozenset({"ppo"})
    )
    [rank] = [m for m in at_ckpt.migrations if m.task == "ppo/rank0"]
    assert rank.target in {"node-2", "node-3"}  # node-1 holds the other rank, no room left
    assert len(rank.gpus) == 8


def test_degraded_node_takes_no_migrated_tasks():
    topo, placements = _spread(3, 6)
    health = [
        NodeHealth("node-0", cpu=1.0),
        NodeHealth("node-1", cpu=0.1, clock_offset_ms=-250.0),
        NodeHealth("node-2", cpu=0.3),
    ]
    out = balance(topo, placements, health, BalancerState(), 0.0, BalancerConfig(enter_after=1))
    assert {m.target for m in out.migrations} == {"node-2"}
    [deg] = [d for d in out.decisions if d.action == "degraded"]
    assert "clock offset -250 ms beyond ±100 ms" in deg.reason


def test_slow_env_steps_count_as_overload():
    topo, placements = _spread(2, 4)
    health = [
        NodeHealth("node-0", cpu=0.3, steps_per_s=400.0, steps_baseline=1000.0),
        NodeHealth("node-1", cpu=0.1),
    ]
    out = balance(topo, placements, health, BalancerState(), 0.0, BalancerConfig(enter_after=1))
    assert [d.node for d in out.decisions if d.action == "overloaded"] == ["node-0"]
    assert {m.source for m in out.migrations} == {"node-0"}
    assert any("env steps/s at 40% of its baseline" in d.reason for d in out.decisions)


def test_bad_input_is_named():
    topo, placements = _spread(2, 2)
    with pytest.raises(SchedulerError, match="unknown node 'ghost'"):
        balance(topo, placements, [NodeHealth("ghost")], BalancerState(), 0.0)
    with pytest.raises(SchedulerError, match="two health reports for node 'node-0'"):
        balance(
            topo, placements, [NodeHealth("node-0"), NodeHealth("node-0")], BalancerState(), 0.0
        )
    with pytest.raises(SchedulerError, match="now must be a finite time"):
        balance(topo, placements, [], BalancerState(), float("nan"))
    with pytest.raises(ConfigError, match=r"balancer.low = 0.9, balancer.high = 0.8"):
        BalancerConfig(high=0.8, low=0.9)
    with pytest.raises(ConfigError, match=r"balancer\.enter_after = 0"):
        BalancerConfig(enter_after=0)
    with pytest.raises(ConfigError, match=r"balancer\.min_steps_ratio = 2"):
        BalancerConfig(min_steps_ratio=2)


def test_draining_node_is_emptied_and_what_cannot_move_is_named():
    topo, placements = _spread(3, 6)
    topo = topo.with_state("node-0", "draining")
    pinned = Placement("pinned", "node-0", "rollout", cpus=1.0, movable=False)
    health = [NodeHealth(n.name, cpu=0.2) for n in topo.nodes]
    out = balance(topo, (*placements, pinned), health, BalancerState(), 0.0)
    on_node0 = {p.task for p in placements if p.node == "node-0"}
    assert {m.task for m in out.migrations} == on_node0
    assert all(m.reason.startswith("drain node-0 (node is draining)") for m in out.migrations)
    [hold] = [d for d in out.decisions if d.action == "hold"]
    assert hold.task == "pinned"
    assert "is not movable" in hold.reason


def test_drain_with_no_room_anywhere_is_stuck_and_retried():
    topo, placements = _spread(2, 16, cpus=8.0)  # 8 one-CPU actors fill each node
    health = [NodeHealth("node-0", cpu=0.5, ecc_errors=2), NodeHealth("node-1", cpu=0.5)]
    out = balance(topo, placements, health, BalancerState(), 0.0)
    assert out.migrations == ()
    stuck = [d for d in out.decisions if d.action == "stuck"]
    assert len(stuck) == 8
    assert "lacks 1 CPUs" in stuck[0].reason
    assert "2 new uncorrectable ECC error(s)" in stuck[0].reason


def test_learner_rank_drains_to_its_own_island_first():
    topo = simulated_cluster(4, 8, island_size=16, nodes_per_domain=4)
    rank = Placement("ppo/rank0", "node-0", "learner", gpus=tuple(range(8)), cpus=1.0, group="ppo")
    health = [NodeHealth("node-0", xid_errors=1), NodeHealth("node-1", cpu=0.6)] + [
        NodeHealth(f"node-{i}", cpu=0.1) for i in (2, 3)
    ]
    out = balance(topo, (rank,), health, BalancerState(), 0.0, checkpoint_groups=frozenset({"ppo"}))
    [m] = out.migrations
    assert (m.target, m.gpus) == ("node-1", tuple(range(8)))  # island-0, though node-2 is cooler


def test_overload_is_announced_once_while_the_migration_settles():
    topo, placements = _spread(4, 16)
    health = [NodeHealth("node-0", cpu=1.0)] + [
        NodeHealth(f"node-{i}", cpu=0.2) for i in range(1, 4)
    ]
    cfg = BalancerConfig(enter_after=1, cooldown_s=60.0)
    state, announced = BalancerState(), []
    for beat in range(6):  # the reports lag: node-0 still shows 1.0 for 30 s
        out = balance(topo, placements, health, state, beat * 5.0, cfg)
        placements = apply(placements, out)
        announced += [d.node for d in out.decisions if d.action == "overloaded"]
        state = out.state
    assert announced == ["node-0"]
    cooled = [NodeHealth("node-0", cpu=0.5), *health[1:]]
    out = balance(topo, placements, cooled, state, 40.0, cfg)
    assert [(d.node, d.action) for d in out.decisions] == [("node-0", "recovered")]
