"""The link relay: one HTTP proxy (on 127.0.0.1, or a hosts' bridge address) that every
rollout<->learner link dials through (processes started with `$SHOAL_LINK_RELAY`, see
runtime/tunnel.py), so link faults land on the real TCP path between two processes although
their stream ports are ephemeral.

Each connection names its destination in its first request (`CONNECT host:port` for a frame
stream, an absolute-form GET for a websocket); the relay connects there and splices the bytes.
Faults are chosen per connection by the processes at its ends: `inject(name, faults, pids)`
hits the links a process in `pids` dialled (the kernel says who holds the client socket,
sockets.py) and the links dialled to a port one of them listens on; pids=None hits every link;
`addresses` hits the links with an end at one of them (every link of a host, wherever its
processes run and whenever they started: a cut between hosts).
When several injected faults match a link, the latest wins. Every fault a `NetFaults` can say
applies per link: partition (refuse: RST now and at every redial; blackhole: nothing flows
until healed), delay with jitter, loss (drop or stall) and bandwidth (per link and direction);
`reset(pids)` RSTs the matching links once. Bad requests and unreachable destinations get an
HTTP error reply and a closed connection; nothing a client sends stops the relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from shoal.chaos.errors import ProxyError
from shoal.chaos.pump import CHUNK, FaultPump, bucket_wait, listen, rst_close, shut_down
from shoal.chaos.relay_http import RelayRequest, RelayRequestError, parse_request
from shoal.chaos.sockets import Endpoint, link_of
from shoal.chaos.traffic import NetFaults, TokenBucket

LinkOwner = Callable[[int, Endpoint, Endpoint, Endpoint], bool]
"""(pid, client end, relay end, destination) -> whether the connection is one of pid's links."""

# A client has this long to send its request head.
HEAD_TIMEOUT = 10.0
# How long an error reply waits for the client to stop sending before closing.
REPLY_GRACE = 1.0
HEALTHY = NetFaults()


@dataclass
class RelayStats:
    """Counters since start; what the tests and the chaos report read."""

    accepted: int = 0
    relayed: int = 0
    bad_requests: int = 0
    refused: int = 0
    reset: int = 0
    dropped: int = 0
    stalled: int = 0
    upstream_failures: int = 0
    open: int = 0
    bytes_up: int = 0
    bytes_down: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class LinkFault:
    faults: NetFaults
    pids: frozenset[int] | None
    """The processes whose links it hits; None for every link (unless `addresses` says)."""
    addresses: frozenset[str] | None = None
    """The hosts whose links it hits: a link whose client or destination has one of these
    addresses. Set, it replaces `pids`."""


@dataclass(eq=False)
class _Tunnel:
    client: asyncio.StreamWriter
    ends: tuple[Endpoint, Endpoint]
    target: Endpoint | None = None
    upstream: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    closed: bool = False
    faults: NetFaults = HEALTHY
    flowing: asyncio.Event = field(default_factory=asyncio.Event)
    buckets: dict[str, TokenBucket] = field(default_factory=dict)
    owners: dict[int, bool] = field(default_factory=dict)
    """pid -> whether this is one of its links, looked up once per pid."""

    def reset(self) -> None:
        self.closed = True
        self.flowing.set()
        for writer in (self.client, self.upstream):
            if writer is not None:
                rst_close(writer)
        for task in self.tasks:
            task.cancel()


