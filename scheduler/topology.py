"""The cluster as the scheduler sees it: nodes → GPUs → NVLink islands → RDMA domains.

An island is a label on each GPU rather than a property of a node, so one island can be a
node's eight GPUs or, as in the seed's cluster, sixteen GPUs spread over two nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.config import check_int
from shoal.errors import ConfigError
from shoal.scheduler.errors import TopologyError
from shoal.scheduler.model import Gpu, Node


@dataclass(frozen=True)
class Topology:
    """All nodes of the cluster, in a fixed order (the scheduler's tie-break is by name)."""

    nodes: tuple[Node, ...]

    def __post_init__(self) -> None:
        names = [node.name for node in self.nodes]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise TopologyError(
                f"node names repeat: {', '.join(dup)}; give every node its own name"
            )
        self._check_islands()

    def _check_islands(self) -> None:
        domain_of: dict[str, str] = {}
        for node in self.nodes:
            for gpu in node.gpus:
                first = domain_of.setdefault(gpu.island, node.domain)
                if first != node.domain:
                    raise TopologyError(
                        f"NVLink island {gpu.island!r} spans RDMA domains {first!r} and "
                        f"{node.domain!r}; an island must lie inside one domain"
                    )

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise TopologyError(f"unknown node {name!r}; known nodes: {len(self.nodes)}")

    def by_name(self) -> dict[str, Node]:
        return {node.name: node for node in self.nodes}

    def islands(self) -> dict[str, list[tuple[str, int]]]:
        """Island label → its GPUs as (node, index), in node order."""
        out: dict[str, list[tuple[str, int]]] = {}
        for node in self.nodes:
            for gpu in node.gpus:
                out.setdefault(gpu.island, []).append((node.name, gpu.index))
        return out

    def domains(self) -> dict[str, list[str]]:
        """RDMA domain label → node names, in node order."""
        out: dict[str, list[str]] = {}
        for node in self.nodes:
            out.setdefault(node.domain, []).append(node.name)
        return out

    def with_state(self, name: str, state: str) -> Topology:
        """A copy with one node's state changed (cordon, drain, dead)."""
        self.node(name)
        return Topology(
            tuple(
                Node(n.name, n.cpus, n.memory_mb, n.gpus, n.domain, state) if n.name == name else n
                for n in self.nodes
            )
        )


def _check_positive(name: str, value: int) -> None:
    """shoal.config.check_int, raised as the scheduler's own error."""
    try:
        check_int(name, value, 1)
    except ConfigError as exc:
        raise TopologyError(f"simulated_cluster: {exc}") from None


def simulated_cluster(
    nodes: int,
    gpus_per_node: int,
    island_size: int = 16,
    nodes_per_domain: int = 32,
    cpus: float = 64.0,
    memory_mb: int = 512 * 1024,
    prefix: str = "node",
) -> Topology:
    """A regular cluster: islands of `island_size` consecutive GPUs (crossing node boundaries
    when larger than a node), domains of `nodes_per_domain` consecutive nodes.

    An island never crosses a domain boundary, so `island_size` must divide the GPUs of one
    domain; otherwise the simulated hardware would be impossible.
    """
    _check_positive("nodes", nodes)
    _check_positive("nodes_per_domain", nodes_per_domain)
    _check_positive("island_size", island_size)
    if not isinstance(gpus_per_node, int) or gpus_per_node < 0:
        raise TopologyError(
            f"simulated_cluster: gpus_per_node must be an int >= 0, got {gpus_per_node!r}"
        )
    per_domain = gpus_per_node * nodes_per_domain
    if gpus_per_node and per_domain % island_size:
        raise TopologyError(
            f"simulated_cluster: island_size {island_size} does not divide the {per_domain} GPUs "
            f"of one domain ({nodes_per_domain} nodes × {gpus_per_node}); pick a divisor"
        )
    width = len(str(nodes - 1))
    return Topology(
        tuple(
            _sim_node(
                i,
                gpus_per_node,
                island_size,
                nodes_per_domain,
                cpus,
                memory_mb,
                f"{prefix}-{i:0{width}d}",
            )
            for i in range(nodes)
        )
    )


def _sim_node(
    i: int,
    gpus_per_node: int,
    island_size: int,
    per_domain: int,
    cpus: float,
    memory_mb: int,
    name: str,
) -> Node:
    first = i * gpus_per_node
    gpus = tuple(Gpu(k, f"island-{(first + k) // island_size}") for k in range(gpus_per_node))
    return Node(name, cpus, memory_mb, gpus, f"domain-{i // per_domain}")
