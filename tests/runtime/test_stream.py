"""A link's frame stream: raw TCP beside the websocket, over real sockets on 127.0.0.1, and
its frame parser fed a byte stream cut anywhere."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import ConfigError
from shoal.runtime import wire
from shoal.runtime.actor import Actor
from shoal.runtime.errors import WireError
from shoal.runtime.link import Link
from shoal.runtime.loop import run
from shoal.runtime.remote import RemoteRef
from shoal.runtime.stream import DIRECT_BYTES, FrameStream
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import Transport, TransportConfig, attach

pytestmark = pytest.mark.usefixtures("no_asyncio_errors")

TOKEN = "stream-token"
BIG = 300 * 1024  # received in a buffer of its own


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
def test_big_arrays_and_tensors_cross_on_the_stream_intact() -> None:
    async def main() -> None:
        async with pair() as (_, ref, link, server):
            assert link.has_stream
            assert inbound(server).has_stream
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
            assert link.has_stream
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
def test_the_websocket_carries_no_frames_once_the_stream_is_up() -> None:
    async def main() -> None:
        async with pair() as (_, ref, _link, server):
            served = inbound(server).stream
            assert served is not None
            before = served.received
            for n in range(50):
                await ref.tell.note(n)
            assert await ref.ask.seen() == list(range(50))
            assert served.received > before + 50 * wire.PREFIX_SIZE

    run(main())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("side", ["server", "client"])
def test_without_a_stream_frames_use_the_websocket(side: str) -> None:
    async def main() -> None:
        off = {"stream": False}
        async with pair(**{side: off}) as (_, ref, link, server):
            assert not link.has_stream
            assert not inbound(server).has_stream
            weights = torch.randn(600, 1024)
            assert torch.equal(await ref.ask.echo(weights), weights)
            for n in range(20):
                await ref.tell.note(n, np.full(BIG, n, dtype=np.uint8))
            assert await ref.ask.seen() == list(range(20))

    run(main())


@pytest.mark.timeout(30)
def test_a_link_that_reconnects_gets_a_new_stream() -> None:
    async def main() -> None:
        async with pair() as (_, ref, link, server):
            await inbound(server).close()
            await link.wait_closed()
            weights = torch.randn(512, 512)
            for _ in range(200):  # the peer reconnects in the background
                try:
                    back = await ref.ask.echo(weights)
                    break
                except Exception:
                    await asyncio.sleep(0.05)
            assert torch.equal(back, weights)
            fresh = ref._peer.link_nowait()
            assert fresh is not link
            assert fresh.has_stream

    run(main())


@pytest.mark.timeout(30)
def test_big_frames_spend_credit_like_small_ones() -> None:
    """A window of 4 frames lets a slow actor hold back a producer of big tensors just as it
    holds back small tells."""

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
            window_spent = asyncio.Event()

            async def produce() -> None:
                nonlocal sent
                for _ in range(40):
                    await ref.tell.take(np.ones(BIG, dtype=np.uint8))
                    sent += 1
                    if sent == 4:
                        window_spent.set()

            producer = asyncio.create_task(produce())
            async with asyncio.timeout(10):
                await window_spent.wait()
            await asyncio.sleep(0.3)  # room for any send the window would wrongly allow
            # the window, plus what the actor took in: its mailbox and the held handler
            assert 4 <= sent <= 4 + 1 + 1
            gate.set()
            await producer
            assert await ref.ask.taken() == 40

    run(main())


def test_stream_config_is_validated_with_the_key_named() -> None:
    with pytest.raises(ConfigError, match="stream_port=70000"):
        TransportConfig(token=TOKEN, stream_port=70000)
    with pytest.raises(ConfigError, match="stream='yes'"):
        TransportConfig(token=TOKEN, stream="yes")  # type: ignore[arg-type]


# -- the parser, without sockets ----------------------------------------------------------


def payloads() -> st.SearchStrategy[list[Any]]:
    small = st.binary(max_size=300)
    big = st.integers(min_value=DIRECT_BYTES, max_value=3 * DIRECT_BYTES).map(
        lambda n: np.arange(n, dtype=np.uint8)
    )
    number = st.integers(min_value=-(2**63), max_value=2**64 - 1)
    return st.lists(st.one_of(small, number, big), min_size=1, max_size=12)


def feed(stream: FrameStream, data: bytes, cuts: list[int]) -> None:
    """Deliver `data` the way a socket would: each read as big as the buffer offered or the
    next cut allows."""
    sent = 0
    for cut in [*sorted(min(cut, len(data)) for cut in cuts), len(data)]:
        while sent < cut:
            buffer = stream.get_buffer(-1)
            n = min(len(buffer), cut - sent)
            buffer[:n] = data[sent : sent + n]
            stream.buffer_updated(n)
            sent += n


@settings(max_examples=60, deadline=None)
@given(payloads(), st.lists(st.integers(min_value=0, max_value=1 << 20), max_size=20))
def test_frames_come_out_whole_and_in_order_however_the_bytes_are_cut(
    values: list[Any], cuts: list[int]
) -> None:
    encoded = [
        b"".join(bytes(p) for p in wire.encode(["t", "x", "m", [v], {}]).parts) for v in values
    ]
    out: list[Any] = []
    errors: list[Exception] = []
    stream = FrameStream(wire.DEFAULT_MAX_FRAME_BYTES)
    stream.take(lambda frame: out.append(wire.decode(frame)[3][0]), errors.append)
    feed(stream, b"".join(encoded), cuts)
    assert not errors
    assert len(out) == len(values)
    for got, want in zip(out, values):
        if isinstance(want, np.ndarray):
            np.testing.assert_array_equal(got, want)
            assert got.flags.writeable  # decoded on the frame's own buffer
        else:
            assert got == want


@given(st.binary(min_size=wire.PREFIX_SIZE, max_size=200))
def test_garbage_breaks_the_stream_with_a_wire_error_never_anything_else(data: bytes) -> None:
    errors: list[Exception] = []
    stream = FrameStream(1 << 16)
    stream.take(lambda frame: None, errors.append)
    feed(stream, data, [])
    if not data.startswith(wire.MAGIC):
        assert len(errors) == 1
        assert isinstance(errors[0], WireError)
