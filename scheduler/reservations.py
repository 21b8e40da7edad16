"""What is reserved where: the one place that checks a reservation fits before it is made.

Placement and the balancer both work on a private `Reservations` built from the current placements,
so neither mutates its input and neither can over-commit a node.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from shoal.scheduler.errors import TopologyError
from shoal.scheduler.model import Node, Placement
from shoal.scheduler.topology import Topology

# Floating-point CPU requests (0.1 + 0.2 ...) must not refuse a task that fits exactly.
CPU_EPSILON = 1e-9


@dataclass
class NodeUsage:
    """Reserved resources on one node (mutable, private to one planning call)."""

    node: Node
    cpus: float = 0.0
    memory_mb: int = 0
    gpus: set[int] = field(default_factory=set)
    tasks: set[str] = field(default_factory=set)
    by_island: dict[str, list[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.by_island = {}
        for gpu in sorted(self.node.gpus, key=lambda g: g.index):
            self.by_island.setdefault(gpu.island, []).append(gpu.index)

    @property
    def free_cpus(self) -> float:
        return self.node.cpus - self.cpus

    @property
    def free_memory_mb(self) -> int:
        return self.node.memory_mb - self.memory_mb

    @property
    def free_gpu_count(self) -> int:
        return len(self.node.gpus) - len(self.gpus)

    def free_gpus(self, island: str | None = None) -> list[int]:
        """Free GPU indices, ascending; only those on `island` when given."""
        if island is None:
            return sorted(g.index for g in self.node.gpus if g.index not in self.gpus)
        return [i for i in self.by_island.get(island, ()) if i not in self.gpus]

    def fits(self, cpus: float, memory_mb: int) -> bool:
        return cpus <= self.free_cpus + CPU_EPSILON and memory_mb <= self.free_memory_mb

    def reserved_load(self) -> float:
        """The larger of the CPU and memory fractions reserved: what 'least loaded' compares."""
        cpu = self.cpus / self.node.cpus if self.node.cpus else (1.0 if self.cpus else 0.0)
        mem = (
            self.memory_mb / self.node.memory_mb
            if self.node.memory_mb
            else (1.0 if self.memory_mb else 0.0)
        )
        return max(cpu, mem)


class Reservations:
    """Reservations of every node; `add` refuses anything that would over-commit."""

    def __init__(self, topology: Topology, placements: Iterable[Placement] = ()) -> None:
        self.usage = {node.name: NodeUsage(node) for node in topology.nodes}
        self.where: dict[str, Placement] = {}
        # Free GPUs on ready nodes per island and per domain, kept current by add/remove, so
        # a planner can skip islands too small for a group without summing over their nodes.
        self.free_in_island: dict[str, int] = {}
        self.free_in_domain: dict[str, int] = {}
        for node in topology.nodes:
            self.free_in_domain.setdefault(node.domain, 0)
            for gpu in node.gpus:
                self.free_in_island.setdefault(gpu.island, 0)
                if node.schedulable:
                    self.free_in_island[gpu.island] += 1
                    self.free_in_domain[node.domain] += 1
        for placement in placements:
            self.add(placement)

    def add(self, p: Placement) -> None:
        if p.task in self.where:
            raise TopologyError(
                f"task {p.task!r} is placed twice (on {self.where[p.task].node!r} and {p.node!r})"
            )
        usage = self.usage.get(p.node)
        if usage is None:
            raise TopologyError(f"task {p.task!r} is placed on unknown node {p.node!r}")
        for index in p.gpus:
            if not any(g.index == index for g in usage.node.gpus):
                raise TopologyError(f"task {p.task!r}: node {p.node!r} has no GPU {index}")
            if index in usage.gpus:
                raise TopologyError(f"task {p.task!r}: GPU {index} of {p.node!r} is already in use")
        if not usage.fits(p.cpus, p.memory_mb):
            raise TopologyError(
                f"task {p.task!r} over-commits {p.node!r}: needs {p.cpus} CPUs / {p.memory_mb} MB, "
                f"{usage.free_cpus:g} CPUs / {usage.free_memory_mb} MB free"
            )
        usage.cpus += p.cpus
        usage.memory_mb += p.memory_mb
        usage.gpus.update(p.gpus)
        usage.tasks.add(p.task)
        self.where[p.task] = p
        self._count_free(usage, p.gpus, -1)

    def remove(self, task: str) -> Placement:
        p = self.where.pop(task)
        usage = self.usage[p.node]
        usage.cpus -= p.cpus
        usage.memory_mb -= p.memory_mb
        usage.gpus.difference_update(p.gpus)
        usage.tasks.discard(task)
        self._count_free(usage, p.gpus, +1)
        return p

    def _count_free(self, usage: NodeUsage, gpus: tuple[int, ...], delta: int) -> None:
        if not usage.node.schedulable:
            return
        for index in gpus:
            self.free_in_island[usage.node.island_of(index)] += delta
            self.free_in_domain[usage.node.domain] += delta
