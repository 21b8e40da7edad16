"""The baselines' clients of `shoal bench runtime`: the same work as the shoal figures, done on a
bare aiohttp websocket and on raw asyncio TCP against the servers of runtime_peer.py.

Kept beside the servers' protocol (LEN-prefixed TCP messages, /echo and /sink) rather than in
the measurements, which only ask them for a rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp

from shoal.bench.runtime_peer import LEN


async def rate(work: Callable[[], Awaitable[None]], count: int) -> float:
    """Operations per second of `work`, which performs `count` of them."""
    start = time.perf_counter()
    await work()
    return count / (time.perf_counter() - start)


class WsBaseline:
    """Bare aiohttp websocket client for the baselines."""

    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.session, self.base = session, base.replace("http", "ws")

    @contextlib.asynccontextmanager
    async def echo(self, payload: bytes) -> AsyncIterator[Callable[[], Awaitable[None]]]:
        """One round trip per call on a fresh connection."""
        async with self.session.ws_connect(self.base + "/echo", compress=0) as ws:

            async def call() -> None:
                await ws.send_bytes(payload)
                await ws.receive()

            yield call

    async def echorate(self, n: int, payload: bytes, window: int = 256) -> float:
        async with self.session.ws_connect(self.base + "/echo", compress=0) as ws:

            async def calls() -> None:
                for _ in range(n // window):
                    for _ in range(window):
                        await ws.send_bytes(payload)
                    for _ in range(window):
                        await ws.receive()

            return await rate(calls, n // window * window)

    async def stream(self, n: int, payload: bytes) -> float:
        """Messages per second one way, confirmed by the server's byte count."""
        async with self.session.ws_connect(
            self.base + "/sink", compress=0, max_msg_size=64 * 1024 * 1024
        ) as ws:

            async def send() -> None:
                for _ in range(n):
                    await ws.send_bytes(payload)
                await ws.send_str("?")
                assert int((await ws.receive()).data) == n * len(payload)

            return await rate(send, n)


class TcpBaseline:
    """Raw asyncio TCP client: the ceiling any transport on this box can reach."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def echo(self, payload: bytes) -> Callable[[], Awaitable[None]]:
        message = LEN.pack(len(payload)) + payload

        async def call() -> None:
            self.writer.write(message)
            (length,) = LEN.unpack(await self.reader.readexactly(LEN.size))
            await self.reader.readexactly(length)

        return call

    async def stream(self, n: int, payload: bytes | memoryview) -> float:
        header = LEN.pack(len(payload))

        async def send() -> None:
            for _ in range(n):
                self.writer.write(header)
                self.writer.write(payload)
                await self.writer.drain()
            self.writer.write(LEN.pack(0))
            (count,) = LEN.unpack(await self.reader.readexactly(LEN.size))
            assert count == n * len(payload)

        return await rate(send, n)
