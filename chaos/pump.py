"""The fault pump: moves one direction of one TCP connection from a reader to a writer with
the connection's faults (see `NetFaults`) applied. The fault proxy (proxy.py) and the link
relay (relay.py) differ in how they pick a connection's faults, not in how they apply them, so
both splice their connections through this one pump.

A direction is a reader task and a writer task joined by a bounded queue of (due time, chunk),
so delay, jitter, stalls and the bandwidth limit hold data back without reordering it and
without stopping the reads that keep the other faults responsive.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Generic, Protocol, TypeVar

from shoal.chaos.errors import ProxyError
from shoal.chaos.traffic import NetFaults, TokenBucket, due_time

CHUNK = 64 * 1024
QUEUE_CHUNKS = 64


class Connection(Protocol):
    def reset(self) -> None:
        """RST both ends and stop pumping."""


C = TypeVar("C", bound=Connection, contravariant=True)


class Shaper(Protocol[C]):
    """What the pump asks the proxy or relay about a connection, at every chunk (faults change
    while data flows)."""

    def faults_of(self, conn: C) -> NetFaults: ...

    def flowing_of(self, conn: C) -> asyncio.Event: ...

    def bandwidth_wait(self, conn: C, direction: str, size: int) -> float: ...


class Counters(Protocol):
    """The stats fields the pump counts into (ProxyStats and RelayStats have them)."""

    dropped: int
    stalled: int
    bytes_up: int
    bytes_down: int


def rst_close(writer: asyncio.StreamWriter) -> None:
    """Close so the peer gets a RST, not a FIN: SO_LINGER on with a zero timeout."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def listen(
    accept: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    host: str,
    port: int,
) -> asyncio.Server:
    """The listening server of a proxy or relay; a port it cannot have is a ProxyError."""
    try:
        return await asyncio.start_server(accept, host, port)
    except OSError as exc:
        raise ProxyError(f"cannot listen on {host}:{port} ({exc}); pick a free port or 0") from exc


async def shut_down(
    server: asyncio.Server | None,
    connections: Iterable[Connection],
    handlers: Iterable[asyncio.Task[object]],
) -> None:
    """Stop accepting, RST every open connection, and wait for their handlers to end."""
    if server is not None:
        server.close()
    for conn in list(connections):
        conn.reset()
    await asyncio.gather(*handlers, return_exceptions=True)
    if server is not None:
        await server.wait_closed()


def bucket_wait(buckets: dict[str, TokenBucket], rate: float | None, key: str, size: int) -> float:
    """Seconds to hold `size` bytes back under a `rate` (bytes/s) limit, from the token bucket
    `buckets[key]` (made on first use, with a burst of 1/20 s of the rate); 0 without a limit."""
    if rate is None:
        return 0.0
    now = time.monotonic()
    bucket = buckets.get(key)
    if bucket is None:
        bucket = buckets[key] = TokenBucket(rate, max(rate / 20, 1024.0), now)
    return bucket.reserve(size, now)


class FaultPump(Generic[C]):
    """Splices the directions of the connections of one proxy or relay (`shaper`)."""

    def __init__(self, shaper: Shaper[C], stats: Counters, rng: random.Random) -> None:
        self._shaper, self._stats, self._random = shaper, stats, rng

    async def splice(
        self, conn: C, src: asyncio.StreamReader, dst: asyncio.StreamWriter, name: str
    ) -> None:
        """Pump `src` into `dst` until EOF (then half-close `dst`) or a reset; `name` is "up"
        (client to server) or "down"."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)
        writer = asyncio.create_task(self._write(conn, queue, dst, name))
        try:
            await self._read(conn, src, queue)
            await queue.join()
            with contextlib.suppress(OSError):
                dst.write_eof()
            await asyncio.sleep(0)
        finally:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    async def _read(
        self, conn: C, src: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes]]
    ) -> None:
        due = 0.0
        while True:
            await self._shaper.flowing_of(conn).wait()
            try:
                data = await src.read(CHUNK)
            except OSError:
                conn.reset()
                return
            if not data:
                return
            faults = self._shaper.faults_of(conn)
            if faults.loss and self._random.random() < faults.loss:
                if faults.loss_mode == "drop":
                    self._stats.dropped += 1
                    conn.reset()
                    return
                self._stats.stalled += 1
                due = max(due, time.monotonic() + faults.stall_s)
            unit = self._random.uniform(-1.0, 1.0)
            due = due_time(time.monotonic(), due, faults.delay_s, faults.jitter_s, unit)
            await queue.put((due, data))

    async def _write(
        self,
        conn: C,
        queue: asyncio.Queue[tuple[float, bytes]],
        dst: asyncio.StreamWriter,
        name: str,
    ) -> None:
        while True:
            due, data = await queue.get()
            try:
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                await asyncio.sleep(self._shaper.bandwidth_wait(conn, name, len(data)))
                await self._shaper.flowing_of(conn).wait()
                dst.write(data)
                await dst.drain()
            except OSError:
                conn.reset()
                return
            finally:
                queue.task_done()
            if name == "up":
                self._stats.bytes_up += len(data)
            else:
                self._stats.bytes_down += len(data)
