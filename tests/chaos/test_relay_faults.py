"""Link faults through the relay between real processes: this process dials two children through
a `LinkRelay`, and each fault, aimed at one child's pid, hits that child's links (found by the
port it listens on) and not the other's; aimed at this process, it hits every link it dialled.
Timings are only lower bounds a fault guarantees."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
import torch

from shoal.chaos.relay import LinkRelay
from shoal.chaos.traffic import NetFaults
from shoal.runtime.errors import AskTimeout, LinkClosed
from shoal.runtime.loop import run
from shoal.runtime.ref import ActorRef
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import TransportConfig, attach
from tests.support.waiting import eventually_async

pytestmark = pytest.mark.timeout(90)

TOKEN = "relay-faults-token"

# The child imports torch before it announces its address: the first tensor it receives would
# otherwise import it inside an ask, seconds of a loaded machine's time with its loop blocked.
CHILD = """
import asyncio, os, sys
import torch
from shoal.runtime.actor import Actor
from shoal.runtime.loop import run
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import TransportConfig, attach

class Worker(Actor):
    def pid(self):
        return os.getpid()

    def double(self, tensor):
        return tensor * 2

async def main():
    async with ActorSystem() as system:
        await system.spawn(Worker, name="worker")
        transport = await attach(system, TransportConfig(token=sys.argv[1], relay=None))
        print(transport.address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await transport.close()

run(main())
"""

Children = list[tuple[int, str]]
Check = Callable[[LinkRelay, ActorRef, ActorRef, int], Awaitable[None]]


@pytest.fixture(scope="module")
def children() -> Iterator[Children]:
    """Two child processes serving a `worker` actor each: (pid, address); killed at the end."""
    procs: list[subprocess.Popen[str]] = []
    try:
        found: Children = []
        for _ in range(2):
            proc = subprocess.Popen(
                [sys.executable, "-c", CHILD, TOKEN],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(proc)
            assert proc.stdout is not None
            found.append((proc.pid, proc.stdout.readline().strip()))
        yield found
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()


def _through_relay(children: Children, check: Check) -> None:
    """Dial both children through a fresh relay, make sure both links are up, run `check`."""
    (pid, address), (_, other_address) = children

    async def main() -> None:
        async with LinkRelay(seed=7) as relay, ActorSystem() as system:
            config = TransportConfig(token=TOKEN, relay=relay.address, connect_timeout=5.0)
            transport = await attach(system, config)
            try:
                one = system.ref(f"{address}/worker")
                other = system.ref(f"{other_address}/worker")
                assert await one.ask.pid() == pid
                assert await other.ask.pid() != pid
                assert relay.stats.relayed == 4
                await check(relay, one, other, pid)
            finally:
                await transport.close()

    run(main())


async def _until_answered(ref: ActorRef) -> None:
    """Ask until the link is back."""

    async def answered() -> bool:
        try:
            await ref.ask(timeout=2.0).pid()
        except (LinkClosed, AskTimeout):
            return False
        return True

    await eventually_async(answered, "the link came back")


def test_a_delay_hits_the_chosen_process_links_only(children: Children) -> None:
    async def check(relay: LinkRelay, one: ActorRef, other: ActorRef, pid: int) -> None:
        assert relay.inject("slow", NetFaults(delay_s=0.3), [pid]) == 2
        start = time.monotonic()
        assert await one.ask.pid() == pid
        assert time.monotonic() - start >= 0.55  # 0.3 s each way at least
        assert [link["faults"]["delay_s"] for link in relay.links([pid])] == [0.3, 0.3]
        assert all(
            link["faults"]["delay_s"] == 0
            for link in relay.links()
            if link not in relay.links([pid])
        )
        # Aimed at the dialler, the same fault hits every link this process opened.
        assert relay.inject("slow", NetFaults(delay_s=0.2), [os.getpid()]) == 4
        assert {link["faults"]["delay_s"] for link in relay.links()} == {0.2}
        relay.heal("slow")
        assert {link["faults"]["delay_s"] for link in relay.links()} == {0.0}
        assert await other.ask.pid() != pid

    _through_relay(children, check)


def test_a_refusing_partition_cuts_one_process_until_healed(children: Children) -> None:
    async def check(relay: LinkRelay, one: ActorRef, other: ActorRef, pid: int) -> None:
        relay.inject("cut", NetFaults(partition="refuse"), [pid])
        with pytest.raises(LinkClosed):
            await one.ask(timeout=5.0).pid()
        with pytest.raises(LinkClosed, match="no link"):
            await one.ask(timeout=5.0).pid()
        weights = torch.randn(64, 256)
        assert torch.equal(await other.ask.double(weights), weights * 2)
        assert relay.stats.refused >= 1
        relay.heal("cut")
        await _until_answered(one)

    _through_relay(children, check)


def test_a_blackhole_holds_the_bytes_until_healed(children: Children) -> None:
    async def check(relay: LinkRelay, one: ActorRef, other: ActorRef, pid: int) -> None:
        relay.inject("hole", NetFaults(partition="blackhole"), [pid])
        with pytest.raises(AskTimeout):
            await one.ask(timeout=1.0).pid()
        assert await other.ask.pid() != pid
        relay.heal("hole")
        await _until_answered(one)

    _through_relay(children, check)


def test_a_reset_cuts_the_links_once_and_they_come_back(children: Children) -> None:
    async def check(relay: LinkRelay, one: ActorRef, other: ActorRef, pid: int) -> None:
        assert relay.reset([pid]) == 2
        await _until_answered(one)
        assert relay.stats.relayed == 6
        assert relay.stats.reset == 2

    _through_relay(children, check)


def test_bandwidth_and_loss_apply_per_link(children: Children) -> None:
    async def check(relay: LinkRelay, one: ActorRef, other: ActorRef, pid: int) -> None:
        relay.inject("narrow", NetFaults(bandwidth_bps=40_000), [pid])
        weights = torch.randn(64, 256)  # 64 KiB each way
        start = time.monotonic()
        assert torch.equal(await one.ask(timeout=30).double(weights), weights * 2)
        assert time.monotonic() - start >= 1.5
        relay.inject("lossy", NetFaults(loss=1.0), [pid])
        with pytest.raises((LinkClosed, AskTimeout)):
            await one.ask(timeout=2.0).double(weights)
        assert relay.stats.dropped >= 1
        assert await other.ask.pid() != pid
        relay.heal_all()
        await _until_answered(one)

    _through_relay(children, check)
