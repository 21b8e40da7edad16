"""Where new tasks go: learner groups as one gang, rollout actors spread by free capacity.

Pure: the inputs are records, the output is a plan; nothing is mutated. A learner group goes
onto ONE NVLink island when one has room (best fit: the fullest island that still fits, so
large empty islands stay whole for large groups), else inside ONE RDMA domain, else it is
refused with what it needs and what is free (and, when even empty nodes could not hold it,
that waiting will not help). Rollout actors go to the least-loaded ready node
(reserved CPU/memory fraction), ties broken by node name, so the same input gives the same plan.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.scheduler.errors import PlacementRefused, TopologyError
from shoal.scheduler.model import (
    LearnerGroup,
    Node,
    Placement,
    PlacementPlan,
    Refusal,
    RolloutActor,
)
from shoal.scheduler.reservations import CPU_EPSILON, NodeUsage, Reservations
from shoal.scheduler.topology import Topology


def place(
    topology: Topology,
    existing: Sequence[Placement] = (),
    groups: Sequence[LearnerGroup] = (),
    actors: Sequence[RolloutActor] = (),
) -> PlacementPlan:
    """Plan new placements around `existing` ones; the largest groups are placed first."""
    reservations = Reservations(topology, existing)
    _check_names(reservations, groups, actors)
    shape = _Shape.of(topology)
    placements: list[Placement] = []
    refused: list[Refusal] = []
    for group in sorted(groups, key=lambda g: (-g.total_gpus, -g.ranks, g.name)):
        try:
            ranks = _place_group(reservations, shape, group)
        except PlacementRefused as exc:
            refused.append(Refusal(exc.task, exc.reason))
            continue
        for p in ranks:
            reservations.add(p)
        placements.extend(ranks)
    spread, unplaced = _spread_actors(reservations, actors)
    placements.extend(spread)
    refused.extend(unplaced)
    return PlacementPlan(tuple(placements), tuple(refused))


def place_group(
    topology: Topology, existing: Sequence[Placement], group: LearnerGroup
) -> tuple[Placement, ...]:
    """One group's rank placements, or `PlacementRefused` saying why not."""
    reservations = Reservations(topology, existing)
    _check_names(reservations, [group], [])
    return GangPlacer(topology, reservations).place(group)


class GangPlacer:
    """Gang placement, group after group, on reservations the caller keeps current between calls
    (the balancer moving several groups in one round), so neither the reservations nor the
    cluster's islands and domains are rebuilt per group. It reads the reservations, never changes them."""

    def __init__(self, topology: Topology, reservations: Reservations) -> None:
        self.reservations = reservations
        self._shape = _Shape.of(topology)

    def place(self, group: LearnerGroup) -> tuple[Placement, ...]:
        """`group`'s rank placements on the reservations as it is now, or `PlacementRefused`."""
        return tuple(_place_group(self.reservations, self._shape, group))


def _check_names(
    reservations: Reservations, groups: Sequence[LearnerGroup], actors: Sequence[RolloutActor]
) -> None:
    names = [g.rank_task(r) for g in groups for r in range(g.ranks)] + [a.name for a in actors]
    seen = set(reservations.where)
    for name in names:
        if name in seen:
            raise TopologyError(f"task {name!r} is requested twice or is already placed")
        seen.add(name)


