"""The transport between two actor systems over real websockets on 127.0.0.1."""

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
from shoal.runtime.errors import (
    ActorNotFound,
    AskTimeout,
    InvalidTimeout,
    LinkClosed,
    MailboxFull,
    RemoteError,
    UnknownMessageType,
    UnknownMethod,
)
from shoal.runtime.loop import run
from shoal.runtime.remote import RemoteRef
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import Transport, TransportConfig, attach, split_url
from tests.support.waiting import eventually_async

TOKEN = "test-cluster-token"


class Echo(Actor):
    def __init__(self, gate: asyncio.Event | None = None) -> None:
        self.seen: list[Any] = []
        self.gate = gate

    def echo(self, value: Any) -> Any:
        return value

    def record(self, value: Any) -> None:
        self.seen.append(value)

    def count(self) -> int:
        return len(self.seen)

    def total(self, tensor: torch.Tensor) -> float:
        return float(tensor.sum())

    def boom(self) -> None:
        raise ValueError("bad value 42")

    async def slow(self, seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds

    async def held(self, value: Any) -> None:
        assert self.gate is not None
        await self.gate.wait()
        self.seen.append(value)


@contextlib.asynccontextmanager
async def node(token: str = TOKEN, **options: Any) -> AsyncIterator[tuple[ActorSystem, Transport]]:
    async with ActorSystem() as system:
        transport = await attach(system, TransportConfig(token=token, **options))
        try:
            yield system, transport
        finally:
            await transport.close()


@contextlib.asynccontextmanager
async def pair(**server_options: Any) -> AsyncIterator[tuple[ActorSystem, ActorSystem, str]]:
    """A serving node with an `echo` actor and a client node; yields (server, client, address)."""
    async with node(**server_options) as (server, server_transport), node() as (client, _):
        await server.spawn(Echo, name="echo")
        yield server, client, server_transport.address


@pytest.mark.timeout(30)
def test_tell_and_ask_cross_the_link_in_order() -> None:
    async def main() -> None:
        async with pair() as (_, client, address):
            ref = client.ref(f"{address}/echo")
            assert isinstance(ref, RemoteRef)
            for n in range(100):
                await ref.tell.record(n)
            ref.tell_nowait.record(100)
            assert await ref.ask.count() == 101
            assert await ref.ask.echo({"a": (1, 2.5, "x", b"y", None)}) == {
                "a": (1, 2.5, "x", b"y", None)
            }

    run(main())


@pytest.mark.timeout(30)
def test_arrays_and_tensors_larger_than_a_chunk() -> None:
    async def main() -> None:
        async with pair() as (_, client, address):
            ref = client.ref(f"{address}/echo")
            weights = torch.randn(3, 1024, 1024)
            assert await ref.ask.total(weights) == pytest.approx(float(weights.sum()), rel=1e-4)
            obs = np.arange(200_000, dtype=np.float64).reshape(1000, 200)
            back = await ref.ask.echo(obs)
            np.testing.assert_array_equal(back, obs)
            back_tensor = await ref.ask.echo(torch.arange(10, dtype=torch.bfloat16))
            assert torch.equal(back_tensor, torch.arange(10, dtype=torch.bfloat16))

    run(main())


@pytest.mark.timeout(30)
def test_remote_failures_have_their_own_exceptions() -> None:
    async def main() -> None:
        async with pair() as (_, client, address):
            ref = client.ref(f"{address}/echo")
            with pytest.raises(RemoteError, match="ValueError: bad value 42") as info:
                await ref.ask.boom()
            assert info.value.type_name == "ValueError"
            with pytest.raises(UnknownMethod, match="no handler 'nope'"):
                await ref.ask.nope()
            with pytest.raises(ActorNotFound, match="no live actor named 'ghost'"):
                await client.ref(f"{address}/ghost").ask.echo(1)
            with pytest.raises(AskTimeout):
                await ref.ask(timeout=0.2).slow(1.0)
            with pytest.raises(InvalidTimeout, match="remote ask takes seconds"):
                await ref.ask(timeout=1e9).echo(1)
            with pytest.raises(UnknownMessageType, match=r"builtins\.object"):
                await ref.ask.echo(object())
            assert await ref.ask.echo("still serving") == "still serving"

    run(main())


async def flood(ref: Any, sent: list[int]) -> None:
    """tell_nowait until the link refuses; `sent` records what went out."""
    for n in range(1000):
        ref.tell_nowait.held(n)
        sent.append(n)
        await asyncio.sleep(0.001)


@pytest.mark.timeout(30)
def test_credit_bounds_a_producer_that_outruns_its_consumer() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        async with node(credit_frames=8) as (server, transport), node() as (client, _):
            await server.spawn(Echo, gate, name="sink", mailbox_size=2)
            ref = client.ref(f"{transport.address}/sink")
            assert await ref.ask.count() == 0
            accepted: list[int] = []
            with pytest.raises(MailboxFull, match="credit window"):
                await flood(ref, accepted)
            sent = len(accepted)
            # the window, plus what the consumer took in: its mailbox and the held handler
            assert 8 <= sent <= 8 + 2 + 1
            blocked = asyncio.create_task(ref.tell.held("late"))
            await asyncio.sleep(0.2)
            assert not blocked.done()
            gate.set()
            await asyncio.wait_for(blocked, 10)
            assert await ref.ask.count() == sent + 1

    run(main())


@pytest.mark.timeout(30)
def test_dropped_link_fails_pending_asks_and_reconnects() -> None:
    async def main() -> None:
        async with node() as (client, _), ActorSystem() as server:
            await server.spawn(Echo, name="echo")
            first = await attach(server, TransportConfig(token=TOKEN))
            address = first.address
            ref = client.ref(f"{address}/echo")
            assert await ref.ask.echo(1) == 1
            pending = asyncio.create_task(ref.ask.slow(1.0))
            await asyncio.sleep(0.1)
            await first.close()
            with pytest.raises(LinkClosed):
                await pending
            port = int(address.rsplit(":", 1)[1])
            second = await attach(server, TransportConfig(token=TOKEN, port=port))
            try:
                assert await ref.ask.echo(2) == 2
            finally:
                await second.close()

    run(main())


@pytest.mark.timeout(30)
def test_a_peer_that_never_comes_back_fails_sends_with_link_closed() -> None:
    async def main() -> None:
        async with node(connect_timeout=0.3) as (client, transport):
            ref = transport.ref("shoal://127.0.0.1:9/echo")
            with pytest.raises(LinkClosed, match="is that process running"):
                await ref.ask.echo(1)
            with pytest.raises(LinkClosed, match="reconnecting"):
                ref.tell_nowait.echo(1)
            assert client.address == transport.address

    run(main())


def test_config_is_validated_with_the_key_named() -> None:
    with pytest.raises(ConfigError, match="token is empty"):
        TransportConfig(token="")
    with pytest.raises(ConfigError, match="port=70000"):
        TransportConfig(token=TOKEN, port=70000)
    with pytest.raises(ConfigError, match="credit_frames=0"):
        TransportConfig(token=TOKEN, credit_frames=0)
    with pytest.raises(ConfigError, match="chunk_bytes=4194304"):
        TransportConfig(token=TOKEN, chunk_bytes=4 * 1024 * 1024)
    with pytest.raises(ConfigError, match="connect_timeout=-1"):
        TransportConfig(token=TOKEN, connect_timeout=-1)


def test_remote_paths_are_parsed_strictly() -> None:
    assert split_url("shoal://127.0.0.1:5/learner") == ("shoal://127.0.0.1:5", "learner")
    for bad in ("learner", "shoal://127.0.0.1:5/", "http://x:1/a", "shoal://host/a"):
        with pytest.raises(ActorNotFound, match="shoal://HOST:PORT/NAME"):
            split_url(bad)


@pytest.mark.timeout(30)
def test_undeliverable_tells_become_dead_letters_on_the_receiver() -> None:
    async def main() -> None:
        async with pair() as (server, client, address):
            await client.ref(f"{address}/ghost").tell.echo(1)
            await client.ref(f"{address}/echo").tell.nope(2)
            assert await client.ref(f"{address}/echo").ask.count() == 0
            reasons = [(letter.recipient, letter.method) for letter in server.dead_letters]
            assert reasons == [("ghost", "echo"), ("echo", "nope")]

    run(main())


@pytest.mark.timeout(30)
def test_peers_with_different_chunk_sizes_understand_each_other() -> None:
    async def main() -> None:
        async with pair(chunk_bytes=1024 * 1024) as (_, client, address):
            weights = torch.randn(2, 1024, 1024)
            back = await client.ref(f"{address}/echo").ask.echo(weights)
            assert torch.equal(back, weights)

    run(main())


@pytest.mark.timeout(30)
def test_a_closed_transport_refuses_sends_at_once() -> None:
    async def main() -> None:
        async with node() as (server, server_transport), ActorSystem() as client:
            await server.spawn(Echo, name="echo")
            transport = await attach(client, TransportConfig(token=TOKEN, connect_timeout=20))
            ref = transport.ref(f"{server_transport.address}/echo")
            assert await ref.ask.echo(1) == 1
            await transport.close()
            with pytest.raises(LinkClosed, match="transport was closed"):
                await asyncio.wait_for(ref.ask.echo(2), 5)
            with pytest.raises(LinkClosed, match="not running"):
                transport.ref(f"{server_transport.address}/other")
            with pytest.raises(ActorNotFound, match="no transport is attached"):
                client.ref(f"{server_transport.address}/echo")

    run(main())


class Ledger(Actor):
    def __init__(self) -> None:
        self.order: list[int] = []

    async def note(self, n: int) -> int:
        await asyncio.sleep(0)
        self.order.append(n)
        return n

    def seen(self) -> list[int]:
        return self.order


@pytest.mark.timeout(30)
def test_tells_and_asks_of_one_link_reach_the_actor_in_send_order() -> None:
    async def main() -> None:
        async with node() as (server, transport), node() as (client, _):
            await server.spawn(Ledger, name="ledger", mailbox_size=3)
            ledger = client.ref(f"{transport.address}/ledger")
            asks = []
            for n in range(300):
                if n % 4 == 0:
                    asks.append(asyncio.create_task(ledger.ask.note(n)))
                    await asyncio.sleep(0)  # the ask's frame is queued now, in order
                else:
                    await ledger.tell.note(n)
            assert await asyncio.gather(*asks) == list(range(0, 300, 4))
            assert await ledger.ask.seen() == list(range(300))

    run(main())


@pytest.mark.timeout(30)
def test_a_taken_port_raises_os_error_and_leaves_nothing_running() -> None:
    async def main() -> None:
        async with node() as (_, first):
            port = int(first.address.rsplit(":", 1)[1])
            async with ActorSystem() as system:
                with pytest.raises(OSError):
                    await attach(system, TransportConfig(token=TOKEN, port=port))
                assert system.address is None

    run(main())


@pytest.mark.timeout(30)
def test_any_ref_can_serve_an_ask_into_a_reply_slot() -> None:
    """The default `_ask_nowait` (a task running `_ask`), here on a remote ref, settles the
    slot once with the result or the error."""

    async def main() -> None:
        async with pair() as (_, client, address):
            ref = client.ref(f"{address}/echo")
            loop = asyncio.get_running_loop()
            ok: asyncio.Future[Any] = loop.create_future()
            ref._ask_nowait("echo", ([1, 2],), {}, 5.0, ok)
            assert await ok == [1, 2]
            failed: asyncio.Future[Any] = loop.create_future()
            ref._ask_nowait("boom", (), {}, 5.0, failed)
            with pytest.raises(RemoteError, match="ValueError"):
                await failed

    run(main())


class Guarded(Actor):
    """A sync handler that may fail, and an async one that keeps the actor busy."""

    def __init__(self, gate: asyncio.Event) -> None:
        self.gate = gate
        self.log: list[str] = []

    def on_restart(self, error: Exception) -> None:
        self.log.append(f"restarted after {type(error).__name__}")

    def state(self) -> list[str]:
        return self.log

    def fail(self) -> None:
        raise KeyError("broken on purpose")

    async def busy(self) -> None:
        await self.gate.wait()
        self.log.append("busy done")


@pytest.mark.timeout(30)
def test_a_served_ask_run_at_once_still_fails_and_restarts_like_any_handler() -> None:
    """An idle actor's sync handler answers a remote ask straight from the read callback; a
    failure there must still reach the asker and the supervisor, as in the consumer."""

    async def main() -> None:
        async with node() as (server, transport), node() as (client, _):
            gate = asyncio.Event()
            await server.spawn(Guarded, gate, name="guarded")
            ref = client.ref(f"{transport.address}/guarded")
            assert await ref.ask.state() == []
            with pytest.raises(RemoteError, match="broken on purpose"):
                await ref.ask.fail()

            async def restarted() -> bool:  # the supervisor restarts it in the background
                return bool(await ref.ask.state() == ["restarted after KeyError"])

            await eventually_async(restarted, "the actor restarted")
            assert server.failures[-1].action == "restart"

    run(main())


@pytest.mark.timeout(30)
def test_a_served_ask_waits_while_the_actor_is_busy_in_another_handler() -> None:
    async def main() -> None:
        async with node() as (server, transport), node() as (client, _):
            gate = asyncio.Event()
            await server.spawn(Guarded, gate, name="guarded")
            ref = client.ref(f"{transport.address}/guarded")
            await ref.tell.busy()
            waiting = asyncio.create_task(ref.ask.state())
            await asyncio.sleep(0.2)
            assert not waiting.done()  # one message at a time, even for a sync handler
            gate.set()
            assert await waiting == ["busy done"]

    run(main())
