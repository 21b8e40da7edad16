"""A TCP fault proxy (on 127.0.0.1 unless told otherwise): clients connect to it instead of the
real server, and the faults set on it (see `NetFaults`) apply to the real byte stream between
two real processes.

Each accepted connection gets an upstream connection and two directions, each spliced by the
fault pump (pump.py) that the link relay shares. For the event loop; `set_faults`, `heal` and
`reset_connections` may be called at any time, from the loop's thread.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.chaos.errors import ProxyError
from shoal.chaos.pump import FaultPump, bucket_wait, listen, rst_close, shut_down
from shoal.chaos.sockets import ConnectionFilter, Endpoint
from shoal.chaos.traffic import NetFaults, TokenBucket

LinkFaults = Callable[[Endpoint, Endpoint], NetFaults | None]
"""(client end, server end) of a connection -> the faults for it alone, or None for the
proxy's own. Only delay, jitter and loss can be set per connection."""


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
        self._links: set[_Link] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._buckets: dict[str, TokenBucket] = {}
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[object]] = set()
        self._refused_from: ConnectionFilter | None = None
        self._link_faults: LinkFaults | None = None
        self._pump = FaultPump(self, self.stats, random.Random(seed))

    def __repr__(self) -> str:
        return f"<FaultProxy :{self._listen_port} -> {self.target} {self.faults} links={len(self._links)}>"

    @property
    def port(self) -> int:
        if self._server is None:
            raise ProxyError("the proxy is not started; call start() first")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> FaultProxy:
        self._server = await listen(self._accept, self.listen_host, self._listen_port)
        self._listen_port = self.port
        return self

    async def close(self) -> None:
        self._flowing.set()
        await shut_down(self._server, self._links, self._handlers)
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
                asyncio.create_task(self._pump.splice(link, reader, link.upstream, "up")),
                asyncio.create_task(self._pump.splice(link, up_reader, writer, "down")),
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

    # -- the pump's view of a connection (Shaper) ------------------------------------------

    def faults_of(self, conn: _Link) -> NetFaults:
        return conn.faults or self.faults

    def flowing_of(self, conn: _Link) -> asyncio.Event:
        return self._flowing

    def bandwidth_wait(self, conn: _Link, direction: str, size: int) -> float:
        """The bandwidth limit is the whole proxy's, per direction."""
        return bucket_wait(self._buckets, self.faults.bandwidth_bps, direction, size)


def _per_link(faults: NetFaults | None) -> NetFaults | None:
    if faults is not None and (faults.partition is not None or faults.bandwidth_bps is not None):
        raise ProxyError(
            "only delay_s, jitter_s and loss can be set per connection; partition a peer "
            "with refuse_from and limit bandwidth on the whole proxy"
        )
    return faults