def _rank_slots(usage: NodeUsage, group: LearnerGroup, island: str | None) -> int:
    """How many ranks of `group` this node can still take (on `island` if given)."""
    if not usage.node.schedulable:
        return 0
    limits = [group.ranks]
    if group.gpus_per_rank:
        free = usage.free_gpu_count if island is None else len(usage.free_gpus(island))
        limits.append(free // group.gpus_per_rank)
    if group.cpus_per_rank:
        limits.append(math.floor((usage.free_cpus + CPU_EPSILON) / group.cpus_per_rank))
    if group.memory_mb_per_rank:
        limits.append(usage.free_memory_mb // group.memory_mb_per_rank)
    return max(0, min(limits))


@dataclass(frozen=True)
class _Shape:
    """The cluster's islands and domains as candidate node lists, computed once per call."""

    islands: dict[str, tuple[list[str], str | None]]
    domains: dict[str, tuple[list[str], str | None]]

    @classmethod
    def of(cls, topology: Topology) -> _Shape:
        islands: dict[str, list[str]] = {}
        for label, gpus in topology.islands().items():
            names = islands.setdefault(label, [])
            for node, _ in gpus:
                if not names or names[-1] != node:
                    names.append(node)
        return cls(
            {label: (nodes, label) for label, nodes in islands.items()},
            {d: (nodes, None) for d, nodes in topology.domains().items()},
        )


def _place_group(reservations: Reservations, shape: _Shape, group: LearnerGroup) -> list[Placement]:
    if group.gpus_per_rank:
        fits = _fitting(reservations, group, shape.islands)
        if fits is not None:
            nodes, label = fits
            return _assign(reservations, group, nodes, label)
    fits_domain = _fitting(reservations, group, shape.domains)
    if fits_domain is not None:
        nodes, _ = fits_domain
        return _assign(reservations, group, nodes, None)
    raise PlacementRefused(group.name, _refusal(reservations, shape, group))


def _fitting(
    reservations: Reservations,
    group: LearnerGroup,
    candidates: dict[str, tuple[list[str], str | None]],
) -> tuple[list[str], str | None] | None:
    """Best fit: of the candidates with room for every rank, the one with the fewest free GPUs
    (ties by label). Candidates with too few free GPUs in total are skipped unexamined."""
    order = []
    for key, (_, island) in candidates.items():
        free = (
            reservations.free_in_domain[key] if island is None else reservations.free_in_island[key]
        )
        if free >= group.total_gpus:
            order.append((free, key))
    for _, key in sorted(order):
        nodes, island = candidates[key]
        if sum(_rank_slots(reservations.usage[n], group, island) for n in nodes) >= group.ranks:
            return candidates[key]
    return None


def _assign(
    reservations: Reservations, group: LearnerGroup, nodes: list[str], island: str | None
) -> list[Placement]:
    """Pack ranks onto the nodes with most room first, so a gang spans as few nodes as it can."""
    ranked = sorted(nodes, key=lambda n: (-_rank_slots(reservations.usage[n], group, island), n))
    out: list[Placement] = []
    for name in ranked:
        usage = reservations.usage[name]
        take = min(_rank_slots(usage, group, island), group.ranks - len(out))
        free = usage.free_gpus(island)
        for k in range(take):
            gpus = tuple(free[k * group.gpus_per_rank : (k + 1) * group.gpus_per_rank])
            out.append(
                Placement(
                    task=group.rank_task(len(out)),
                    node=name,
                    kind="learner",
                    gpus=gpus,
                    cpus=group.cpus_per_rank,
                    memory_mb=group.memory_mb_per_rank,
                    group=group.name,
                    movable=False,
                )
            )
        if len(out) == group.ranks:
            break
    return out


def _refusal(reservations: Reservations, shape: _Shape, group: LearnerGroup) -> str:
    need = (
        f"learner group {group.name!r} needs {group.total_gpus} GPUs "
        f"({group.ranks} ranks × {group.gpus_per_rank}, {group.cpus_per_rank:g} CPUs and "
        f"{group.memory_mb_per_rank} MB each)"
    )
    parts = [need + (" on one NVLink island" if group.gpus_per_rank else " in one RDMA domain")]
    if group.gpus_per_rank:
        free_by_island = reservations.free_in_island
        if free_by_island:
            label = max(sorted(free_by_island), key=lambda k: free_by_island[k])
            parts.append(f"largest free island has {free_by_island[label]} ({label})")
        else:
            parts.append("the cluster has no GPUs")
    by_domain = {
        d: sum(_rank_slots(reservations.usage[n], group, None) for n in nodes)
        for d, (nodes, _) in shape.domains.items()
    }
    if by_domain:
        d = max(sorted(by_domain), key=lambda k: by_domain[k])
        parts.append(f"one RDMA domain fits at most {by_domain[d]} of {group.ranks} ranks ({d})")
    never = _never_fits(reservations, shape, group)
    if never:
        parts += [never, "ask for fewer GPUs (ranks × GPUs per rank) or add larger nodes"]
    else:
        parts.append("free resources, add nodes or shrink the group")
    return "; ".join(parts)


def _never_fits(reservations: Reservations, shape: _Shape, group: LearnerGroup) -> str:
    """Why no RDMA domain could hold `group` even with every live node empty (what it asks
    for exceeds the hardware, so waiting will not help), else ''."""
    nodes = [u.node for u in reservations.usage.values() if u.node.state != "dead"]
    slots = {n.name: _empty_slots(n, group) for n in nodes}
    if any(
        sum(slots.get(n, 0) for n in names) >= group.ranks for names, _ in shape.domains.values()
    ):
        return ""
    islands: dict[str, int] = {}
    for node in nodes:
        for gpu in node.gpus:
            islands[gpu.island] = islands.get(gpu.island, 0) + 1
    largest = max(sorted(islands), key=lambda k: islands[k]) if islands else ""
    island = f"{islands[largest]} GPUs ({largest})" if largest else "none (no live node has GPUs)"
    most = max((len(n.gpus) for n in nodes), default=0)
    return (
        f"no RDMA domain of the live nodes could hold it even if they were empty: the largest "
        f"NVLink island holds {island}, the most GPUs on one node is {most}"
    )


def _empty_slots(node: Node, group: LearnerGroup) -> int:
    """How many ranks of `group` `node` could take with nothing else on it."""
    limits = [group.ranks]
    if group.gpus_per_rank:
        limits.append(len(node.gpus) // group.gpus_per_rank)
    if group.cpus_per_rank:
        limits.append(math.floor((node.cpus + CPU_EPSILON) / group.cpus_per_rank))
    if group.memory_mb_per_rank:
        limits.append(node.memory_mb // group.memory_mb_per_rank)
    return max(0, min(limits))


def _spread_actors(
    reservations: Reservations, actors: Sequence[RolloutActor]
) -> tuple[list[Placement], list[Refusal]]:
    heap = [
        (u.reserved_load(), name) for name, u in reservations.usage.items() if u.node.schedulable
    ]
    heapq.heapify(heap)
    placed: list[Placement] = []
    refused: list[Refusal] = []
    for actor in actors:
        skipped = []
        chosen: NodeUsage | None = None
        while heap:
            load, name = heapq.heappop(heap)
            usage = reservations.usage[name]
            if usage.fits(actor.cpus, actor.memory_mb) and usage.free_gpu_count >= actor.gpus:
                chosen = usage
                break
            skipped.append((load, name))
        for item in skipped:
            heapq.heappush(heap, item)
        if chosen is None:
            refused.append(Refusal(actor.name, _actor_refusal(reservations, actor)))
            continue
        p = Placement(
            task=actor.name,
            node=chosen.node.name,
            kind="rollout",
            gpus=tuple(chosen.free_gpus()[: actor.gpus]) if actor.gpus else (),
            cpus=actor.cpus,
            memory_mb=actor.memory_mb,
            movable=actor.movable,
        )
        reservations.add(p)
        placed.append(p)
        heapq.heappush(heap, (chosen.reserved_load(), chosen.node.name))
    return placed, refused


def _actor_refusal(reservations: Reservations, actor: RolloutActor) -> str:
    ready = [u for u in reservations.usage.values() if u.node.schedulable]
    if not ready:
        return f"rollout actor {actor.name!r}: no ready node (all cordoned, draining or dead)"
    cpus = max(u.free_cpus for u in ready)
    mem = max(u.free_memory_mb for u in ready)
    gpus = max(len(u.free_gpus()) for u in ready)
    return (
        f"rollout actor {actor.name!r} needs {actor.cpus:g} CPUs, {actor.memory_mb} MB and "
        f"{actor.gpus} GPUs on one node; the most free on any ready node is {cpus:g} CPUs, "
        f"{mem} MB, {gpus} GPUs; add nodes or lower the request"
    )
