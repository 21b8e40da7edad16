"""`shoal bench scheduler`: placement and rebalancing on a 512-node simulated cluster.

Placement: 32 learner groups of 16 GPUs (2 ranks × 8) and 4,096 rollout actors onto 512 nodes
of 8 GPUs (NVLink islands of 16 GPUs = two nodes, RDMA domains of 32 nodes), where a quarter
of the nodes already run a 4-GPU job, so islands are fragmented as in a busy cluster. Beside
it, in the same run, a naive first-fit placer (nodes in order, first node with room).
Balancing: one planning round over 512 nodes with 10 % of them overloaded, beside a naive
greedy planner (move the biggest task of each hot node to the coolest node, no projection
of the target's new load, no hysteresis); and the number of heartbeats from the start of a
sustained overload to the first migration.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

from shoal.bench.report import Row
from shoal.scheduler.balancer import BalancerConfig, balance
from shoal.scheduler.model import (
    BalancerState,
    LearnerGroup,
    NodeHealth,
    Placement,
    RolloutActor,
)
from shoal.scheduler.placement import place
from shoal.scheduler.reservations import Reservations
from shoal.scheduler.topology import Topology, simulated_cluster

T = TypeVar("T")

NODES, GPUS_PER_NODE, GROUPS, ACTORS = 512, 8, 32, 4096


def _timed(fn: Callable[[], T], repeats: int) -> tuple[T, list[float], list[float]]:
    """The last result, each run's wall time and each run's CPU time, in ms. Both, because
    on a shared machine the wall time includes waiting for a core."""
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    return result, wall, cpu


def _cluster() -> tuple[Topology, tuple[Placement, ...]]:
    """512 nodes; every fourth node (seeded choice) already runs a 4-GPU job."""
    topo = simulated_cluster(NODES, GPUS_PER_NODE, island_size=16, nodes_per_domain=32)
    rng = random.Random(6)
    busy = rng.sample([n.name for n in topo.nodes], NODES // 4)
    existing = tuple(
        Placement(f"job-{name}", name, "rollout", gpus=(0, 1, 2, 3), cpus=4.0, movable=False)
        for name in sorted(busy)
    )
    return topo, existing


def _requests() -> tuple[list[LearnerGroup], list[RolloutActor]]:
    groups = [LearnerGroup(f"ppo-{i:02d}", ranks=2, gpus_per_rank=8) for i in range(GROUPS)]
    actors = [RolloutActor(f"rollout-{i:04d}", cpus=1.0, memory_mb=2048) for i in range(ACTORS)]
    return groups, actors


def first_fit(
    topo: Topology,
    existing: tuple[Placement, ...],
    groups: list[LearnerGroup],
    actors: list[RolloutActor],
) -> list[Placement]:
    """The baseline: each rank and actor on the first node (in name order) with room."""
    reservations = Reservations(topo, existing)
    out: list[Placement] = []
    for group in groups:
        for rank in range(group.ranks):
            for usage in reservations.usage.values():
                free = usage.free_gpus()
                if len(free) >= group.gpus_per_rank and usage.fits(group.cpus_per_rank, 0):
                    p = Placement(
                        group.rank_task(rank),
                        usage.node.name,
                        "learner",
                        gpus=tuple(free[: group.gpus_per_rank]),
                        cpus=group.cpus_per_rank,
                        group=group.name,
                        movable=False,
                    )
                    reservations.add(p)
                    out.append(p)
                    break
    for actor in actors:
        for usage in reservations.usage.values():
            if usage.fits(actor.cpus, actor.memory_mb):
                p = Placement(
                    actor.name, usage.node.name, "rollout", (), actor.cpus, actor.memory_mb
                )
                reservations.add(p)
                out.append(p)
                break
    return out


def groups_split(topo: Topology, placements: list[Placement]) -> int:
    """Learner groups whose GPUs span more than one NVLink island."""
    nodes = topo.by_name()
    islands: dict[str, set[str]] = {}
    for p in placements:
        if p.kind == "learner":
            islands.setdefault(p.group, set()).update(nodes[p.node].island_of(g) for g in p.gpus)
    return sum(1 for labels in islands.values() if len(labels) > 1)


def max_cpu_reserved(topo: Topology, placements: list[Placement]) -> float:
    reservations = Reservations(topo, placements)
    return max(u.cpus / u.node.cpus for u in reservations.usage.values())


def _placement_rows(repeats: int) -> tuple[list[Row], Topology, list[Placement]]:
    topo, existing = _cluster()
    groups, actors = _requests()
    plan, shoal_ms, shoal_cpu = _timed(lambda: place(topo, existing, groups, actors), repeats)
    naive, naive_ms, naive_cpu = _timed(lambda: first_fit(topo, existing, groups, actors), repeats)
    ours = list(existing) + list(plan.placements)
    theirs = list(existing) + naive
    rows = [
        Row(
            "placement p50 (32 groups × 16 GPUs + 4,096 actors, 512 nodes)",
            "ms",
            statistics.median(shoal_ms),
            statistics.median(naive_ms),
            "first-fit",
            False,
        ),
        Row("placement max", "ms", max(shoal_ms), max(naive_ms), "first-fit", False),
        Row(
            "placement p50, CPU time",
            "ms",
            statistics.median(shoal_cpu),
            statistics.median(naive_cpu),
            "first-fit",
            False,
        ),
        Row(
            "learner groups split across NVLink islands",
            "groups",
            float(groups_split(topo, ours)),
            float(groups_split(topo, theirs)),
            "first-fit",
            False,
        ),
        Row(
            "busiest node's reserved CPU after placement",
            "fraction",
            max_cpu_reserved(topo, ours),
            max_cpu_reserved(topo, theirs),
            "first-fit",
            False,
        ),
        Row(
            "tasks refused",
            "tasks",
            float(len(plan.refused)),
            float(GROUPS * 2 + ACTORS - len(naive)),
            "first-fit",
            False,
        ),
    ]
    return rows, topo, ours


def _health(topo: Topology, hot: set[str]) -> list[NodeHealth]:
    rng = random.Random(7)
    return [
        NodeHealth(n.name, cpu=0.95 if n.name in hot else rng.uniform(0.1, 0.6)) for n in topo.nodes
    ]


def naive_rebalance(
    placements: list[Placement], health: list[NodeHealth], high: float
) -> dict[str, float]:
    """Baseline planner: for each node above `high`, move its tasks one by one to whichever
    node reports the lowest load, until it is below `high`. No projection of the target's new
    load, so every hot node picks the same coolest target. Returns the resulting loads."""
    load = {h.node: h.cpu for h in health}
    reported = dict(load)
    tasks: dict[str, list[Placement]] = {}
    for p in placements:
        tasks.setdefault(p.node, []).append(p)
    coolest = min(reported, key=lambda n: (reported[n], n))
    for node in sorted(load):
        movable = [p for p in tasks.get(node, []) if p.movable]
        share = load[node] / max(1, len(tasks.get(node, [])))
        while load[node] >= high and movable:
            movable.pop()
            load[node] -= share
            load[coolest] += share
    return load


def _projected_max(
    placements: list[Placement], health: list[NodeHealth], plan_moves: dict[str, str]
) -> float:
    measured = {h.node: h.cpu for h in health}
    load = dict(measured)
    by_node: dict[str, list[Placement]] = {}
    for p in placements:
        by_node.setdefault(p.node, []).append(p)
    for node, ps in by_node.items():
        total = sum(p.cpus + len(p.gpus) for p in ps)
        for p in ps:
            if p.task in plan_moves:
                share = 0.0 if not total else measured[node] * (p.cpus + len(p.gpus)) / total
                load[node] -= share
                load[plan_moves[p.task]] += share
    return max(load.values())


def _balance_rows(topo: Topology, placements: list[Placement], repeats: int) -> list[Row]:
    cfg = BalancerConfig()
    rng = random.Random(8)
    hot = set(rng.sample([n.name for n in topo.nodes], NODES // 10))
    health = _health(topo, hot)
    state = BalancerState(overloaded=frozenset(hot))
    plan, ours_ms, ours_cpu = _timed(
        lambda: balance(topo, placements, health, state, 1000.0, cfg), repeats
    )
    naive, naive_ms, naive_cpu = _timed(
        lambda: naive_rebalance(placements, health, cfg.high), repeats
    )
    moves = {m.task: m.target for m in plan.migrations}
    return [
        Row(
            "rebalance plan p50 (512 nodes, 51 overloaded)",
            "ms",
            statistics.median(ours_ms),
            statistics.median(naive_ms),
            "naive greedy",
            False,
        ),
        Row("rebalance plan max", "ms", max(ours_ms), max(naive_ms), "naive greedy", False),
        Row(
            "rebalance plan p50, CPU time",
            "ms",
            statistics.median(ours_cpu),
            statistics.median(naive_cpu),
            "naive greedy",
            False,
        ),
        Row(
            "busiest node's load after the plan",
            "load",
            _projected_max(placements, health, moves),
            max(naive.values()),
            "naive greedy",
            False,
        ),
        Row("migrations planned", "tasks", float(len(plan.migrations)), None, "-", False),
        Row(
            "heartbeats from sustained overload to a migration",
            "heartbeats",
            float(_heartbeats_to_migration(topo, placements, health, cfg)),
            2.0,
            "target (≤ 2)",
            False,
        ),
    ]


def _heartbeats_to_migration(
    topo: Topology, placements: list[Placement], health: list[NodeHealth], cfg: BalancerConfig
) -> int:
    """Heartbeat k (k = 1, 2, ...): node-000 reports load 0.95 every time; the first k whose
    round plans a migration off it."""
    calm = [h if h.node != "node-000" else NodeHealth("node-000", cpu=0.95) for h in health]
    calm = [
        h if h.cpu < cfg.high or h.node == "node-000" else NodeHealth(h.node, cpu=0.3) for h in calm
    ]
    state = BalancerState()
    for beat in range(1, 11):
        plan = balance(topo, placements, calm, state, beat * 5.0, cfg)
        if any(m.source == "node-000" for m in plan.migrations):
            return beat
        state = plan.state
    return 0


def run(quick: bool) -> list[Row]:
    repeats = 3 if quick else 11
    rows, topo, placements = _placement_rows(repeats)
    return rows + _balance_rows(topo, placements, repeats)
