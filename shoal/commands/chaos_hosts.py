"""`shoal chaos run --hosts N`: a scenario's cluster whose node daemons are hosts of their own.

The cluster is laid out as `shoal up --hosts N` lays it out
(shoal.local_hosts.create_hosts_cluster: the network, the cluster's CA, its storage), then
`shoal chaos run` rewrites its process specs for the chaos run (shoal/commands/chaos.py). `NamespaceHosts` is what the run's host faults
(chaos/hostfaults.py) do to those hosts, through shoal.hosts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from shoal import hosts
from shoal.chaos.errors import FaultError, FaultUnsupported

if TYPE_CHECKING:
    from shoal.chaos.scenario import Scenario
    from shoal.local import LocalCluster


class NamespaceHosts:
    """chaos.cluster.Hosts over the network of a `--hosts` cluster (shoal.hosts)."""

    def __init__(self, network: hosts.Network, storage: Path) -> None:
        self.network = network
        self._storage = storage

    @property
    def bridge_address(self) -> str:
        return self.network.bridge_address

    @property
    def subnet(self) -> str:
        return str(self.network.cidr)

    @property
    def storage(self) -> Path:
        return self._storage

    def address(self, node: str) -> str:
        return self._host(node).address

    def cut(self, node: str) -> None:
        self._do(hosts.cut, node)

    def heal(self, node: str) -> None:
        self._do(hosts.heal, node)

    def delay(self, node: str, ms: float) -> None:
        try:
            hosts.delay(self.network, node, ms)
        except hosts.NetemUnavailable as exc:
            raise FaultUnsupported(str(exc)) from None
        except hosts.HostNetworkError as exc:
            raise FaultError(str(exc)) from None

    def pids(self, node: str) -> list[int]:
        """Every process whose network namespace is the host's."""
        try:
            return hosts.pids(self.network, node)
        except hosts.HostNetworkError as exc:
            raise FaultError(str(exc)) from None

    def _host(self, node: str) -> hosts.Host:
        try:
            return self.network.host(node)
        except hosts.HostNetworkError as exc:
            raise FaultError(str(exc)) from None

    def _do(self, action: Callable[[hosts.Network, str], None], node: str) -> None:
        try:
            action(self.network, node)
        except hosts.HostNetworkError as exc:
            raise FaultError(str(exc)) from None


def make_hosts(local: LocalCluster, scenario: Scenario) -> NamespaceHosts:
    """Make `local` a cluster whose `scenario.nodes` nodes are hosts of their own, as `shoal
    up --hosts` does (the network, the cluster's CA, cluster.json): the caller then rewrites
    its specs for the chaos run (`local.create(specs, hosts.network)`) and removes the network
    in the end (`local.remove_network()`)."""
    from shoal.local_hosts import create_hosts_cluster

    network = create_hosts_cluster(local, scenario.nodes, scenario.replicas, scenario.sim_gpus)
    return NamespaceHosts(network, local.run_dir / "storage")
