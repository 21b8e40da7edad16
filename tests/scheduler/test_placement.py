"""Placement: gang placement on islands/domains, spreading of rollout actors, and its invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.scheduler.errors import PlacementRefused, TopologyError
from shoal.scheduler.model import (
    Gpu,
    LearnerGroup,
    Node,
    Placement,
    RolloutActor,
)
from shoal.scheduler.placement import place, place_group
from shoal.scheduler.reservations import Reservations
from shoal.scheduler.topology import Topology, simulated_cluster

# --- strategies ------------------------------------------------------------------------------


@st.composite
def topologies(draw: st.DrawFn) -> Topology:
    count = draw(st.integers(1, 7))
    nodes = []
    for i in range(count):
        ngpu = draw(st.integers(0, 4))
        domain = draw(st.sampled_from(["d0", "d1"]))
        islands = st.sampled_from([f"{domain}-i0", f"{domain}-i1", f"{domain}-i2"])
        gpus = tuple(Gpu(k, draw(islands)) for k in range(ngpu))
        nodes.append(
            Node(
                name=f"n{i}",
                cpus=float(draw(st.integers(0, 8))),
                memory_mb=draw(st.integers(0, 4)) * 1024,
                gpus=gpus,
                domain=domain,
                state=draw(st.sampled_from(["ready", "ready", "ready", "cordoned", "dead"])),
            )
        )
    return Topology(tuple(nodes))


def groups(prefix: str = "g") -> st.SearchStrategy[list[LearnerGroup]]:
    shape = st.tuples(
        st.integers(1, 4),
        st.integers(0, 3),
        st.sampled_from([0.0, 0.5, 1.0, 2.0]),
        st.sampled_from([0, 512, 1024]),
    )
    return st.lists(shape, max_size=4).map(
        lambda shapes: [LearnerGroup(f"{prefix}{i}", *shape) for i, shape in enumerate(shapes)]
    )


def actors(prefix: str = "a") -> st.SearchStrategy[list[RolloutActor]]:
    request = st.tuples(
        st.sampled_from([0.1, 0.5, 1.0, 2.0]), st.sampled_from([0, 256, 1024]), st.integers(0, 1)
    )
    return st.lists(request, max_size=20).map(
        lambda rs: [RolloutActor(f"{prefix}{i}", c, m, g) for i, (c, m, g) in enumerate(rs)]
    )


@st.composite
def scenes(draw: st.DrawFn) -> tuple[Topology, tuple[Placement, ...]]:
    """A topology with some tasks already running on it (placed by `place` itself)."""
    topo = draw(topologies())
    before = place(topo, (), draw(groups("old-g")), draw(actors("old-a")))
    return topo, before.placements


def requested(gs: list[LearnerGroup], acts: list[RolloutActor]) -> list[str]:
    return [g.rank_task(r) for g in gs for r in range(g.ranks)] + [a.name for a in acts]


def island_fits(reservations: Reservations, topo: Topology, group: LearnerGroup) -> bool:
    """Brute force, independent of placement.py: some island has room for every rank."""
    if group.gpus_per_rank == 0:
        return False
    for label in topo.islands():
        slots = 0
        for node in topo.nodes:
            u = reservations.usage[node.name]
            if node.state != "ready":
                continue
            free = [g for g in node.gpus if g.island == label and g.index not in u.gpus]
            k = len(free) // group.gpus_per_rank
            if group.cpus_per_rank:
                k = min(k, int((u.free_cpus + 1e-9) // group.cpus_per_rank))
            if group.memory_mb_per_rank:
                k = min(k, u.free_memory_mb // group.memory_mb_per_rank)
            slots += k
        if slots >= group.ranks:
            return True
    return False


def domain_fits(reservations: Reservations, topo: Topology, group: LearnerGroup) -> bool:
    for names in topo.domains().values():
        slots = 0
        for name in names:
            u = reservations.usage[name]
            if u.node.state != "ready":
                continue
            k = group.ranks
            if group.gpus_per_rank:
                k = min(k, len(u.free_gpus()) // group.gpus_per_rank)
            if group.cpus_per_rank:
                k = min(k, int((u.free_cpus + 1e-9) // group.cpus_per_rank))
            if group.memory_mb_per_rank:
                k = min(k, u.free_memory_mb // group.memory_mb_per_rank)
            slots += k
        if slots >= group.ranks:
            return True
    return False


# --- properties ------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(scenes(), groups(), actors())
def test_plan_never_overcommits_and_loses_nothing(scene, gs, acts):
    topo, existing = scene
    plan = place(topo, existing, gs, acts)
    # Reservations.add refuses any over-commit, unknown GPU or duplicate task.
    reservations = Reservations(topo, existing + plan.placements)
    for label in topo.islands():
        assert reservations.free_in_island[label] == sum(
            1
            for n in topo.nodes
            if n.state == "ready"
            for g in n.gpus
            if g.island == label and g.index not in reservations.usage[n.name].gpus
        )
    placed = [p.task for p in plan.placements]
    refused = [r.task for r in plan.refused]
    for g in gs:
        ranks = [g.rank_task(r) for r in range(g.ranks)]
        assert all(t in placed for t in ranks) or (
            g.name in refused and not any(t in placed for t in ranks)
        )
    for a in acts:
        assert (a.name in placed) != (a.name in refused)
    assert sorted(placed) == sorted(set(placed))
    assert set(placed) <= set(requested(gs, acts))
    ready = {n.name for n in topo.nodes if n.state == "ready"}
    assert all(p.node in ready for p in plan.placements)


@settings(max_examples=150, deadline=None)
@given(scenes(), groups().filter(bool))
def test_group_on_one_island_when_one_fits_else_one_domain(scene, gs):
    topo, existing = scene
    group = gs[0]
    reservations = Reservations(topo, existing)
    if not domain_fits(reservations, topo, group):
        with pytest.raises(PlacementRefused, match=f"learner group '{group.name}' needs"):
            place_group(topo, existing, group)
        return
    ranks = place_group(topo, existing, group)
    assert len(ranks) == group.ranks
    assert all(len(p.gpus) == group.gpus_per_rank for p in ranks)
    by_name = topo.by_name()
    if island_fits(reservations, topo, group):
        islands = {by_name[p.node].island_of(g) for p in ranks for g in p.gpus}
        assert len(islands) == 1
    assert len({by_name[p.node].domain for p in ranks}) == 1


@settings(max_examples=100, deadline=None)
@given(scenes(), actors())
def test_each_actor_goes_to_the_least_loaded_node_that_fits(scene, acts):
    topo, existing = scene
    plan = place(topo, existing, (), acts)
    reservations = Reservations(topo, existing)
    for p in plan.placements:
        actor = next(a for a in acts if a.name == p.task)
        fitting = [
            (u.reserved_load(), name)
            for name, u in reservations.usage.items()
            if u.node.state == "ready"
            and u.fits(actor.cpus, actor.memory_mb)
            and len(u.free_gpus()) >= actor.gpus
        ]
        assert (reservations.usage[p.node].reserved_load(), p.node) == min(fitting)
        reservations.add(p)


@settings(max_examples=60, deadline=None)
@given(scenes(), groups(), actors())
def test_same_input_same_plan(scene, gs, acts):
    topo, existing = scene
    first = place(topo, existing, gs, acts)
    assert place(topo, existing, gs, acts) == first


# --- examples --------------------------------------------------------------------------------


def test_sixteen_gpu_group_spans_the_two_nodes_of_one_island():
    topo = simulated_cluster(4, 8, island_size=16, nodes_per_domain=4)
    ranks = place_group(topo, (), LearnerGroup("ppo", ranks=2, gpus_per_rank=8))
    assert [(p.node, p.gpus) for p in ranks] == [
        ("node-0", tuple(range(8))),
        ("node-1", tuple(range(8))),
    ]


def test_best_fit_island_keeps_the_empty_island_whole():
    topo = simulated_cluster(4, 8, island_size=16, nodes_per_domain=4)
    busy = (Placement("x", "node-2", "rollout", gpus=(0, 1, 2, 3), cpus=1.0),)
    ranks = place_group(topo, busy, LearnerGroup("small", ranks=4, gpus_per_rank=1))
    assert {p.node for p in ranks} == {"node-2"}


def test_refusal_names_need_and_largest_free_island():
    topo = simulated_cluster(2, 8, island_size=16, nodes_per_domain=2)
    busy = (Placement("x", "node-0", "rollout", gpus=(0, 1, 2, 3), cpus=1.0),)
    with pytest.raises(PlacementRefused) as info:
        place_group(topo, busy, LearnerGroup("big", ranks=2, gpus_per_rank=8))
    reason = info.value.reason
    assert "needs 16 GPUs (2 ranks × 8" in reason
    assert "largest free island has 12 (island-0)" in reason
    assert "one RDMA domain fits at most 1 of 2 ranks (domain-0)" in reason


def test_falls_back_to_one_domain_when_no_island_fits():
    topo = simulated_cluster(4, 8, island_size=8, nodes_per_domain=2)
    ranks = place_group(topo, (), LearnerGroup("wide", ranks=2, gpus_per_rank=8))
    assert {topo.node(p.node).domain for p in ranks} == {"domain-0"}
    assert {topo.node(p.node).island_of(p.gpus[0]) for p in ranks} == {"island-0", "island-1"}


def test_cordoned_draining_and_dead_nodes_get_nothing():
    topo = simulated_cluster(4, 0, nodes_per_domain=4, cpus=4.0)
    topo = topo.with_state("node-0", "cordoned").with_state("node-1", "draining")
    topo = topo.with_state("node-2", "dead")
    plan = place(topo, (), (), [RolloutActor(f"a{i}") for i in range(6)])
    assert {p.node for p in plan.placements} == {"node-3"}
    assert len(plan.placements) == 4
    assert [r.task for r in plan.refused] == ["a4", "a5"]
    assert "most free on any ready node is 0 CPUs" in plan.refused[0].reason


def test_actors_spread_round_robin_over_equal_nodes():
    topo = simulated_cluster(3, 0, nodes_per_domain=3, cpus=8.0)
    plan = place(topo, (), (), [RolloutActor(f"a{i}") for i in range(6)])
    assert [p.node for p in plan.placements] == ["node-0", "node-1", "node-2"] * 2


@pytest.mark.parametrize(
    ("existing", "message"),
    [
        ((Placement("t", "nowhere", "rollout"),), "unknown node 'nowhere'"),
        ((Placement("t", "node-0", "rollout", gpus=(9,)),), "has no GPU 9"),
        (
            (Placement("t", "node-0", "rollout"), Placement("t", "node-1", "rollout")),
            "placed twice",
        ),
        ((Placement("t", "node-0", "rollout", cpus=1000.0),), "over-commits 'node-0'"),
    ],
)
def test_inconsistent_existing_placements_are_named(existing, message):
    topo = simulated_cluster(2, 8, nodes_per_domain=2)
    with pytest.raises(TopologyError, match=message):
        place(topo, existing)


def test_bad_records_are_refused_with_the_field():
    with pytest.raises(TopologyError, match="ranks must be an int >= 1"):
        LearnerGroup("g", ranks=0, gpus_per_rank=1)
    with pytest.raises(TopologyError, match="state 'gone' is not one of"):
        Node("n", 1.0, 1, state="gone")
    with pytest.raises(TopologyError, match="node names repeat: n"):
        Topology((Node("n", 1.0, 1), Node("n", 1.0, 1)))
    with pytest.raises(TopologyError, match="island 'x' spans RDMA domains 'a' and 'b'"):
        Topology((Node("n", 1.0, 1, (Gpu(0, "x"),), "a"), Node("m", 1.0, 1, (Gpu(0, "x"),), "b")))
    with pytest.raises(TopologyError, match="does not divide"):
        simulated_cluster(3, 8, island_size=16, nodes_per_domain=3)
    with pytest.raises(TopologyError, match="requested twice"):
        place(simulated_cluster(1, 0), (), (), [RolloutActor("a"), RolloutActor("a")])
