"""Links between processes: one aiohttp server per process, one websocket per pair of peers,
and beside each websocket a raw TCP frame stream that carries the link's frames.

`TransportConfig` says how a process listens and paces its links; `Transport` is the server
peers connect to (the websocket route and the stream listener) plus the links this process
opened (each an authenticated `Link`, see link.py); `attach` wires a transport to an
`ActorSystem`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import aiohttp
from aiohttp import web

from shoal.config import check_int
from shoal.errors import ConfigError
from shoal.runtime import auth, tunnel, wire
from shoal.runtime.errors import ActorNotFound, LinkClosed, WireError
from shoal.runtime.link import Link, Lookup
from shoal.runtime.mailbox import DeadLetters
from shoal.runtime.ref import ActorRef
from shoal.runtime.stream import FrameStream
from shoal.runtime.tls import TlsFiles, check_cleartext, cleartext_allowed, tls_from_env

if TYPE_CHECKING:
    from shoal.runtime.remote import Peer
    from shoal.runtime.system import ActorSystem

logger = logging.getLogger(__name__)

SCHEME = "shoal://"
# The largest websocket message either end accepts, whatever chunk size the peer writes with,
# so peers configured differently still understand each other.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
ROUTE = "/shoal"


def _relay_from_env() -> str | None:
    return os.environ.get(tunnel.RELAY_ENV) or None


@dataclass(frozen=True)
class TransportConfig:
    """How a process listens, authenticates and paces its links. The defaults suit one host."""

    token: bytes | str
    """The cluster token every process shares; links without it are refused."""
    host: str = "127.0.0.1"
    port: int = 0
    """0 picks a free port; `Transport.address` reports the real one."""
    max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES
    chunk_bytes: int = 64 * 1024
    """Largest websocket message written; bigger frames are cut into pieces of this size."""
    credit_frames: int = 1024
    credit_bytes: int = 64 * 1024 * 1024
    """The window this process grants each peer: requests in flight or queued before it waits."""
    handshake_timeout: float = 5.0
    """How long a connection may take to authenticate, from its first byte: a websocket that
    sends no request, a slow one, and a stream without its hello are closed after it."""
    max_unauthenticated: int = 256
    """Connections per listener (websocket, stream) that may be waiting to authenticate at once;
    more are closed on arrival, so strangers cannot hold the process's memory."""
    connect_timeout: float = 5.0
    """How long a send waits for a (re)connection before raising LinkClosed."""
    reconnect_initial: float = 0.05
    reconnect_max: float = 2.0
    heartbeat: float = 10.0
    """Seconds between websocket pings; a peer silent for half that after a ping (stopped,
    partitioned) has its link closed, failing pending asks and waiting senders."""
    stream: bool = True
    """Carry each link's frames on a raw TCP stream beside its websocket (see stream.py);
    a link uses one only when both ends allow it."""
    stream_port: int = 0
    """Where this process listens for frame streams; 0 picks a free port, announced to peers
    in the link handshake."""
    relay: str | None = field(default_factory=_relay_from_env)
    """'HOST:PORT' of a link relay every outbound link dials through (see tunnel.py), so a
    chaos run can fault the real path between processes; like HTTP_PROXY it defaults to
    `$SHOAL_LINK_RELAY`, inherited by every task a node daemon starts. None dials directly."""

    tls: TlsFiles | None = field(default_factory=tls_from_env)
    """Mutual TLS on every connection of every link (see tls.py); both ends must agree. It
    defaults to `$SHOAL_TLS_DIR`, inherited by every task a node daemon starts; None is
    cleartext after the token handshake."""
    allow_cleartext: bool = field(default_factory=cleartext_allowed)
    """Listen without TLS on an address other than loopback (`$SHOAL_ALLOW_CLEARTEXT`)."""

    def __post_init__(self) -> None:
        if self.tls is not None and not isinstance(self.tls, TlsFiles):
            raise ConfigError(f"tls={self.tls!r} is invalid: use a TlsFiles or None")
        if isinstance(self.host, str):
            check_cleartext("the transport host", self.host, self.tls, self.allow_cleartext)
        if not isinstance(self.token, bytes | str) or not self.token:
            raise ConfigError("token is empty: give every process the same non-empty cluster token")
        for key in ("port", "stream_port"):
            value = getattr(self, key)
            if type(value) is not int or not 0 <= value <= 65535:
                raise ConfigError(f"{key}={value!r} is invalid: use 0 (any free port) to 65535")
        if not isinstance(self.stream, bool):
            raise ConfigError(f"stream={self.stream!r} is invalid: use true or false")
        if self.relay is not None:
            if not isinstance(self.relay, str):
                raise ConfigError(f"relay={self.relay!r} is invalid: write HOST:PORT or None")
            tunnel.parse_relay(self.relay)
        self._positive_int("max_frame_bytes", wire.PREFIX_SIZE)
        self._positive_int("chunk_bytes", 1024)
        if self.chunk_bytes > MAX_MESSAGE_BYTES // 2:
            raise ConfigError(
                f"chunk_bytes={self.chunk_bytes} is invalid: use at most {MAX_MESSAGE_BYTES // 2}"
            )
        self._positive_int("credit_frames", 1)
        self._positive_int("credit_bytes", 1)
        self._positive_int("max_unauthenticated", 1)
        for key in (
            "handshake_timeout",
            "connect_timeout",
            "reconnect_initial",
            "reconnect_max",
            "heartbeat",
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"{key}={value!r} is invalid: use a number of seconds > 0")

    def _positive_int(self, key: str, minimum: int) -> None:
        """shoal.config.check_int, worded like the transport's other errors (`key=value`)."""
        value = getattr(self, key)
        try:
            check_int(key, value, minimum)
        except ConfigError:
            raise ConfigError(
                f"{key}={value!r} is invalid: use a whole number >= {minimum}"
            ) from None

    @property
    def token_bytes(self) -> bytes:
        return self.token.encode() if isinstance(self.token, str) else self.token

    @property
    def window(self) -> auth.Window:
        return auth.Window(self.credit_frames, self.credit_bytes)


