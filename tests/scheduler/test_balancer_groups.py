"""Balancer: a learner group leaves a draining node as one gang, or not at all."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.scheduler.balancer import balance
from shoal.scheduler.model import (
    BalancePlan,
    BalancerState,
    Gpu,
    LearnerGroup,
    Node,
    NodeHealth,
    Placement,
    RolloutActor,
)
from shoal.scheduler.placement import place
from shoal.scheduler.reservations import Reservations
from shoal.scheduler.topology import Topology, simulated_cluster

LOADS = st.sampled_from([0.0, 0.1, 0.4, 0.7, 0.9, 1.2])


def node(name: str, gpus: int, domain: str = "d", state: str = "ready") -> Node:
    """A 16-CPU node whose GPUs form one NVLink island of its own."""
    return Node(name, 16.0, 65536, tuple(Gpu(i, f"{name}/nvl") for i in range(gpus)), domain, state)


def rank(task: str, where: str, gpus: tuple[int, ...], group: str = "g") -> Placement:
    return Placement(task, where, "learner", gpus=gpus, cpus=1.0, group=group, movable=False)


def apply(placements: tuple[Placement, ...], plan: BalancePlan) -> tuple[Placement, ...]:
    moves = {m.task: m for m in plan.migrations}
    return tuple(
        p.moved_to(moves[p.task].target, moves[p.task].gpus) if p.task in moves else p
        for p in placements
    )


def test_group_moves_to_one_node_where_per_rank_load_would_split_it():
    topo = Topology(
        (node("n1", 2, state="draining"), node("n2", 2), node("n3", 2))
    )  # n2 is the coolest but has one GPU free; only n3 holds both ranks
    placements = (
        rank("g/rank0", "n1", (0,)),
        rank("g/rank1", "n1", (1,)),
        Placement("a0", "n2", "rollout", gpus=(0,), cpus=1.0),
    )
    health = [NodeHealth("n1", cpu=0.3), NodeHealth("n2", cpu=0.1), NodeHealth("n3", cpu=0.5)]
    out = balance(
        topo, placements, health, BalancerState(), 0.0, checkpoint_groups=frozenset({"g"})
    )
    assert sorted((m.task, m.target, m.gpus) for m in out.migrations) == [
        ("g/rank0", "n3", (0,)),
        ("g/rank1", "n3", (1,)),
    ]
    assert all(
        "learner group 'g' moves as one to NVLink island n3/nvl" in m.reason for m in out.migrations
    )
    Reservations(topo, apply(placements, out))


def test_group_no_receiver_can_hold_is_stuck_and_nothing_of_it_moves():
    topo = Topology(
        (node("n1", 4, "a", state="draining"), node("n2", 2, "b"), node("n3", 2, "c"))
    )  # 2 ranks x 2 GPUs: each domain holds one rank, none holds the group
    placements = (
        rank("g/rank0", "n1", (0, 1)),
        rank("g/rank1", "n1", (2, 3)),
        Placement("a0", "n1", "rollout", cpus=1.0),
    )
    health = [NodeHealth(n.name, cpu=0.2) for n in topo.nodes]
    out = balance(
        topo, placements, health, BalancerState(), 0.0, checkpoint_groups=frozenset({"g"})
    )
    assert [m.task for m in out.migrations] == ["a0"]  # the rollout actor still leaves
    [stuck] = [d for d in out.decisions if d.action == "stuck"]
    assert (stuck.node, stuck.task) == ("n1", "g")
    assert "learner group 'g' cannot leave n1 (node is draining) as one unit" in stuck.reason
    assert "needs 4 GPUs (2 ranks × 2" in stuck.reason
    assert "no rank moves" in stuck.reason


def test_rank_whose_place_the_gang_keeps_does_not_move():
    topo = Topology((node("n1", 2, state="draining"), node("n2", 2), node("n3", 4)))
    placements = (rank("g/rank0", "n1", (0,)), rank("g/rank1", "n2", (0,)))
    health = [NodeHealth("n1", xid_errors=1), NodeHealth("n2", cpu=0.6), NodeHealth("n3")]
    out = balance(
        topo, placements, health, BalancerState(), 0.0, checkpoint_groups=frozenset({"g"})
    )
    [m] = out.migrations  # n2's island fits both ranks best: rank1 keeps its GPU
    assert (m.task, m.source, m.target, m.gpus) == ("g/rank0", "n1", "n2", (1,))


def test_a_group_with_ranks_on_two_draining_nodes_is_planned_once():
    topo = Topology(
        (node("n1", 1, state="draining"), node("n2", 1, state="draining"), node("n3", 2))
    )
    placements = (rank("g/rank0", "n1", (0,)), rank("g/rank1", "n2", (0,)))
    health = [NodeHealth(n.name) for n in topo.nodes]
    out = balance(
        topo, placements, health, BalancerState(), 0.0, checkpoint_groups=frozenset({"g"})
    )
    assert sorted((m.task, m.target, m.gpus) for m in out.migrations) == [
        ("g/rank0", "n3", (0,)),
        ("g/rank1", "n3", (1,)),
    ]


def test_overload_relief_never_moves_a_learner_rank():
    topo = Topology((node("n1", 2), node("n2", 2)))
    placements = (rank("g/rank0", "n1", (0,)), rank("g/rank1", "n1", (1,)))
    health = [NodeHealth("n1", cpu=1.0), NodeHealth("n2", cpu=0.0)]
    state = BalancerState(overloaded=frozenset({"n1"}))
    out = balance(topo, placements, health, state, 0.0, checkpoint_groups=frozenset({"g"}))
    assert out.migrations == ()
    assert "n1" in out.state.overloaded


# --- property ---------------------------------------------------------------------------------


@st.composite
def gang_rounds(draw: st.DrawFn):
    """A random cluster with learner groups gang-placed by `place`, then some nodes draining
    or faulty, some groups at a checkpoint boundary; fresh balancer state (no overload,
    cooldown or degradation), so the receivers are the ready nodes without a fault."""
    gpus = draw(st.sampled_from([1, 2, 4]))
    per_domain = draw(st.integers(1, 3))
    island = draw(st.sampled_from([d for d in (1, 2, 4, 8) if (gpus * per_domain) % d == 0]))
    topo = simulated_cluster(
        draw(st.integers(2, 6)), gpus, island, per_domain, cpus=64.0, memory_mb=65536
    )
    groups = [
        LearnerGroup(f"g{i}", draw(st.integers(1, 3)), draw(st.integers(0, 2)), cpus_per_rank=0.5)
        for i in range(draw(st.integers(1, 4)))
    ]
    actors = [
        RolloutActor(f"a{i}", cpus=0.5, gpus=draw(st.integers(0, 1)))
        for i in range(draw(st.integers(0, 6)))
    ]
    placements = place(topo, (), groups, actors).placements
    for n in topo.nodes:
        if draw(st.integers(0, 3)) == 0:
            topo = topo.with_state(n.name, "draining")
    xids = st.sampled_from([0, 0, 0, 1])
    health = [NodeHealth(n.name, cpu=draw(LOADS), xid_errors=draw(xids)) for n in topo.nodes]
    ckpt = frozenset(draw(st.sets(st.sampled_from([g.name for g in groups]))))
    return topo, placements, health, ckpt


def _free(
    topo: Topology, placements: tuple[Placement, ...], skip: set[str]
) -> set[tuple[str, int]]:
    used = {(p.node, g) for p in placements if p.task not in skip for g in p.gpus}
    return {(n.name, g.index) for n in topo.nodes for g in n.gpus} - used


def _room(
    topo: Topology, free: set[tuple[str, int]], receivers: set[str], ranks: list[Placement]
) -> tuple[bool, bool]:
    """(some island, some domain) had room for the group among GPUs free all round long."""
    per = max(len(p.gpus) for p in ranks)
    by_island: dict[str, dict[str, int]] = {}
    by_domain: dict[str, dict[str, int]] = {}
    for n in topo.nodes:
        if n.name not in receivers:
            continue
        by_domain.setdefault(n.domain, {})[n.name] = 0
        for g in n.gpus:
            if (n.name, g.index) in free:
                by_island.setdefault(g.island, {}).setdefault(n.name, 0)
                by_island[g.island][n.name] += 1
                by_domain[n.domain][n.name] += 1

    def fits(counts: dict[str, int]) -> bool:
        return sum(len(ranks) if not per else c // per for c in counts.values()) >= len(ranks)

    island_room = bool(per) and any(fits(c) for c in by_island.values())
    return island_room, any(fits(c) for c in by_domain.values())


@settings(max_examples=300, deadline=None)
@given(gang_rounds())
def test_groups_move_whole_within_one_domain_and_one_island_when_one_has_room(case):
    topo, placements, health, ckpt = case
    plan = balance(topo, placements, health, BalancerState(), 0.0, checkpoint_groups=ckpt)
    after = apply(placements, plan)
    Reservations(topo, after)
    faulty = {h.node for h in health if h.xid_errors}
    receivers = {n.name for n in topo.nodes if n.state == "ready"} - faulty
    moved = {m.task for m in plan.migrations}
    stuck = {d.task for d in plan.decisions if d.action == "stuck"}
    domain = {n.name: n.domain for n in topo.nodes}
    island = {(n.name, g.index): g.island for n in topo.nodes for g in n.gpus}
    for name in sorted({p.group for p in placements if p.kind == "learner"}):
        ranks = [p for p in placements if p.group == name]
        now = [p for p in after if p.group == name]
        members = {p.task for p in ranks}
        assert len({domain[p.node] for p in now}) == 1
        must = any(p.node not in receivers for p in ranks)
        if not (name in ckpt and must):
            assert not members & moved
            continue
        free = _free(topo, placements, members) & _free(topo, after, members)
        island_room, domain_room = _room(topo, free, receivers, ranks)
        if name in stuck:
            assert not members & moved
            assert not domain_room
            continue
        assert {p.node for p in now} <= receivers  # the whole group left, none stayed behind
        if island_room:
            assert len({island[(p.node, g)] for p in now for g in p.gpus}) == 1
