"""Host faults against stand-in hosts (no root needed): a killed host's processes are real
children of this test, SIGKILLed together and the node daemon started again; a cut reaches
the link relay's links of that host; what this machine cannot do is FaultUnsupported. The
same faults on real namespaces run in test_hosts_chaos.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.chaos.errors import FaultUnsupported, ProxyError
from shoal.chaos.hostfaults import HostFaults
from shoal.chaos.relay import LinkRelay
from shoal.chaos.scenario import parse

pytestmark = pytest.mark.timeout(60)

SCENARIO = parse(
    "nodes = 2\n[[faults]]\nkind = 'host-cut'\ntarget = 'n1'\nat = 1\n"
    "[[faults]]\nkind = 'host-delay'\ntarget = 'n1'\nat = 2\ndelay_ms = 40"
)
CUT, DELAY = SCENARIO.faults


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


class StandIn:
    """One host (node n1 at 127.0.0.2) whose processes are children of this test, and the
    cluster that starts its node daemon."""

    bridge_address = "127.0.0.1"
    subnet = "127.0.0.0/8"
    storage = Path("/nonexistent")

    def __init__(self, netem: bool = True) -> None:
        self.netem = netem
        self.calls: list[tuple[str, str, float]] = []
        self.daemon = sleeper()
        self.procs = [self.daemon, sleeper(), sleeper()]

    def address(self, node: str) -> str:
        return "127.0.0.2"

    def cut(self, node: str) -> None:
        self.calls.append(("cut", node, 0.0))

    def heal(self, node: str) -> None:
        self.calls.append(("heal", node, 0.0))

    def delay(self, node: str, ms: float) -> None:
        if not self.netem:
            raise FaultUnsupported("this kernel has no netem qdisc")
        self.calls.append(("delay", node, ms))

    def pids(self, node: str) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is None]

    # -- the cluster's side --

    def pid(self, name: str) -> int | None:
        return self.daemon.pid if self.daemon.poll() is None else None

    def start(self, name: str) -> int:
        self.daemon = sleeper()
        self.procs.append(self.daemon)
        return self.daemon.pid


@pytest.fixture
def host() -> Iterator[StandIn]:
    stand_in = StandIn()
    try:
        yield stand_in
    finally:
        for proc in stand_in.procs:
            proc.kill()
            proc.wait()


def test_a_killed_host_loses_every_process_and_comes_back_with_its_node(host: StandIn) -> None:
    faults = HostFaults(host, host)  # type: ignore[arg-type]
    first = host.daemon.pid
    said = asyncio.run(faults.kill("n1"))
    assert said == (
        f"SIGKILL to all 3 processes on n1's host 127.0.0.2 (node daemon pid {first} and 2 others)"
    )
    assert all(p.poll() == -9 for p in host.procs)
    back = asyncio.run(faults.revive("n1"))
    assert back == f"n1's host back: node daemon started again (pid {host.daemon.pid})"
    assert host.daemon.pid != first
    assert asyncio.run(faults.revive("n1")) == "n1 already running"


def test_a_cut_host_loses_its_relayed_links_too_until_healed(host: StandIn) -> None:
    async def main() -> None:
        faults = HostFaults(host, host)  # type: ignore[arg-type]
        async with LinkRelay() as relay:
            faults.relay = relay
            said = await faults.cut(CUT, "n1")
            assert said.startswith("n1's host 127.0.0.2 cut off the other hosts")
            assert "its relayed links blackholed (0 open now, new ones too)" in said
            assert await faults.uncut(CUT, "n1") == "n1's host reaches the other hosts again"
            with pytest.raises(ProxyError, match="no link fault named"):
                relay.heal("host-cut@1:n1")  # lifted with the cut
        assert host.calls == [("cut", "n1", 0.0), ("heal", "n1", 0.0)]

    asyncio.run(main())


def test_a_delay_needs_netem_and_says_so_without_it(host: StandIn) -> None:
    faults = HostFaults(host, host)  # type: ignore[arg-type]
    said = asyncio.run(faults.delay(DELAY, "n1"))
    assert said == "every packet to and from n1's host 127.0.0.2 delayed 40 ms"
    assert asyncio.run(faults.undelay("n1")) == "n1's host undelayed"
    assert host.calls == [("delay", "n1", 40.0), ("delay", "n1", 0.0)]
    host.netem = False
    with pytest.raises(FaultUnsupported, match="no netem"):
        asyncio.run(faults.delay(DELAY, "n1"))
    assert asyncio.run(faults.undelay("n1")) == "nothing to heal"


def test_without_hosts_every_host_fault_is_unsupported(host: StandIn) -> None:
    faults = HostFaults(None, host)  # type: ignore[arg-type]
    for fault in (faults.cut(CUT, "n1"), faults.kill("n1"), faults.delay(DELAY, "n1")):
        with pytest.raises(FaultUnsupported, match="--hosts N"):
            asyncio.run(fault)