class LinkRelay:
    """`async with LinkRelay() as relay:` then start processes with
    `SHOAL_LINK_RELAY=relay.address`."""

    def __init__(
        self,
        listen_port: int = 0,
        seed: int | None = None,
        owner: LinkOwner = link_of,
        listen_host: str = "127.0.0.1",
        reach: Sequence[ipaddress.IPv4Network] = (),
    ) -> None:
        """`listen_host`: where the processes reach the relay (a hosts' bridge address when
        they run in network namespaces of their own); `reach`: the networks it forwards to
        besides loopback (those hosts' network)."""
        self._listen_port = listen_port
        self.listen_host = listen_host
        self.reach = tuple(reach)
        self._owner = owner
        self.stats = RelayStats()
        self._pump = FaultPump(self, self.stats, random.Random(seed))
        self._faults: dict[str, LinkFault] = {}
        self._touched: dict[str, set[_Tunnel]] = {}
        """Fault name -> every link it has hit since injected, open then or opened since."""
        self._tunnels: set[_Tunnel] = set()
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[object]] = set()

    def __repr__(self) -> str:
        return f"<LinkRelay :{self._listen_port} faults={sorted(self._faults)} links={len(self._tunnels)}>"

    @property
    def port(self) -> int:
        if self._server is None:
            raise ProxyError("the link relay is not started; call start() first")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def address(self) -> str:
        """What `$SHOAL_LINK_RELAY` is set to."""
        return f"{self.listen_host}:{self.port}"

    async def start(self) -> LinkRelay:
        self._server = await listen(self._accept, self.listen_host, self._listen_port)
        self._listen_port = self.port
        return self

    async def close(self) -> None:
        await shut_down(self._server, self._tunnels, self._handlers)
        self._server = None

    async def __aenter__(self) -> LinkRelay:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- control -----------------------------------------------------------------------------

    def inject(
        self,
        name: str,
        faults: NetFaults,
        pids: Iterable[int] | None = None,
        addresses: Iterable[str] | None = None,
    ) -> int:
        """Put `faults` on the links of `pids` (None: all links), or with `addresses` on the
        links with an end at one of those hosts, open ones now and new ones as they come,
        until `heal(name)`; re-injecting a name replaces it. Returns how many open links it
        hits."""
        self._faults.pop(name, None)
        self._touched[name] = set()
        self._faults[name] = LinkFault(
            faults,
            None if pids is None else frozenset(pids),
            None if addresses is None else frozenset(addresses),
        )
        self._apply_all()
        return len(self._touched[name])

    def heal(self, name: str) -> int:
        """Lift the fault injected as `name`; links it blackholed flow again. Returns how many
        links it hit while in place: a process that redialled during the fault has links that
        were not open when it was injected."""
        if self._faults.pop(name, None) is None:
            raise ProxyError(f"no link fault named {name!r}; injected: {sorted(self._faults)}")
        self._apply_all()
        return len(self._touched.pop(name))

    def heal_all(self) -> None:
        self._faults.clear()
        self._touched.clear()
        self._apply_all()

    def reset(self, pids: Iterable[int] | None = None) -> int:
        """RST the open links of `pids` (None: all), both sides, once; returns how many."""
        chosen = None if pids is None else frozenset(pids)
        hit = [t for t in self._tunnels if t.target is not None and self._matches(t, chosen)]
        for tunnel in hit:
            tunnel.reset()
        self.stats.reset += len(hit)
        return len(hit)

    def links(self, pids: Iterable[int] | None = None) -> list[dict[str, Any]]:
        """The open links of `pids` (None: all): their ends and the faults on them now."""
        chosen = None if pids is None else frozenset(pids)
        return [
            {
                "client": f"{t.ends[0][0]}:{t.ends[0][1]}",
                "target": f"{t.target[0]}:{t.target[1]}",
                "faults": t.faults.to_dict(),
            }
            for t in self._tunnels
            if t.target is not None and self._matches(t, chosen)
        ]

    def _hits(self, tunnel: _Tunnel, fault: LinkFault) -> bool:
        if fault.addresses is None:
            return self._matches(tunnel, fault.pids)
        if tunnel.target is None:
            return False
        return bool({tunnel.ends[0][0], tunnel.target[0]} & fault.addresses)

    def _matches(self, tunnel: _Tunnel, pids: frozenset[int] | None) -> bool:
        if tunnel.target is None:
            return False
        if pids is None:
            return True
        for pid in pids:
            known = tunnel.owners.get(pid)
            if known is None:
                known = tunnel.owners[pid] = self._owner(pid, *tunnel.ends, tunnel.target)
            if known:
                return True
        return False

    def _apply_all(self) -> None:
        for tunnel in list(self._tunnels):
            if tunnel.target is not None:
                self._apply(tunnel)

    def _apply(self, tunnel: _Tunnel) -> None:
        faults = HEALTHY
        for name, fault in self._faults.items():
            if self._hits(tunnel, fault):
                faults = fault.faults
                self._touched[name].add(tunnel)
        if faults != tunnel.faults:
            tunnel.buckets.clear()
        tunnel.faults = faults
        if faults.partition == "blackhole":
            tunnel.flowing.clear()
        else:
            tunnel.flowing.set()
        if faults.partition == "refuse" and tunnel.upstream is not None:
            tunnel.reset()
            self.stats.reset += 1

    # -- data path ---------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.accepted += 1
        ends = (writer.get_extra_info("peername")[:2], writer.get_extra_info("sockname")[:2])
        tunnel = _Tunnel(writer, ends)
        self._tunnels.add(tunnel)
        self.stats.open += 1
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.add(handler)
        try:
            await self._relay(tunnel, reader)
        finally:
            if handler is not None:
                self._handlers.discard(handler)
            self._tunnels.discard(tunnel)
            self.stats.open -= 1
            for end in (writer, tunnel.upstream):
                if end is not None and not end.transport.is_closing():
                    end.transport.abort()

    async def _relay(self, tunnel: _Tunnel, reader: asyncio.StreamReader) -> None:
        request = await self._read_request(tunnel.client, reader)
        if request is None:
            return
        tunnel.target = request.target
        self._apply(tunnel)
        await tunnel.flowing.wait()  # a blackholed link is never connected until healed
        if tunnel.closed:
            return
        if tunnel.faults.partition == "refuse":
            self.stats.refused += 1
            rst_close(tunnel.client)
            return
        try:
            up_reader, tunnel.upstream = await asyncio.open_connection(*request.target)
        except OSError as exc:
            self.stats.upstream_failures += 1
            host, port = request.target
            await _reply(reader, tunnel.client, 502, f"cannot reach {host}:{port}: {exc}")
            return
        if tunnel.closed or tunnel.faults.partition == "refuse":  # cut while connecting
            self.stats.refused += 1
            tunnel.reset()
            return
        self.stats.relayed += 1
        if request.forward is None:
            tunnel.client.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            tunnel.upstream.write(request.forward)
        tunnel.tasks = [
            asyncio.create_task(self._pump.splice(tunnel, reader, tunnel.upstream, "up")),
            asyncio.create_task(self._pump.splice(tunnel, up_reader, tunnel.client, "down")),
        ]
        await asyncio.gather(*tunnel.tasks, return_exceptions=True)

    async def _read_request(
        self, client: asyncio.StreamWriter, reader: asyncio.StreamReader
    ) -> RelayRequest | None:
        """The parsed request, or None after answering (or losing) a bad one."""
        try:
            async with asyncio.timeout(HEAD_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            return parse_request(head, self.reach)
        except RelayRequestError as exc:
            error = exc
        except asyncio.LimitOverrunError:
            error = RelayRequestError(431, "the request head is too long for a link relay")
        except TimeoutError:
            error = RelayRequestError(408, f"no whole request head within {HEAD_TIMEOUT:g}s")
        except (asyncio.IncompleteReadError, OSError):
            return None
        self.stats.bad_requests += 1
        await _reply(reader, client, error.status, str(error))
        return None

    # -- the pump's view of a connection (Shaper) ------------------------------------------

    def faults_of(self, conn: _Tunnel) -> NetFaults:
        return conn.faults

    def flowing_of(self, conn: _Tunnel) -> asyncio.Event:
        return conn.flowing

    def bandwidth_wait(self, conn: _Tunnel, direction: str, size: int) -> float:
        """The bandwidth limit is each link's own, per direction."""
        return bucket_wait(conn.buckets, conn.faults.bandwidth_bps, direction, size)


async def _reply(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int, message: str
) -> None:
    """An HTTP error reply naming what went wrong, then close. What the client still sends is
    read and dropped first (for up to REPLY_GRACE): closing with unread bytes would make the
    kernel answer a RST, which can destroy the reply before the client reads it."""
    body = (message + "\n").encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    with contextlib.suppress(OSError, TimeoutError):
        writer.write(head.encode() + body)
        if writer.can_write_eof():
            writer.write_eof()
        await writer.drain()
        async with asyncio.timeout(REPLY_GRACE):
            while await reader.read(CHUNK):
                pass
    writer.close()
