"""Faults on whole hosts, for a cluster whose node daemons are hosts of their own (`shoal chaos
run --hosts N`: each in a network namespace on a private bridge, chaos/cluster.py `Hosts`).

- host-cut: the host's network is cut off the other hosts (its neighbour entries lead
  nowhere, shoal/hosts.py); the coordinators stay reachable, so its node stays alive while its
  tasks lose every peer on another host. Where the job's links run through the link relay
  (which sits on the bridge, where the cut does not reach), the relayed links with an end on
  that host are blackholed as well, so the cut is the whole cut. Heal: both lifted.
- host-kill: every process on the host (its namespace: the node daemon, its tasks, anything
  else) gets SIGKILL at once, as when a machine loses power. Heal: the node daemon is started
  again in the same namespace: the host came back, empty.
- host-delay: every packet to and from the host is delayed (netem on both ends of its veth).
  A kernel without netem cannot: the fault is FaultUnsupported and the run says so, rather
  than delaying something else and calling it that.

Coroutine methods, for the event loop: the `ip`/`tc` calls and signals run in worker threads,
the relay is touched on the loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

from shoal.chaos.cluster import Cluster, Hosts
from shoal.chaos.errors import FaultError, FaultUnsupported
from shoal.chaos.relay import LinkRelay
from shoal.chaos.scenario import DEFAULT_DELAY_MS, FaultSpec
from shoal.chaos.traffic import NetFaults
from shoal.errors import ShoalError

KILL_WAIT_S = 10.0
"""How long the processes of a killed host may take to be gone (SIGKILL is not refused)."""
POLL_S = 0.05
NO_HOSTS = (
    "the cluster's nodes share this host's network, so there is no host to fault; run the "
    "scenario with `shoal chaos run SCENARIO --hosts N` (root: each node a network namespace)"
)


class HostFaults:
    """host-* faults on the hosts of one chaos run (None: a cluster without hosts, where every
    host fault is unsupported). `relay`, once the run has started one, carries the job's links."""

    def __init__(self, hosts: Hosts | None, cluster: Cluster) -> None:
        self.hosts = hosts
        self.cluster = cluster
        self.relay: LinkRelay | None = None

    def _hosts(self) -> Hosts:
        if self.hosts is None:
            raise FaultUnsupported(NO_HOSTS)
        return self.hosts

    # -- host-cut ------------------------------------------------------------------------------

    async def cut(self, spec: FaultSpec, node: str) -> str:
        hosts = self._hosts()
        address = hosts.address(node)
        await asyncio.to_thread(hosts.cut, node)
        said = f"{node}'s host {address} cut off the other hosts (coordinators still reachable)"
        if self.relay is not None:
            hit = self.relay.inject(
                _name(spec), NetFaults(partition="blackhole"), addresses=[address]
            )
            said += f"; its relayed links blackholed ({hit} open now, new ones too)"
        return said

    async def uncut(self, spec: FaultSpec, node: str) -> str:
        hosts = self._hosts()
        if self.relay is not None:
            with contextlib.suppress(ShoalError):  # never injected: nothing to lift
                self.relay.heal(_name(spec))
        await asyncio.to_thread(hosts.heal, node)
        return f"{node}'s host reaches the other hosts again"

    # -- host-kill -----------------------------------------------------------------------------

    async def kill(self, node: str) -> str:
        return await asyncio.to_thread(self._kill, node)

    def _kill(self, node: str) -> str:
        hosts = self._hosts()
        pids = hosts.pids(node)
        if not pids:
            raise FaultError(f"nothing runs on {node}'s host {hosts.address(node)}")
        daemon = self.cluster.pid(node)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline and (hosts.pids(node) or self.cluster.pid(node)):
            time.sleep(POLL_S)
        left = hosts.pids(node)
        if left:
            raise FaultError(
                f"processes {left} on {node}'s host still run {KILL_WAIT_S:g} s after SIGKILL"
            )
        others = len([pid for pid in pids if pid != daemon])
        return (
            f"SIGKILL to all {len(pids)} processes on {node}'s host {hosts.address(node)} "
            f"(node daemon pid {daemon} and {others} others)"
        )

    async def revive(self, node: str) -> str:
        """The host is back: its node daemon starts again in its namespace (its tasks are the
        coordinator's to place again)."""
        if self.cluster.pid(node) is not None:
            return f"{node} already running"
        pid = await asyncio.to_thread(self.cluster.start, node)
        return f"{node}'s host back: node daemon started again (pid {pid})"

    # -- host-delay ----------------------------------------------------------------------------

    async def delay(self, spec: FaultSpec, node: str) -> str:
        hosts = self._hosts()
        ms = float(spec.params.get("delay_ms", DEFAULT_DELAY_MS))
        await asyncio.to_thread(hosts.delay, node, ms)
        return f"every packet to and from {node}'s host {hosts.address(node)} delayed {ms:g} ms"

    async def undelay(self, node: str) -> str:
        try:
            await asyncio.to_thread(self._hosts().delay, node, 0.0)
        except FaultUnsupported:
            return "nothing to heal"
        return f"{node}'s host undelayed"


def _name(spec: FaultSpec) -> str:
    return f"{spec.kind}@{spec.at:g}:{spec.target}"
