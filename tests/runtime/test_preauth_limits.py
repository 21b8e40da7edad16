"""What a stranger can hold before authenticating: a bounded number of connections, each with
a small buffer, each closed at the handshake timeout however slowly it dribbles bytes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from shoal.runtime import auth, stream
from shoal.runtime.actor import Actor
from shoal.runtime.loop import run
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import Transport, TransportConfig, attach
from tests.support.serving import good_client_works

pytestmark = pytest.mark.usefixtures("no_asyncio_errors")

TOKEN = "preauth-token"
CAP = 6


class Echo(Actor):
    def echo(self, value: Any) -> Any:
        return value


@contextlib.asynccontextmanager
async def server(handshake_timeout: float = 30.0) -> AsyncIterator[Transport]:
    async with ActorSystem() as system:
        await system.spawn(Echo, name="echo")
        config = TransportConfig(
            token=TOKEN, handshake_timeout=handshake_timeout, max_unauthenticated=CAP
        )
        transport = await attach(system, config)
        try:
            yield transport
        finally:
            await transport.close()


def ports(transport: Transport) -> dict[str, int]:
    port = int(transport.address.rpartition(":")[2])
    stream_port = transport._stream_port
    assert stream_port is not None
    return {"websocket": port, "stream": stream_port}


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server has closed this connection (EOF or reset), waiting as long as it takes."""
    try:
        return await reader.read(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("listener", ["websocket", "stream"])
def test_connections_beyond_the_cap_are_closed_on_arrival(listener: str) -> None:
    async def main() -> None:
        async with server() as transport:
            port = ports(transport)[listener]
            held = []
            for _ in range(CAP):
                held.append(await asyncio.open_connection("127.0.0.1", port))
            # The server accepts in arrival order, so these four come after the cap is full.
            extra = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
            closed = [await closed_by_server(reader) for reader, _ in extra]
            assert closed == [True] * 4
            for _, writer in held + extra:
                writer.close()
            await good_client_works(transport.address, TOKEN)

    run(main())


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "behaviour",
    ["silent websocket", "half an HTTP request", "upgraded but silent", "silent stream"],
)
def test_slow_strangers_are_closed_at_the_handshake_timeout(behaviour: str) -> None:
    async def main() -> None:
        async with server(handshake_timeout=1.0) as transport:
            p = ports(transport)
            port = p["stream"] if behaviour == "silent stream" else p["websocket"]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            if behaviour == "half an HTTP request":
                writer.write(b"GET /shoal HTTP/1.1\r\nHost: x\r\n")
            elif behaviour == "upgraded but silent":
                writer.write(
                    b"GET /shoal HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                    b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
                )
            await writer.drain()
            await reader.read()  # returns only when the server closes the connection
            writer.close()
            await good_client_works(transport.address, TOKEN)

    run(main())


def test_a_stranger_s_stream_costs_a_small_buffer_until_its_link_is_proved() -> None:
    pending = stream.FrameStream(auth.MAX_HANDSHAKE_BYTES)
    assert len(pending._buffer) == 2 * auth.MAX_HANDSHAKE_BYTES
    pending.limit = 1 << 20
    assert len(pending._buffer) == stream.READ_BYTES