def split_url(url: str) -> tuple[str, str]:
    """'shoal://host:port/name' -> ('shoal://host:port', 'name')."""
    rest = url.removeprefix(SCHEME)
    host, _, name = rest.partition("/")
    if not url.startswith(SCHEME) or ":" not in host or not name:
        raise ActorNotFound(f"{url!r} is not a remote actor path; write shoal://HOST:PORT/NAME")
    return SCHEME + host, name


def _ws_url(address: str, tls: bool) -> str:
    return ("wss://" if tls else "ws://") + address.removeprefix(SCHEME) + ROUTE


class Transport:
    """This process's endpoint: the server peers connect to, and the links it opened to them.

    `lookup` finds the local actor a remote request names (an `ActorSystem.lookup`). Create,
    `await start()` and `await close()` on the loop the actors run on."""

    def __init__(
        self, config: TransportConfig, lookup: Lookup, dead_letters: DeadLetters | None = None
    ) -> None:
        self.config = config
        self._lookup = lookup
        self._dead_letters = dead_letters
        self._runner: web.AppRunner | None = None
        self._http_server: asyncio.AbstractServer | None = None
        self._session: aiohttp.ClientSession | None = None
        self._inbound: set[Link] = set()
        self._peers: dict[str, Peer] = {}
        self.address = ""
        self._on_close: list[Callable[[], None]] = []
        self._stream_server: asyncio.AbstractServer | None = None
        self._stream_port: int | None = None
        # Inbound links whose frame stream has not arrived yet, by the server nonce.
        self._awaiting_stream: dict[bytes, tuple[auth.Session, Link]] = {}
        # Frame streams not (yet) handed to a link: closed with the transport.
        self._stream_pending: weakref.WeakSet[FrameStream] = weakref.WeakSet()
        self._stream_tasks: set[asyncio.Task[None]] = set()
        self._refused = 0
        tls = config.tls
        self._server_tls = None if tls is None else tls.server_context()
        self._client_tls = None if tls is None else tls.client_context()

    def __repr__(self) -> str:
        return f"<Transport {self.address or 'stopped'} in={len(self._inbound)} out={len(self._peers)}>"

    async def start(self) -> str:
        """Listen and return this process's address, 'shoal://host:port'; raises OSError
        when the port is taken."""
        app = web.Application()
        app.router.add_get(ROUTE, self._accept)
        # aiohttp's keep-alive timer also closes a connection that sends no whole request.
        self._runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            keepalive_timeout=self.config.handshake_timeout,
        )
        await self._runner.setup()
        http = self._runner.server
        assert http is not None
        loop = asyncio.get_running_loop()
        try:
            self._http_server = await loop.create_server(
                lambda: self._admit_http(http),
                self.config.host,
                self.config.port,
                **self._tls_server_options(),
            )
        except OSError:  # the port is taken, or the host is not ours: leave nothing behind
            await self._runner.cleanup()
            self._runner = None
            raise
        port = self._http_server.sockets[0].getsockname()[1]
        if self.config.stream:
            try:
                await self._start_stream()
            except OSError:
                await self._close_http()
                raise
        self.address = f"{SCHEME}{self.config.host}:{port}"
        # The session's timeout covers the websocket upgrade only; links live indefinitely.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout)
        )
        return self.address

    async def _start_stream(self) -> None:
        loop = asyncio.get_running_loop()
        self._stream_server = await loop.create_server(
            self._admit_stream,
            self.config.host,
            self.config.stream_port,
            **self._tls_server_options(),
        )
        self._stream_port = self._stream_server.sockets[0].getsockname()[1]

    def _tls_server_options(self) -> dict[str, Any]:
        if self._server_tls is None:
            return {}
        return {"ssl": self._server_tls, "ssl_handshake_timeout": self.config.handshake_timeout}

    def _admit_http(self, http: web.Server) -> asyncio.Protocol:
        """aiohttp's protocol for a new connection, unless too many are already waiting to
        authenticate (links that did are not counted)."""
        if len(http.connections) - len(self._inbound) >= self.config.max_unauthenticated:
            return self._refuse()
        return cast(asyncio.Protocol, http())

    def _admit_stream(self) -> asyncio.BaseProtocol:
        if len(self._stream_pending) >= self.config.max_unauthenticated:
            return self._refuse()
        return FrameStream(auth.MAX_HANDSHAKE_BYTES, self._stream_connected)

    def _refuse(self) -> asyncio.Protocol:
        """A protocol that closes the connection; logged at the 1st, 2nd, 4th, 8th, ...
        refusal, so a flood costs a few log lines, not one per connection."""
        self._refused += 1
        if self._refused & (self._refused - 1) == 0:
            logger.warning(
                "refused %d connection(s) so far: %d were already waiting to authenticate "
                "(TransportConfig.max_unauthenticated)",
                self._refused,
                self.config.max_unauthenticated,
            )
        return _Refused()

    def _stream_connected(self, stream: FrameStream) -> None:
        self._stream_pending.add(stream)
        task = asyncio.create_task(self._accept_stream(stream))
        self._stream_tasks.add(task)
        task.add_done_callback(self._stream_tasks.discard)

    async def _accept_stream(self, stream: FrameStream) -> None:
        """Authenticate a frame stream and hand it to the link it names; anything wrong closes
        this connection only."""
        try:
            nonce = await auth.stream_server_handshake(
                stream,
                self.config.token_bytes,
                self._stream_session,
                self.config.handshake_timeout,
            )
        except WireError as exc:
            logger.warning("refused a frame stream: %s", exc)
            stream.close_gently(self.config.handshake_timeout)
            return
        self._stream_pending.discard(stream)
        _, link = self._awaiting_stream.pop(nonce)
        stream.limit = self.config.max_frame_bytes
        link.attach_stream(stream)

    def _stream_session(self, nonce: bytes) -> auth.Session | None:
        waiting = self._awaiting_stream.get(nonce)
        return None if waiting is None else waiting[0]

    async def _accept(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(
            compress=False,
            max_msg_size=MAX_MESSAGE_BYTES,
            timeout=1.0,
            writer_limit=self.config.chunk_bytes * 16,
            heartbeat=self.config.heartbeat,
        )
        await ws.prepare(request)
        peer = f"inbound {request.remote}"
        try:
            session = await auth.server_handshake(
                ws,
                self.config.token_bytes,
                self.config.window,
                self.config.handshake_timeout,
                self._stream_port,
            )
        except WireError as exc:
            logger.warning("refused link from %s: %s", peer, exc)
            await ws.close()
            return ws
        link = Link(ws, self.config, self._lookup, session.window, peer, self._dead_letters)
        self._inbound.add(link)
        if self._stream_port is not None:
            self._awaiting_stream[session.server_nonce] = (session, link)
        try:
            await link.wait_closed()
        finally:
            self._inbound.discard(link)
            self._awaiting_stream.pop(session.server_nonce, None)
        return ws

    async def open_link(self, address: str) -> Link:
        """Connect and authenticate one new link to `address` ('shoal://host:port')."""
        if self._session is None:
            raise LinkClosed("the transport is not started; await transport.start() first")
        relay = self.config.relay
        try:
            ws = await self._session.ws_connect(
                _ws_url(address, self._client_tls is not None),
                ssl=self._client_tls if self._client_tls is not None else True,
                compress=0,
                max_msg_size=MAX_MESSAGE_BYTES,
                autoping=True,
                heartbeat=self.config.heartbeat,
                timeout=aiohttp.ClientWSTimeout(ws_close=1.0),
                proxy=None if relay is None else tunnel.relay_url(relay),
            )
        except (aiohttp.ClientError, OSError) as exc:
            if relay is None:
                raise
            raise tunnel.RelayRefused(
                f"no link to {address} through the link relay {relay}: {exc}; is the relay "
                f"running? (unset ${tunnel.RELAY_ENV} to dial peers directly)"
            ) from exc
        try:
            session = await auth.client_handshake(
                ws, self.config.token_bytes, self.config.window, self.config.handshake_timeout
            )
            stream = await self._open_stream(address, session)
        except BaseException:
            await ws.close()
            raise
        return Link(
            ws, self.config, self._lookup, session.window, address, self._dead_letters, stream
        )

    async def _open_stream(self, address: str, session: auth.Session) -> FrameStream | None:
        """The frame stream for a new link, or None when either end does without one or it
        cannot be opened (then the link's frames go over the websocket, only slower)."""
        if not self.config.stream or session.stream_port is None:
            return None
        host = address.removeprefix(SCHEME).rpartition(":")[0].strip("[]")
        timeout = self.config.handshake_timeout
        stream: FrameStream | None = None
        try:
            async with asyncio.timeout(timeout):
                stream = await self._connect_stream(host, session.stream_port)
            await auth.stream_client_handshake(stream, self.config.token_bytes, session, timeout)
        except (OSError, WireError, TimeoutError) as exc:
            logger.warning(
                "no frame stream to %s (%s); its frames go over the websocket", address, exc
            )
            if stream is not None:
                stream.close()
            return None
        stream.limit = self.config.max_frame_bytes
        return stream

    async def _connect_stream(self, host: str, port: int) -> FrameStream:
        """A TCP connection to a peer's stream port, through the relay when there is one."""
        loop = asyncio.get_running_loop()
        relay = self.config.relay
        tls: dict[str, Any] = {}
        if self._client_tls is not None:
            tls = {"ssl": self._client_tls, "server_hostname": host}
        if relay is None:
            _, stream = await loop.create_connection(
                lambda: FrameStream(auth.MAX_HANDSHAKE_BYTES), host, port, **tls
            )
            return stream
        sock = await tunnel.open_tunnel(relay, host, port, self.config.handshake_timeout)
        try:
            _, stream = await loop.create_connection(
                lambda: FrameStream(auth.MAX_HANDSHAKE_BYTES), sock=sock, **tls
            )
        except BaseException:
            sock.close()
            raise
        return stream

    def peer(self, address: str) -> Peer:
        """The reconnecting connection to `address`, created on first use."""
        from shoal.runtime.remote import Peer

        peer = self._peers.get(address)
        if peer is None:
            if self._session is None:
                raise LinkClosed(
                    f"cannot reach {address}: the transport is not running (start it first)"
                )
            peer = self._peers[address] = Peer(address, self)
        return peer

    def resolver(self, address: str) -> Lookup:
        """What `ActorSystem.attach_remote(address, ...)` needs: name -> RemoteRef."""
        from shoal.runtime.remote import RemoteRef

        peer = self.peer(address)
        return lambda name: RemoteRef(f"{address}/{name}", peer, name)

    def ref(self, url: str) -> ActorRef:
        """A ref to the actor at 'shoal://host:port/name'."""
        address, name = split_url(url)
        return self.resolver(address)(name)

    def on_close(self, callback: Callable[[], None]) -> None:
        self._on_close.append(callback)

    async def close(self) -> None:
        """Close every link and stop listening; pending asks fail with LinkClosed."""
        for callback in self._on_close:
            callback()
        self._on_close.clear()
        for peer in list(self._peers.values()):
            await peer.close()
        self._peers.clear()
        for link in list(self._inbound):
            await link.close()
        for task in list(self._stream_tasks):
            task.cancel()
        await asyncio.gather(*self._stream_tasks, return_exceptions=True)
        for stream in list(self._stream_pending):
            stream.close()
        if self._stream_server is not None:
            self._stream_server.close()
            await self._stream_server.wait_closed()
            self._stream_server = None
            self._stream_port = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        await self._close_http()

    async def _close_http(self) -> None:
        """Stop listening, close aiohttp's connections, then wait for the listener: from
        Python 3.12 `wait_closed` waits for every connection it accepted."""
        server, self._http_server = self._http_server, None
        if server is not None:
            server.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if server is not None:
            await server.wait_closed()


class _Refused(asyncio.Protocol):
    """A connection over `max_unauthenticated`: closed on arrival, before anything is read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


async def attach(system: ActorSystem, config: TransportConfig) -> Transport:
    """Serve `system`'s actors to other processes and make its `ref` resolve remote paths.
    Close the returned transport before stopping the system."""
    transport = Transport(config, system.lookup, system.dead_letters)
    address = await transport.start()
    system.attach_remote(address, transport.ref)
    transport.on_close(system.detach_remote)
    return transport
