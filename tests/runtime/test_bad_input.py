"""Misbehaving peers over real sockets: each gets its specific error, its link is closed, and
the server keeps serving a well-behaved client afterwards."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import msgpack
import pytest

from shoal.runtime import auth, wire
from shoal.runtime.actor import Actor
from shoal.runtime.errors import ActorNotFound, AskTimeout, AuthenticationFailed, RemoteError
from shoal.runtime.loop import run
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import ROUTE, Transport, TransportConfig, attach
from tests.runtime.hostile_frames import HOSTILE_HEADERS, header_only_frame
from tests.support.serving import good_client_works

pytestmark = pytest.mark.usefixtures("no_asyncio_errors")

TOKEN = "bad-input-token"
LIMIT = 1 << 20


class Echo(Actor):
    def echo(self, value: Any) -> Any:
        return value

    def boom(self) -> None:
        raise KeyError("no such slot")

    async def slow(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def stuck(self) -> None:
        await asyncio.Event().wait()


@contextlib.asynccontextmanager
async def server(credit_frames: int = 1024) -> AsyncIterator[tuple[ActorSystem, Transport]]:
    async with ActorSystem() as system:
        await system.spawn(Echo, name="echo")
        config = TransportConfig(
            token=TOKEN,
            max_frame_bytes=LIMIT,
            handshake_timeout=0.5,
            credit_frames=credit_frames,
        )
        transport = await attach(system, config)
        try:
            yield system, transport
        finally:
            await transport.close()


def url(address: str) -> str:
    return "ws://" + address.removeprefix("shoal://") + ROUTE


@contextlib.asynccontextmanager
async def raw_socket(address: str) -> AsyncIterator[aiohttp.ClientWebSocketResponse]:
    async with aiohttp.ClientSession() as session, session.ws_connect(url(address)) as ws:
        yield ws


async def refusal(ws: aiohttp.ClientWebSocketResponse) -> tuple[str, str]:
    """The error frame a server sends before closing a link: (error type, message). Credit
    grants for requests it consumed before the bad one may come first."""
    value: Any = ["c"]
    while isinstance(value, list) and value[0] == "c":
        msg = await ws.receive(timeout=5)
        assert msg.type == aiohttp.WSMsgType.BINARY
        value = wire.decode(msg.data)
    if isinstance(value, dict):  # refused during the handshake
        type_name, message = value["error"], value["message"]
    else:
        kind, type_name, message = value
        assert kind == "e"
    closing = await ws.receive(timeout=5)
    assert closing.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    return type_name, message


def frame(value: Any) -> bytes:
    return b"".join(bytes(part) for part in wire.encode(value).parts)


BAD_FRAMES: dict[str, tuple[bytes, str, str]] = {
    "garbage": (b"GET / HTTP/1.1\r\n" * 4, "MalformedFrame", "magic"),
    "bad header": (header_only_frame(b"\xc1\xc1"), "MalformedFrame", "header is not valid"),
    "not an envelope": (frame({"hello": 1}), "MalformedFrame", "list starting with its kind"),
    "wrong fields": (frame(["t", 1, 2]), "MalformedFrame", "wrong fields"),
    "unknown kind": (frame(["zz", 1]), "UnknownMessageType", "'zz'"),
    "nan timeout": (
        frame(["a", 1, "echo", "echo", [1], {}, float("nan")]),
        "MalformedFrame",
        "ask timeout",
    ),
    "unknown message": (
        header_only_frame(msgpack.packb(msgpack.ExtType(3, msgpack.packb(["evil.type", {}])))),
        "UnknownMessageType",
        "evil.type",
    ),
    "over the limit": (
        wire.PREFIX.pack(wire.MAGIC, 0, 0, LIMIT + 1),
        "FrameTooLarge",
        f"limit of {LIMIT} bytes",
    ),
    **{
        f"hostile shape: {name}": (header_only_frame(header), "MalformedFrame", needle)
        for name, (header, needle) in HOSTILE_HEADERS.items()
    },
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
def test_bad_frames_close_only_their_link(case: str) -> None:
    data, error, needle = BAD_FRAMES[case]

    async def main() -> None:
        async with server() as (_, transport):
            async with raw_socket(transport.address) as ws:
                await auth.client_handshake(ws, TOKEN.encode(), auth.Window(8, LIMIT), 5)
                await ws.send_bytes(data)
                type_name, message = await refusal(ws)
            assert type_name == error
            assert needle in message
            await good_client_works(transport.address, TOKEN)

    run(main())


def _sender(data: bytes) -> Callable[[aiohttp.ClientWebSocketResponse], Awaitable[None]]:
    return lambda ws: ws.send_bytes(data)


async def handshake_then(ws: aiohttp.ClientWebSocketResponse, answer: dict[str, Any]) -> None:
    await auth.send(ws, {"shoal": auth.PROTOCOL, "nonce": b"n" * auth.NONCE_BYTES})
    await auth.receive(ws, 5)
    await auth.send(ws, answer)


HANDSHAKES: dict[str, tuple[Callable[[aiohttp.ClientWebSocketResponse], Awaitable[None]], str]] = {
    "wrong token": (
        lambda ws: handshake_then(ws, {"proof": b"x" * 32, "window": [1, 1]}),
        "different cluster token",
    ),
    "missing token": (lambda ws: handshake_then(ws, {"window": [1, 1]}), "no token proof"),
    "silent peer": (lambda ws: asyncio.sleep(0), "did not complete the handshake"),
    "wrong protocol": (
        lambda ws: auth.send(ws, {"shoal": 99, "nonce": b"n" * auth.NONCE_BYTES}),
        "protocol 99",
    ),
    **{
        f"hostile shape: {name}": (_sender(header_only_frame(header)), needle)
        for name, (header, needle) in HOSTILE_HEADERS.items()
    },
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(HANDSHAKES))
def test_bad_handshakes_are_refused_with_a_reason(case: str) -> None:
    behave, needle = HANDSHAKES[case]

    async def main() -> None:
        async with server() as (_, transport):
            async with raw_socket(transport.address) as ws:
                await behave(ws)
                _, message = await refusal(ws)
            assert needle in message
            await good_client_works(transport.address, TOKEN)

    run(main())


@pytest.mark.timeout(30)
def test_client_with_the_wrong_token_gets_authentication_failed() -> None:
    async def main() -> None:
        async with server() as (_, transport), ActorSystem() as system:
            client = await attach(system, TransportConfig(token="not-the-token"))
            try:
                with pytest.raises(AuthenticationFailed, match="different cluster token"):
                    await system.ref(f"{transport.address}/echo").ask.echo(1)
            finally:
                await client.close()
            await good_client_works(transport.address, TOKEN)

    run(main())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cut", ["mid-prefix", "mid-buffer"])
def test_a_peer_that_dies_mid_frame(cut: str) -> None:
    async def main() -> None:
        async with server() as (_, transport):
            whole = frame(["t", "echo", "echo", [b"x" * 100_000], {}])
            part = whole[:10] if cut == "mid-prefix" else whole[: len(whole) // 2]
            session = aiohttp.ClientSession()
            ws = await session.ws_connect(url(transport.address))
            await auth.client_handshake(ws, TOKEN.encode(), auth.Window(8, LIMIT), 5)
            await ws.send_bytes(part)
            await session.close()  # drops the TCP connection without a websocket close
            await good_client_works(transport.address, TOKEN)

    run(main())


@pytest.mark.timeout(30)
def test_text_messages_are_refused() -> None:
    async def main() -> None:
        async with server() as (_, transport):
            async with raw_socket(transport.address) as ws:
                await auth.client_handshake(ws, TOKEN.encode(), auth.Window(8, LIMIT), 5)
                await ws.send_str("hello")
                type_name, message = await refusal(ws)
            assert type_name == "MalformedFrame"
            assert "TEXT" in message
            await good_client_works(transport.address, TOKEN)

    run(main())


@pytest.mark.timeout(30)
def test_dead_actor_timeout_and_raising_handler_over_the_link() -> None:
    async def main() -> None:
        async with server() as (system, transport):
            doomed = await system.spawn(Echo, name="doomed")
            await system.stop_actor(doomed)
            async with ActorSystem() as client:
                link = await attach(client, TransportConfig(token=TOKEN))
                try:
                    with pytest.raises(ActorNotFound, match="doomed"):
                        await client.ref(f"{transport.address}/doomed").ask.echo(1)
                    echo = client.ref(f"{transport.address}/echo")
                    with pytest.raises(AskTimeout):
                        await echo.ask(timeout=0.1).slow(0.5)
                    with pytest.raises(RemoteError, match="KeyError") as info:
                        await echo.ask.boom()
                    assert "no such slot" in info.value.message
                finally:
                    await link.close()
            await good_client_works(transport.address, TOKEN)

    run(main())


@pytest.mark.timeout(30)
def test_a_replayed_handshake_is_refused() -> None:
    """A proof recorded from one good handshake is worthless on the next connection, because
    it covers the nonce the server chose for that connection only."""

    async def main() -> None:
        async with server() as (_, transport):
            nonce = b"c" * auth.NONCE_BYTES
            async with raw_socket(transport.address) as ws:
                await auth.send(ws, {"shoal": auth.PROTOCOL, "nonce": nonce})
                first = await auth.receive(ws, 5)
                recorded = auth.proof(TOKEN.encode(), b"client", first["nonce"], nonce)
                await auth.send(ws, {"proof": recorded, "window": [8, LIMIT]})
                assert await auth.receive(ws, 5) == {"ok": True}
            async with raw_socket(transport.address) as ws:
                await auth.send(ws, {"shoal": auth.PROTOCOL, "nonce": nonce})
                second = await auth.receive(ws, 5)
                assert second["nonce"] != first["nonce"]
                await auth.send(ws, {"proof": recorded, "window": [8, LIMIT]})
                type_name, message = await refusal(ws)
            assert type_name == "AuthenticationFailed"
            assert "different cluster token" in message
            await good_client_works(transport.address, TOKEN)

    run(main())


@pytest.mark.timeout(30)
def test_a_peer_that_ignores_its_credit_window_is_cut_off() -> None:
    async def main() -> None:
        async with server(credit_frames=4) as (system, transport):
            await system.spawn(Echo, name="jam", mailbox_size=1)
            async with raw_socket(transport.address) as ws:
                session = await auth.client_handshake(ws, TOKEN.encode(), auth.Window(8, LIMIT), 5)
                assert session.window.frames == 4
                flood = [frame(["t", "jam", "stuck", [], {}]) for _ in range(2000)]
                await ws.send_bytes(b"".join(flood))
                type_name, message = await refusal(ws)
            assert type_name == "MalformedFrame"
            assert "beyond the credit window" in message
            await good_client_works(transport.address, TOKEN)

    run(main())


# -- the frame stream --------------------------------------------------------------------


class StreamPeer:
    """A hand-driven client: an authenticated websocket and, beside it, a raw TCP connection
    to the server's stream port, so a test can put any bytes on either."""

    def __init__(
        self,
        ws: aiohttp.ClientWebSocketResponse,
        session: auth.Session,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.ws, self.session, self.reader, self.writer = ws, session, reader, writer

    def hello(self, token: bytes = TOKEN.encode(), nonce: bytes | None = None) -> bytes:
        link = self.session.server_nonce if nonce is None else nonce
        proof = auth.proof(token, b"stream", link, self.session.client_nonce)
        return frame({"stream": link, "proof": proof})

    async def answer(self) -> Any:
        prefix = await self.reader.readexactly(wire.PREFIX_SIZE)
        rest = await self.reader.readexactly(wire.frame_length(prefix) - wire.PREFIX_SIZE)
        return wire.decode(prefix + rest)

    async def attached(self) -> None:
        """Send a good hello and wait for the server's yes."""
        self.writer.write(self.hello())
        assert await self.answer() == {"ok": True}

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def link_still_serves(self, on_stream: bool) -> None:
        ask = frame(["a", 1, "echo", "echo", [5], {}, 5.0])
        if on_stream:
            await self.send(ask)
            assert await self.answer() == ["r", 1, 5]
        else:
            await self.ws.send_bytes(ask)
            assert wire.decode((await self.ws.receive(timeout=5)).data) == ["r", 1, 5]


@contextlib.asynccontextmanager
async def stream_peer(address: str) -> AsyncIterator[StreamPeer]:
    async with raw_socket(address) as ws:
        session = await auth.client_handshake(ws, TOKEN.encode(), auth.Window(8, LIMIT), 5)
        assert session.stream_port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", session.stream_port)
        try:
            yield StreamPeer(ws, session, reader, writer)
        finally:
            writer.close()


BAD_HELLOS: dict[str, tuple[Callable[[StreamPeer], bytes], str, str]] = {
    "wrong token": (
        lambda peer: peer.hello(token=b"not-the-token"),
        "AuthenticationFailed",
        "different cluster token",
    ),
    "unknown link": (
        lambda peer: peer.hello(nonce=b"z" * auth.NONCE_BYTES),
        "AuthenticationFailed",
        "names no link",
    ),
    "no link named": (lambda peer: frame({"proof": b"x"}), "MalformedFrame", "names no link"),
    "garbage": (lambda peer: b"GET / HTTP/1.1\r\n" * 4, "MalformedFrame", "magic"),
    "oversized hello": (
        lambda peer: wire.PREFIX.pack(wire.MAGIC, 0, 0, LIMIT),
        "FrameTooLarge",
        "limit of 4096 bytes",
    ),
    "silent": (lambda peer: b"", "LinkClosed", "did not complete the stream handshake"),
    **{
        f"hostile shape: {name}": (
            lambda peer, header=header: header_only_frame(header),
            "MalformedFrame",
            needle,
        )
        for name, (header, needle) in HOSTILE_HEADERS.items()
    },
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(BAD_HELLOS))
def test_bad_stream_hellos_are_refused_without_harming_the_link(case: str) -> None:
    """A stream connection that fails to prove itself gets the reason and is closed; the
    websocket link it tried to join keeps working (whoever saw the nonces cannot cut it)."""
    hello, error, needle = BAD_HELLOS[case]

    async def main() -> None:
        async with server() as (_, transport), stream_peer(transport.address) as peer:
            peer.writer.write(hello(peer))
            answer = await peer.answer()
            assert answer["error"] == error
            assert needle in answer["message"]
            assert await peer.reader.read() == b""  # then the server closes the connection
            await peer.link_still_serves(on_stream=False)
            await good_client_works(transport.address, TOKEN)

    run(main())


BAD_STREAM: dict[str, tuple[Callable[[StreamPeer], Awaitable[None]], str, str]] = {
    "garbage": (lambda peer: peer.send(b"GARBAGE!" * 8), "MalformedFrame", "magic"),
    "over the limit": (
        lambda peer: peer.send(wire.PREFIX.pack(wire.MAGIC, 0, 0, LIMIT + 1)),
        "FrameTooLarge",
        f"limit of {LIMIT} bytes",
    ),
    "bad header": (
        lambda peer: peer.send(header_only_frame(b"\xc1\xc1")),
        "MalformedFrame",
        "header is not valid",
    ),
    "wrong fields": (lambda peer: peer.send(frame(["t", 1, 2])), "MalformedFrame", "wrong fields"),
    "unknown kind": (
        lambda peer: peer.send(frame(["zz", 1])),
        "UnknownMessageType",
        "'zz'",
    ),
    "big frame with a bad header": (
        lambda peer: peer.send(
            wire.PREFIX.pack(wire.MAGIC, 300_000, 0, wire.PREFIX_SIZE + 300_000) + b"\xc1" * 300_000
        ),
        "MalformedFrame",
        "header is not valid",
    ),
    "a frame on the websocket instead": (
        lambda peer: peer.ws.send_bytes(frame(["t", "echo", "echo", [1], {}])),
        "MalformedFrame",
        "carries its frames on its stream",
    ),
    **{
        f"hostile shape: {name}": (
            lambda peer, header=header: peer.send(header_only_frame(header)),
            "MalformedFrame",
            needle,
        )
        for name, (header, needle) in HOSTILE_HEADERS.items()
    },
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(BAD_STREAM))
def test_bad_stream_frames_close_only_their_link(case: str) -> None:
    send, error, needle = BAD_STREAM[case]

    async def main() -> None:
        async with server() as (_, transport):
            async with stream_peer(transport.address) as peer:
                await peer.attached()
                await peer.link_still_serves(on_stream=True)
                await send(peer)
                type_name, message = await refusal(peer.ws)
                assert await peer.reader.read() == b""  # the stream closes with its link
            assert type_name == error
            assert needle in message
            await good_client_works(transport.address, TOKEN)

    run(main())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cut", ["mid-prefix", "mid-buffer"])
def test_a_peer_that_dies_mid_stream_frame_closes_its_link_only(cut: str) -> None:
    async def main() -> None:
        async with server() as (_, transport), stream_peer(transport.address) as peer:
            await peer.attached()
            whole = frame(["t", "echo", "echo", [b"x" * 500_000], {}])
            await peer.send(whole[:10] if cut == "mid-prefix" else whole[: len(whole) // 2])
            peer.writer.transport.abort()  # a reset, no goodbye
            closing = await peer.ws.receive(timeout=5)
            assert closing.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
            await good_client_works(transport.address, TOKEN)

    run(main())


@pytest.mark.timeout(30)
def test_stream_frames_beyond_the_credit_window_cut_the_peer_off() -> None:
    async def main() -> None:
        async with server(credit_frames=4) as (system, transport):
            await system.spawn(Echo, name="jam", mailbox_size=1)
            async with stream_peer(transport.address) as peer:
                await peer.attached()
                await peer.send(b"".join(frame(["t", "jam", "stuck", [], {}]) for _ in range(50)))
                type_name, message = await refusal(peer.ws)
            assert type_name == "MalformedFrame"
            assert "beyond the credit window" in message
            await good_client_works(transport.address, TOKEN)

    run(main())
