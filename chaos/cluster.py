"""What chaos needs of a cluster of processes, and of the hosts its nodes run on, as Protocols:
`shoal.local.LocalCluster` and `shoal.commands.chaos_hosts.NamespaceHosts` are the
implementations, handed in from above (chaos sits below shoal/ and never imports it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol


class ProcessSpec(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def api_url(self) -> str | None: ...

    @property
    def raft(self) -> str | None: ...

    @property
    def raft_bind(self) -> str | None: ...


class Cluster(Protocol):
    """Blocking methods over a run directory's processes; failures raise a ShoalError."""

    @property
    def run_dir(self) -> Path: ...

    @property
    def token(self) -> str: ...

    @property
    def tls_dir(self) -> Path | None:
        """The cluster's CA and certificate, where its API is https (a `--hosts` cluster)."""
        ...

    def specs(self) -> Sequence[ProcessSpec]: ...

    def spec(self, name: str) -> ProcessSpec: ...

    def pid(self, name: str) -> int | None: ...

    def start(self, name: str) -> int: ...

    def start_all(self) -> None: ...

    def kill(self, name: str) -> None: ...

    def stop_all(self) -> list[str]: ...

    def wait_ready(self, names: list[str] | None = None, timeout: float = 30.0) -> str: ...

    def get(self, url: str, timeout: float = 2.0) -> Any: ...


class Hosts(Protocol):
    """What chaos needs of a cluster whose node daemons are hosts of their own (network
    namespaces on a private bridge, `shoal.hosts`): `shoal.commands.chaos_hosts.NamespaceHosts`
    is the implementation. Nodes are named as the cluster names them (n1..nN). Blocking;
    failures raise a FaultError (FaultUnsupported where this machine cannot do it at all)."""

    @property
    def bridge_address(self) -> str:
        """Where every host reaches this one (coordinators, proxies, the link relay)."""
        ...

    @property
    def subnet(self) -> str:
        """The hosts' network (`10.x.y.0/24`): where the link relay may forward to."""
        ...

    @property
    def storage(self) -> Path:
        """The directory every host mounts (the distributed file system): checkpoints."""
        ...

    def address(self, node: str) -> str:
        """The address of the host that runs `node`."""
        ...

    def cut(self, node: str) -> None:
        """Drop the traffic between `node`'s host and every other host (not the bridge)."""
        ...

    def heal(self, node: str) -> None: ...

    def delay(self, node: str, ms: float) -> None:
        """Delay every packet to and from `node`'s host by `ms` (0: no more delay)."""
        ...

    def pids(self, node: str) -> list[int]:
        """Every process running on `node`'s host (its namespace)."""
        ...
