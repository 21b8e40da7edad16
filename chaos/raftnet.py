"""Fault proxies on the Raft links between replicas, and the partition of one replica.

Each replica advertises its proxy's address (`--raft`) and listens behind it (`--raft-bind`).
pysyncobj opens one connection per pair of replicas, from the higher advertised address to the
lower one, so the proxy of replica R carries R's links to every higher-addressed peer, while R's
links to lower-addressed peers run through *their* proxies, mixed with other replicas' links.
Cutting R's proxy alone therefore leaves R connected to its lower peers. A partition of R:
  * R's own proxy refuses everything (links from higher peers into R);
  * every other proxy refuses, and cuts, the connections R itself opened (R's links to lower
    peers), recognised by the kernel's socket tables (`chaos.sockets`), since all peers connect
    from 127.0.0.1 and the bytes are encrypted.
The majority's links among themselves are untouched, in both directions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from shoal.chaos.cluster import Cluster, ProcessSpec
from shoal.chaos.errors import ChaosError, FaultError
from shoal.chaos.netfaults import NetFaults
from shoal.chaos.proxy import FaultProxy
from shoal.chaos.sockets import Endpoint, opened_by


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


class RaftMesh:
    """One FaultProxy per replica, listening on its advertised Raft address."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.proxies: dict[str, FaultProxy] = {}
        self._isolated: dict[str, int] = {}

    async def start(self, specs: Sequence[ProcessSpec]) -> list[int]:
        """Start the proxies (before the replicas, who need them to elect); returns the ports
        they and the replicas' bind addresses use, for the leak check."""
        ports = []
        for spec in specs:
            if spec.raft is None or spec.raft_bind is None:
                raise ChaosError(
                    f"{spec.name} binds its advertised Raft address itself; make the specs "
                    "with coordinator_specs(..., raft_bind=True) so a proxy can stand there"
                )
            target = ("127.0.0.1", _port(spec.raft_bind))
            proxy = await FaultProxy(target, listen_port=_port(spec.raft)).start()
            self.proxies[spec.name] = proxy
            ports += [proxy.port, target[1]]
        return ports

    def isolate(self, name: str) -> str:
        """Partition replica `name` from every peer, both directions."""
        pid = self.cluster.pid(name)
        if pid is None:
            raise FaultError(f"{name} is not running; there is nothing to partition")
        own = self.proxies[name]
        before = own.stats.reset
        own.set_faults(NetFaults(partition="refuse"))
        self._isolated[name] = pid
        outgoing = self._refuse_isolated()
        return (
            f"Raft links of {name} (pid {pid}) cut: {own.stats.reset - before} into it, "
            f"{outgoing} out of it"
        )

    def heal(self, name: str) -> str:
        self.proxies[name].heal()
        self._isolated.pop(name, None)
        self._refuse_isolated()
        return f"Raft links of {name} healed"

    def _refuse_isolated(self) -> int:
        """Make every proxy refuse the connections opened by any isolated replica."""
        filters = [opened_by(pid) for pid in self._isolated.values()]

        def from_isolated(client: Endpoint, server: Endpoint) -> bool:
            return any(match(client, server) for match in filters)

        return sum(
            proxy.refuse_from(from_isolated if filters else None) for proxy in self.proxies.values()
        )

    async def close(self) -> None:
        for proxy in self.proxies.values():
            with contextlib.suppress(Exception):
                await proxy.close()
        self.proxies.clear()
