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

Delay, jitter and loss on R's links follow the same map: R's own proxy gets the faults (links
into R), and every other proxy gives them to the connections R opened (R's links out), so each
of R's links is degraded in both directions and the links among its peers are not.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence

from shoal.chaos.cluster import Cluster, ProcessSpec
from shoal.chaos.errors import ChaosError, FaultError, ProxyError
from shoal.chaos.proxy import FaultProxy, LinkFaults
from shoal.chaos.sockets import Endpoint, opened_by
from shoal.chaos.traffic import NetFaults


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


class RaftMesh:
    """One FaultProxy per replica, listening on its advertised Raft address."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.proxies: dict[str, FaultProxy] = {}
        self._isolated: dict[str, int] = {}
        self._degraded: dict[str, tuple[int, NetFaults]] = {}

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

    def delay(self, name: str, delay_s: float, jitter_s: float = 0.0) -> str:
        """Every Raft link of `name` delayed by `delay_s` ± `jitter_s` each way, per chunk
        (order kept); combines with `loss` until `heal`."""
        return self._degrade(
            name, "delayed", lambda f: dataclasses.replace(f, delay_s=delay_s, jitter_s=jitter_s)
        )

    def loss(self, name: str, p: float, mode: str = "stall", stall_s: float = 0.2) -> str:
        """Each chunk on a Raft link of `name` is lost with probability `p`: "stall" holds the
        stream `stall_s` (a TCP retransmission; 0.2 s is Linux's minimum timeout), "drop"
        cuts the connection (loss that outlasts retransmission; pysyncobj reconnects)."""
        return self._degrade(
            name,
            "lossy",
            lambda f: dataclasses.replace(f, loss=p, loss_mode=mode, stall_s=stall_s),
        )

    def _degrade(self, name: str, what: str, change: Callable[[NetFaults], NetFaults]) -> str:
        pid = self.cluster.pid(name)
        if pid is None:
            raise FaultError(f"{name} is not running; there is nothing to degrade")
        if name not in self.proxies:
            raise FaultError(f"no Raft proxy for {name!r}; known: {sorted(self.proxies)}")
        if name in self._isolated:
            raise FaultError(f"{name} is partitioned; heal it before delaying its links")
        _, old = self._degraded.get(name, (pid, NetFaults()))
        try:
            faults = change(old)
        except ProxyError as exc:
            raise FaultError(f"Raft links of {name}: {exc}") from exc
        self._degraded[name] = (pid, faults)
        own = self.proxies[name]
        own.set_faults(faults)
        inward = own.stats.open
        outward = self._apply_degraded()
        return (
            f"Raft links of {name} (pid {pid}) {what}: {_describe(faults)} "
            f"({inward} into it, {outward} opened by degraded replicas)"
        )

    def heal(self, name: str) -> str:
        self.proxies[name].heal()
        self._isolated.pop(name, None)
        self._degraded.pop(name, None)
        self._refuse_isolated()
        self._apply_degraded()
        return f"Raft links of {name} healed"

    def _apply_degraded(self) -> int:
        """Give every other proxy's connections opened by a degraded replica that replica's
        faults; returns how many open connections carry such faults now."""
        total = 0
        for owner, proxy in self.proxies.items():
            choose = self._chooser(owner)
            total += proxy.set_link_faults(choose)
        return total

    def _chooser(self, owner: str) -> LinkFaults | None:
        """Per connection into `owner`'s proxy: the faults of the degraded replica that opened
        it, added to `owner`'s own when both ends are degraded; else None (the proxy's)."""
        matchers = [
            (opened_by(pid), faults)
            for name, (pid, faults) in self._degraded.items()
            if name != owner
        ]
        if not matchers:
            return None
        own = self._degraded[owner][1] if owner in self._degraded else NetFaults()

        def choose(client: Endpoint, server: Endpoint) -> NetFaults | None:
            dialler = next((f for match, f in matchers if match(client, server)), None)
            return None if dialler is None else both_ends(own, dialler)

        return choose

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


def both_ends(a: NetFaults, b: NetFaults) -> NetFaults:
    """The faults of a link whose two ends are degraded: delays and jitters add up, losses
    are independent (1 − (1 − a)(1 − b)), and the lossier end's mode holds."""
    lossier = a if a.loss >= b.loss else b
    return NetFaults(
        delay_s=min(a.delay_s + b.delay_s, 3600.0),
        jitter_s=min(a.jitter_s + b.jitter_s, 3600.0),
        loss=1.0 - (1.0 - a.loss) * (1.0 - b.loss),
        loss_mode=lossier.loss_mode,
        stall_s=lossier.stall_s,
    )


def _describe(faults: NetFaults) -> str:
    parts = []
    if faults.delay_s or faults.jitter_s:
        parts.append(f"delay {faults.delay_s:g} ± {faults.jitter_s:g} s")
    if faults.loss:
        parts.append(f"loss {faults.loss:g} ({faults.loss_mode})")
    return ", ".join(parts) or "no faults"
