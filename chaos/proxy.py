"""A TCP fault proxy (on 127.0.0.1 unless told otherwise): clients connect to it instead of the
real server, and the faults set on it (see `NetFaults`) apply to the real byte stream between
two real processes.

Each accepted connection gets an upstream connection and two directions; each direction is a
reader task and a writer task joined by a bounded queue of (due time, chunk), so delay, jitter,
stalls and the bandwidth limit hold data back without reordering it and without stopping the
reads that keep the other faults responsive. For the event loop; `set_faults`, `heal` and
`reset_connections` may be called at any time, from the loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.chaos.errors import ProxyError
from shoal.chaos.netfaults import NetFaults, TokenBucket, due_time
from shoal.chaos.sockets import ConnectionFilter, Endpoint

LinkFaults = Callable[[Endpoint, Endpoint], NetFaults | None]
"""(client end, server end) of a connection -> the faults for it alone, or None for the
proxy's own. Only delay, jitter and loss can be set per connection."""

CHUNK = 64 * 1024
QUEUE_CHUNKS = 64


@dataclass
class ProxyStats:
    """Counters since start; what the tests and the chaos report read."""

    accepted: int = 0
    refused: int = 0
    reset: int = 0
    dropped: int = 0
    stalled: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    upstream_failures: int = 0
    open: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def rst_close(writer: asyncio.StreamWriter) -> None:
    """Close so the peer gets a RST, not a FIN: SO_LINGER on with a zero timeout."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(eq=False)
class _Link:
    client: asyncio.StreamWriter
    ends: tuple[Endpoint, Endpoint]
    upstream: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    closed: bool = False
    faults: NetFaults | None = None
    """This connection's own faults (`FaultProxy.set_link_faults`), over the proxy's."""

    def reset(self) -> None:
        self.closed = True
        for writer in (self.client, self.upstream):
            if writer is not None:
                rst_close(writer)
        for task in self.tasks:
            task.cancel()


class FaultProxy:
    """`async with FaultProxy(("127.0.0.1", port)) as proxy:` then connect to `proxy.port`."""

    def __init__(
        self,
        target: tuple[str, int],
        listen_port: int = 0,
        seed: int | None = None,
        listen_host: str = "127.0.0.1",
    ) -> None:
        """`listen_host`: where clients reach the proxy (a hosts' bridge address, so that
        processes in network namespaces can)."""
        self.target = target
        self._listen_port = listen_port
        self.listen_host = listen_host
        self.faults = NetFaults()
        self.stats = ProxyStats()
        self._random = random.Random(seed)
        self._links: set[_Link] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._buckets: dict[str, TokenBucket] = {}
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[object]] = set()
        self._refused_from: ConnectionFilter | None = None
        self._link_faults: LinkFaults | None = None

    def __repr__(self) -> str:
        return f"<FaultProxy :{self._listen_port} -> {self.target} {self.faults} links={len(self._links)}>"

    @property
    def port(self) -> int:
        if self._server is None:
            raise ProxyError("the proxy is not started; call start() first")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> FaultProxy:
        try:
            self._server = await asyncio.start_server(
                self._accept, self.listen_host, self._listen_port
            )
        except OSError as exc:
            raise ProxyError(
                f"cannot listen on {self.listen_host}:{self._listen_port} ({exc}); pick a free "
                "port or 0"
            ) from exc
        self._listen_port = self.port
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            link.reset()
        self._flowing.set()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- control -----------------------------------------------------------------------------

    def set_faults(self, faults: NetFaults) -> None:
        """Apply new faults to existing and new connections at once."""
        self.faults = faults
        self._buckets.clear()
        if faults.partition == "blackhole":
            self._flowing.clear()
        else:
            self._flowing.set()
        if faults.partition == "refuse":
            self.reset_connections()

    def heal(self) -> None:
        self.set_faults(NetFaults())

    def reset_connections(self) -> int:
        """RST every open connection on both sides; returns how many were cut."""
        links = list(self._links)
        for link in links:
            link.reset()
        self.stats.reset += len(links)
        return len(links)

    def refuse_from(self, clients: ConnectionFilter | None) -> int:
        """Cut (RST) the open connections `clients` matches and refuse its new ones, whatever
        the faults; None accepts everyone again. Returns how many open connections were cut.
        This is how one peer among several behind the same proxy is partitioned away."""
        self._refused_from = clients
        if clients is None:
            return 0
        links = [link for link in self._links if clients(*link.ends)]
        for link in links:
            link.reset()
        self.stats.reset += len(links)
        return len(links)

    def set_link_faults(self, choose: LinkFaults | None) -> int:
        """Give the connections `choose` picks faults of their own (delay, jitter, loss), now
        and as they are accepted; None gives every connection the proxy's faults again.
        Returns how many open connections got faults of their own. This is how one peer's
        links among several behind the same proxy are slowed or made lossy."""
        links = list(self._links)
        chosen = [None if choose is None else _per_link(choose(*link.ends)) for link in links]
        self._link_faults = choose
        for link, faults in zip(links, chosen, strict=True):
            link.faults = faults
        return sum(faults is not None for faults in chosen)

    # -- data path ---------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ends = (writer.get_extra_info("peername")[:2], writer.get_extra_info("sockname")[:2])
        refused_from = self._refused_from
        if self.faults.partition == "refuse" or (refused_from is not None and refused_from(*ends)):
            self.stats.refused += 1
            rst_close(writer)
            return
        self.stats.accepted += 1
        choose = self._link_faults
        link = _Link(writer, ends, faults=None if choose is None else _per_link(choose(*ends)))
        self._links.add(link)
        self.stats.open += 1
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.add(handler)
        try:
            await self._flowing.wait()
            if link.closed:
                return
            try:
                up_reader, link.upstream = await asyncio.open_connection(*self.target)
            except OSError:
                self.stats.upstream_failures += 1
                rst_close(writer)
                return
            link.tasks = [
                asyncio.create_task(self._direction(link, reader, link.upstream, "up")),
                asyncio.create_task(self._direction(link, up_reader, writer, "down")),
            ]
            await asyncio.gather(*link.tasks, return_exceptions=True)
        finally:
            if handler is not None:
                self._handlers.discard(handler)
            self._links.discard(link)
            self.stats.open -= 1
            for end in (writer, link.upstream):
                if end is not None and not end.transport.is_closing():
                    end.transport.abort()

    async def _direction(
        self, link: _Link, src: asyncio.StreamReader, dst: asyncio.StreamWriter, name: str
    ) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)
        writer = asyncio.create_task(self._write(link, queue, dst, name))
        try:
            await self._read(link, src, queue)
            await queue.join()
            with contextlib.suppress(OSError):
                dst.write_eof()
            await asyncio.sleep(0)
        finally:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    async def _read(
        self, link: _Link, src: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes]]
    ) -> None:
        due = 0.0
        while True:
            await self._flowing.wait()
            try:
                data = await src.read(CHUNK)
            except OSError:
                link.reset()
                return
            if not data:
                return
            faults = link.faults or self.faults
            if faults.loss and self._random.random() < faults.loss:
                if faults.loss_mode == "drop":
                    self.stats.dropped += 1
                    link.reset()
                    return
                self.stats.stalled += 1
                due = max(due, time.monotonic() + faults.stall_s)
            unit = self._random.uniform(-1.0, 1.0)
            due = due_time(time.monotonic(), due, faults.delay_s, faults.jitter_s, unit)
            await queue.put((due, data))

    async def _write(
        self,
        link: _Link,
        queue: asyncio.Queue[tuple[float, bytes]],
        dst: asyncio.StreamWriter,
        name: str,
    ) -> None:
        while True:
            due, data = await queue.get()
            try:
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                await asyncio.sleep(self._bandwidth_wait(name, len(data)))
                await self._flowing.wait()
                dst.write(data)
                await dst.drain()
            except OSError:
                link.reset()
                return
            finally:
                queue.task_done()
            if name == "up":
                self.stats.bytes_up += len(data)
            else:
                self.stats.bytes_down += len(data)

    def _bandwidth_wait(self, direction: str, size: int) -> float:
        rate = self.faults.bandwidth_bps
        if rate is None:
            return 0.0
        now = time.monotonic()
        bucket = self._buckets.get(direction)
        if bucket is None:
            bucket = self._buckets[direction] = TokenBucket(rate, max(rate / 20, 1024.0), now)
        return bucket.reserve(size, now)


def _per_link(faults: NetFaults | None) -> NetFaults | None:
    if faults is not None and (faults.partition is not None or faults.bandwidth_bps is not None):
        raise ProxyError(
            "only delay_s, jitter_s and loss can be set per connection; partition a peer "
            "with refuse_from and limit bandwidth on the whole proxy"
        )
    return faults
