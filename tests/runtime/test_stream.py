"""Big frames over a link's bulk stream: raw TCP beside the websocket, real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import torch

from shoal.errors import ConfigError
from shoal.runtime.actor import Actor
from shoal.runtime.link import Link
from shoal.runtime.loop import run
from shoal.runtime.remote import RemoteRef
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import Transport, TransportConfig, attach

TOKEN = "bulk-token"
BIG = 300 * 1024  # over the default bulk threshold of 256 KiB


class Ledger(Actor):
    """Remembers what arrived, in order, and what it was."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.kept: list[Any] = []

    def note(self, n: int, payload: Any = None) -> int:
        self.order.append(n)
        self.kept.append(payload)
        return n

    def seen(self) -> list[int]:
        return self.order

    def echo(self, value: Any) -> Any:
        return value

    def shape_and_sum(self, value: Any) -> tuple[list[int], float, bool]:
        """What arrived, and whether the receiver may write into it (its own buffer)."""
        writable = value.flags.writeable if isinstance(value, np.ndarray) else True
        return list(value.shape), float(value.sum()), writable


@contextlib.asynccontextmanager
async def node(**options: Any) -> AsyncIterator[tuple[ActorSystem, Transport]]:
    async with ActorSystem() as system:
        transport = await attach(system, TransportConfig(token=TOKEN, **options))
        try:
            yield system, transport
        finally:
            await transport.close()


@contextlib.asynccontextmanager
async def pair(
    server: dict[str, Any] | None = None, client: dict[str, Any] | None = None
) -> AsyncIterator[tuple[ActorSystem, RemoteRef, Link, Transport]]:
    """A server with a `ledger` actor, a client ref to it and the client's open link."""
    async with (
        node(**(server or {})) as (server_system, server_transport),
        node(**(client or {})) as (client_system, client_transport),
    ):
        await server_system.spawn(Ledger, name="ledger")
        ref = client_system.ref(f"{server_transport.address}/ledger")
        assert isinstance(ref, RemoteRef)
        assert await ref.ask.seen() == []
        link = client_transport.peer(server_transport.address).link_nowait()
        yield server_system, ref, link, server_transport


def inbound(transport: Transport) -> Link:
    (link,) = transport._inbound
    return link


@pytest.mark.timeout(30)
def test_big_arrays_and_tensors_cross_on_the_bulk_stream_intact() -> None:
    async def main() -> None:
        async with pair() as (_, ref, link, server):
            assert link.has_bulk
            for _ in range(100):  # the server attaches its end when the client's hello arrives
                if inbound(server).has_bulk:
                    break
                await asyncio.sleep(0.01)
            assert inbound(server).has_bulk
            weights = torch.randn(3, 512, 512)
            back = await ref.ask.echo(weights)  # a big request and a big reply
            assert torch.equal(back, weights)
            half = torch.randn(400, 1024).to(torch.bfloat16)
            assert torch.equal(await ref.ask.echo(half), half)
            obs = np.arange(100_000, dtype=np.float64).reshape(1000, 100)
            shape, total, writable = await ref.ask.shape_and_sum(obs)
            assert shape == [1000, 100]
            assert total == float(obs.sum())
            assert writable  # built on the frame's own buffer, not on read-only bytes
            mixed = {"obs": obs, "mask": np.ones(BIG, dtype=np.bool_), "step": (7, "x")}
            back_mixed = await ref.ask.echo(mixed)
            np.testing.assert_array_equal(back_mixed["obs"], obs)
            assert back_mixed["mask"].all()
            assert back_mixed["step"] == (7, "x")

    run(main())


