"""Fault proxies on the links from node daemons to the coordinator replicas' APIs.

A node daemon talks to the replicas' APIs directly (register, heartbeat, task reports), so to
fault that path each node gets its own proxy in front of each replica, on a port chosen before
the node's spec is written (the node's `--coordinators` list names the proxies). One proxy per
(node, replica) rather than one per replica: a fault on one node's links leaves every other
node's untouched, with no need to tell nodes apart by their sockets as the Raft mesh must.

The proxies start before the node daemons (whose first registration would otherwise be
refused) and forward to the replicas' real API addresses. They listen on 127.0.0.1, or on the
bridge address when the nodes are hosts of their own (network namespaces, which cannot reach
this host's loopback); an https API's TLS passes through them untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from urllib.parse import urlsplit

from shoal.chaos.cluster import ProcessSpec
from shoal.chaos.errors import ChaosError, FaultError
from shoal.chaos.proxy import FaultProxy
from shoal.chaos.traffic import NetFaults

# node name -> replica name -> the port (on the mesh's listen host) where that node reaches
# that replica
NodeLinks = dict[str, dict[str, int]]


def plan_links(nodes: Iterable[str], replicas: Sequence[str], port: Callable[[], int]) -> NodeLinks:
    """One proxy port per (node, replica), each drawn from `port` (a free-port finder)."""
    return {node: {replica: port() for replica in replicas} for node in nodes}


def coordinator_urls(
    links: NodeLinks, node: str, host: str = "127.0.0.1", scheme: str = "http"
) -> str:
    """The `--coordinators` value of `node`: its proxies on `host`, in the replicas' order
    (`scheme` https where the replicas' API is)."""
    return ",".join(f"{scheme}://{host}:{port}" for port in links[node].values())


def api_address(url: str) -> tuple[str, int]:
    """(host, port) of a replica's API URL (http or https)."""
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise ChaosError(f"API URL {url!r} names no host and port to put a proxy before")
    return parts.hostname, parts.port


class NodeMesh:
    """The proxies of every node's coordinator links, faulted node by node."""

    def __init__(self, links: NodeLinks, listen_host: str = "127.0.0.1") -> None:
        self.links = links
        self.listen_host = listen_host
        self.proxies: dict[str, dict[str, FaultProxy]] = {}

    async def start(self, coordinators: Sequence[ProcessSpec]) -> list[int]:
        """Start every proxy, forwarding to the replicas' API addresses; returns the ports
        they listen on, for the leak check."""
        apis = {spec.name: spec.api_url for spec in coordinators}
        ports = []
        for node, replicas in self.links.items():
            unknown = sorted(set(replicas) - set(apis))
            if unknown:
                raise ChaosError(f"node {node} links to replicas {unknown}; known: {sorted(apis)}")
            self.proxies[node] = {}
            for replica, port in replicas.items():
                url = apis[replica]
                if url is None:
                    raise ChaosError(f"{replica} has no API address for {node} to reach")
                proxy = FaultProxy(api_address(url), listen_port=port, listen_host=self.listen_host)
                await proxy.start()
                self.proxies[node][replica] = proxy
                ports.append(proxy.port)
        return ports

    def _of(self, node: str) -> dict[str, FaultProxy]:
        if node not in self.proxies:
            raise FaultError(
                f"no coordinator-link proxies for node {node!r}; known: {sorted(self.proxies)}"
            )
        return self.proxies[node]

    def degrade(self, node: str, faults: NetFaults) -> str:
        """Every link of `node` to a replica gets `faults` (a partition cuts open ones)."""
        proxies = self._of(node)
        for proxy in proxies.values():
            proxy.set_faults(faults)
        return f"{node}'s links to {sorted(proxies)}: {faults.to_dict()}"

    def reset(self, node: str) -> str:
        """Cut every open connection of `node` to a replica with a RST, once."""
        cut = sum(proxy.reset_connections() for proxy in self._of(node).values())
        return f"reset {cut} of {node}'s connections to the coordinators"

    def heal(self, node: str) -> str:
        for proxy in self._of(node).values():
            proxy.heal()
        return f"{node}'s coordinator links healed"

    async def close(self) -> None:
        for proxies in self.proxies.values():
            for proxy in proxies.values():
                with contextlib.suppress(Exception):
                    await proxy.close()
        self.proxies.clear()