@pytest.mark.timeout(30)
def test_big_and_small_requests_reach_the_actor_in_send_order() -> None:
    async def main() -> None:
        async with pair() as (_, ref, link, _server):
            assert link.has_bulk
            asks = []
            for n in range(120):
                payload = np.full(BIG // 8, n, dtype=np.float64) if n % 3 == 0 else n
                if n % 5 == 0:
                    asks.append(asyncio.create_task(ref.ask.note(n, payload)))
                    await asyncio.sleep(0)  # the ask's frame is queued now, in order
                elif n % 7 == 0:
                    ref.tell_nowait.note(n, payload)
                else:
                    await ref.tell.note(n, payload)
            assert await asyncio.gather(*asks) == list(range(0, 120, 5))
            assert await ref.ask.seen() == list(range(120))

    run(main())


@pytest.mark.timeout(30)
def test_frames_below_the_threshold_stay_on_the_websocket() -> None:
    async def main() -> None:
        async with pair(client={"bulk_threshold": 1 << 20}) as (_, ref, link, server):
            assert link.has_bulk
            await ref.ask.shape_and_sum(np.zeros(BIG, dtype=np.uint8))
            served = inbound(server)._bulk
            assert served is not None
            assert served.received < 1024
            await ref.ask.shape_and_sum(np.zeros(2 << 20, dtype=np.uint8))
            assert served.received > 2 << 20

    run(main())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("side", ["server", "client"])
def test_without_a_bulk_stream_big_frames_use_the_websocket(side: str) -> None:
    async def main() -> None:
        off = {"bulk": False}
        async with pair(**{side: off}) as (_, ref, link, _server):
            assert not link.has_bulk
            weights = torch.randn(600, 1024)
            assert torch.equal(await ref.ask.echo(weights), weights)
            for n in range(20):
                await ref.tell.note(n, np.full(BIG, n, dtype=np.uint8))
            assert await ref.ask.seen() == list(range(20))

    run(main())


@pytest.mark.timeout(30)
def test_a_link_that_reconnects_gets_a_new_bulk_stream() -> None:
    async def main() -> None:
        async with pair() as (_, ref, link, server):
            await inbound(server).close()
            await link.wait_closed()
            weights = torch.randn(512, 512)
            for _ in range(100):  # the peer reconnects in the background
                try:
                    back = await ref.ask.echo(weights)
                    break
                except Exception:
                    await asyncio.sleep(0.05)
            assert torch.equal(back, weights)
            fresh = ref._peer.link_nowait()
            assert fresh is not link
            assert fresh.has_bulk

    run(main())


@pytest.mark.timeout(30)
def test_big_frames_spend_credit_like_small_ones() -> None:
    """A window of 4 frames lets a slow actor hold back a producer of big tensors just as it
    holds back small tells (the marker on the websocket carries the frame's credit)."""

    async def main() -> None:
        gate = asyncio.Event()

        class Held(Actor):
            def __init__(self) -> None:
                self.count = 0

            async def take(self, value: Any) -> None:
                await gate.wait()
                self.count += 1

            def taken(self) -> int:
                return self.count

        async with node(credit_frames=4) as (server, transport), node() as (client, _):
            await server.spawn(Held, name="held", mailbox_size=1)
            ref = client.ref(f"{transport.address}/held")
            assert await ref.ask.taken() == 0
            sent = 0

            async def produce() -> None:
                nonlocal sent
                for _ in range(40):
                    await ref.tell.take(np.ones(BIG, dtype=np.uint8))
                    sent += 1

            producer = asyncio.create_task(produce())
            await asyncio.sleep(0.5)
            # the window, plus what the actor took in: its mailbox and the held handler
            assert 4 <= sent <= 4 + 1 + 1
            gate.set()
            await producer
            assert await ref.ask.taken() == 40

    run(main())


def test_bulk_config_is_validated_with_the_key_named() -> None:
    with pytest.raises(ConfigError, match="bulk_threshold=12"):
        TransportConfig(token=TOKEN, bulk_threshold=12)
    with pytest.raises(ConfigError, match="bulk_port=70000"):
        TransportConfig(token=TOKEN, bulk_port=70000)
    with pytest.raises(ConfigError, match="bulk='yes'"):
        TransportConfig(token=TOKEN, bulk="yes")  # type: ignore[arg-type]
