"""`Link`: one authenticated session between two processes, used in both directions.

The session is a websocket (handshake, pings, the closing word) and, when both ends allow it,
a raw TCP frame stream beside it (stream.py) that then carries every frame of the link: one
ordered byte stream, so requests reach the actors in the order they were sent whatever their
size, and credit is counted exactly as on the websocket. Without a stream, frames travel on
the websocket, coalesced into messages of at most `chunk_bytes` (aiohttp moves 1 MiB messages
at well under half the speed of 64 KiB ones, see docs/runtime.md).

Both ends run the same code: frames are handled as they arrive (by the stream's read callback,
or the websocket's reader task), control frames answered at once, requests handed to local
actors in arrival order; writes are made by the sending code itself, the first frame of a
loop turn at once and the rest of the turn coalesced (link_writer.py). Any bytes the peer gets
wrong close that link, never the process. How an ask's answer or failure becomes a frame, and a
`fail` frame an exception, is in link_asks.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import aiohttp

from shoal.runtime import auth, wire
from shoal.runtime.credit import ReceiveCredit, SendCredit
from shoal.runtime.envelope import (
    ASK,
    CREDIT,
    ERROR,
    FAIL,
    MAX_ASK_TIMEOUT,
    REPLY,
    REQUESTS,
    TELL,
    check_envelope,
)
from shoal.runtime.errors import (
    ActorError,
    AuthenticationFailed,
    FrameTooLarge,
    InvalidTimeout,
    LinkClosed,
    MailboxFull,
    MalformedFrame,
    UnknownMessageType,
    WireError,
)
from shoal.runtime.link_asks import Served, credit_or_timeout, expire, fail_frame, failure
from shoal.runtime.link_writer import FrameWriter
from shoal.runtime.mailbox import DeadLetters
from shoal.runtime.ref import ActorRef
from shoal.runtime.stream import FrameStream

if TYPE_CHECKING:
    from shoal.runtime.transport import TransportConfig

logger = logging.getLogger(__name__)

Lookup = Callable[[str], ActorRef]

_WIRE_ERRORS: dict[str, type[WireError]] = {
    cls.__name__: cls
    for cls in (MalformedFrame, UnknownMessageType, FrameTooLarge, AuthenticationFailed)
}


class Link:
    """One authenticated session to a peer; used from tasks on one loop."""

    def __init__(
        self,
        ws: auth.Socket,
        config: TransportConfig,
        lookup: Lookup,
        granted: auth.Window,
        peer: str,
        dead_letters: DeadLetters | None = None,
        stream: FrameStream | None = None,
    ) -> None:
        self.peer = peer
        self._dead_letters = dead_letters
        self._ws = ws
        self._config = config
        self._lookup = lookup
        self._send_credit = SendCredit(granted.frames, granted.nbytes)
        self._receive_credit = ReceiveCredit(config.credit_frames, config.credit_bytes)
        self._inbox: deque[list[Any]] = deque()
        self._wake_delivery = asyncio.Event()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._serving: set[asyncio.Task[None]] = set()
        self._closed = asyncio.get_running_loop().create_future()
        self.error: WireError | None = None
        self._failing = False
        self._writer = FrameWriter(ws, config.chunk_bytes, peer, self._spawn, self._broken_write)
        if stream is not None:
            self.attach_stream(stream)
        self._tasks = [
            asyncio.create_task(self._read_loop(), name=f"shoal-link-read {peer}"),
            asyncio.create_task(self._deliver_loop(), name=f"shoal-link-deliver {peer}"),
        ]

    def __repr__(self) -> str:
        state = f"closed ({self.error})" if self.error else "open"
        return f"<Link {self.peer} {state} pending={len(self._pending)} {self._send_credit!r}>"

    @property
    def closed(self) -> bool:
        return self.error is not None

    @property
    def stream(self) -> FrameStream | None:
        """The raw TCP stream this link's frames travel on; None: they travel on the websocket."""
        return self._writer.stream

    @property
    def has_stream(self) -> bool:
        return self._writer.stream is not None

    def attach_stream(self, stream: FrameStream) -> None:
        """From now on every frame of this link travels on `stream`; its failure closes the
        link, and the link's closing closes it. Both ends attach before their first frame."""
        if self.error is not None:
            stream.close()
            return
        self._writer.stream = stream
        stream.take(self._on_stream_frame, self._stream_broken)

    def _stream_broken(self, error: WireError) -> None:
        # A malformed frame is the peer's fault (tell it); a dropped stream means the link is gone.
        self._fail(error, tell_peer=not isinstance(error, LinkClosed))

    def _fail(self, error: WireError, *, tell_peer: bool) -> None:
        """Close from a callback; frames still being parsed are ignored from now on."""
        if self._failing:
            return
        self._failing = True
        if tell_peer:
            logger.warning("closing link to %s: %s", self.peer, error)
        self._spawn(self.close(error, tell_peer=tell_peer))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)

    async def _broken_write(self, error: LinkClosed) -> None:
        await self.close(error, tell_peer=False)

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    # -- sending -------------------------------------------------------------------------

    def _encode(self, envelope: list[Any]) -> wire.EncodedFrame:
        if self.error is not None:
            raise LinkClosed(f"link to {self.peer} is closed: {self.error}")
        return wire.encode(envelope, self._config.max_frame_bytes)

    async def tell(
        self, target: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        frame = self._encode([TELL, target, method, list(args), kwargs])
        await self._send_credit.take(frame.nbytes)
        await self._writer.send(frame)

    def tell_nowait(
        self, target: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        frame = self._encode([TELL, target, method, list(args), kwargs])
        self._send_credit.take_nowait(frame.nbytes)
        self._writer.write(frame)

    async def ask(
        self,
        target: str,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
    ) -> Any:
        if not 0 < timeout <= MAX_ASK_TIMEOUT:  # also refuses NaN
            raise InvalidTimeout(
                f"ask timeout={timeout!r} is invalid: a remote ask takes seconds in "
                f"(0, {MAX_ASK_TIMEOUT:.0f}]"
            )
        request = next(self._ids)
        frame = self._encode([ASK, request, target, method, list(args), kwargs, float(timeout)])
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[Any] = loop.create_future()
        # A timer on the future is much cheaper than asyncio.timeout on this hot path.
        timer = loop.call_later(timeout, expire, reply, f"{target}.{method}", self.peer, timeout)
        try:
            if not self._send_credit.available:
                await credit_or_timeout(self._send_credit.take(frame.nbytes), reply)
            else:
                self._send_credit.take_nowait(frame.nbytes)
            self._pending[request] = reply
            await self._writer.send(frame)
            return await reply
        finally:
            timer.cancel()
            self._pending.pop(request, None)

    # -- receiving -----------------------------------------------------------------------

    async def _read_loop(self) -> None:
        reader = wire.FrameReader(self._config.max_frame_bytes)
        try:
            async for msg in self._ws:
                if msg.type == aiohttp.WSMsgType.ERROR:  # no pong in time, or a protocol error
                    raise _Broken(LinkClosed(f"the websocket to {self.peer} broke: {msg.data}"))
                if msg.type != aiohttp.WSMsgType.BINARY:
                    raise MalformedFrame(
                        f"the peer sent a {msg.type.name} websocket message; shoal links carry binary frames"
                    )
                for frame in reader.feed(msg.data):
                    envelope = check_envelope(wire.decode(frame, self._config.max_frame_bytes))
                    if self._writer.stream is not None and envelope[0] != ERROR:
                        raise MalformedFrame(
                            f"a {envelope[0]!r} frame came on the websocket, but this link "
                            "carries its frames on its stream"
                        )
                    self._dispatch(envelope, len(frame))
        except _Broken as exc:
            await self.close(exc.error, tell_peer=False)
            return
        except WireError as exc:
            logger.warning("closing link to %s: %s", self.peer, exc)
            await self.close(exc, tell_peer=True)
            return
        except (ConnectionError, aiohttp.ClientError) as exc:
            await self.close(LinkClosed(f"link to {self.peer} failed: {exc}"), tell_peer=False)
            return
        cut = " in the middle of a frame" if reader.mid_frame else ""
        await self.close(LinkClosed(f"{self.peer} closed the link{cut}"), tell_peer=False)

    def _on_stream_frame(self, frame: memoryview) -> None:
        """One frame from the stream, handled in its read callback (no task wakes for it)."""
        if self._failing or self.error is not None:
            return
        try:
            self._dispatch(
                check_envelope(wire.decode(frame, self._config.max_frame_bytes)), len(frame)
            )
        except _Broken as exc:
            self._fail(exc.error, tell_peer=False)
        except WireError as exc:
            self._fail(exc, tell_peer=True)

    def _dispatch(self, envelope: list[Any], nbytes: int) -> None:
        kind = envelope[0]
        if kind in REQUESTS:
            self._receive_credit.received(nbytes)
        if kind == TELL and not self._inbox and self._deliver_now(envelope, nbytes):
            return
        if kind == ASK and not self._inbox and self._ask_now(envelope, nbytes):
            return
        if kind in REQUESTS:
            envelope.append(nbytes)
            self._inbox.append(envelope)
            self._wake_delivery.set()
        elif kind == REPLY:
            _, request, result = envelope
            reply = self._pending.pop(request, None)
            if reply is not None and not reply.done():
                reply.set_result(result)
        elif kind == FAIL:
            _, request, runtime, type_name, message = envelope
            reply = self._pending.pop(request, None)
            if reply is not None and not reply.done():
                reply.set_exception(failure(runtime, type_name, message))
        elif kind == CREDIT:
            _, frames, granted_bytes = envelope
            self._send_credit.grant(frames, granted_bytes)
        else:
            _, type_name, message = envelope
            cls = _WIRE_ERRORS.get(type_name, LinkClosed)
            raise _Broken(cls(f"{self.peer} refused what this process sent: {message}"))

    async def _deliver_loop(self) -> None:
        """Hand requests to local actors in arrival order; a full mailbox holds back only this
        link's later requests, and its credit, which is what slows the remote producer."""
        inbox = self._inbox
        while True:
            if not inbox:
                self._wake_delivery.clear()
                await self._wake_delivery.wait()
                continue
            # Stays at the head until delivered, so the fast paths see the line is not empty.
            envelope = inbox[0]
            if envelope[0] == TELL:
                _, target, method, args, kwargs, nbytes = envelope
                await self._deliver_tell(target, method, tuple(args), kwargs)
                self._consumed(nbytes)
            else:
                await self._ask_when_room(envelope)
            inbox.popleft()

    def _deliver_now(self, envelope: list[Any], nbytes: int) -> bool:
        """The fast path: a tell that finds room in its mailbox skips the delivery task.
        False when the mailbox is full, so the tell must wait its turn in the inbox."""
        _, target, method, args, kwargs = envelope
        try:
            self._lookup(target)._tell_nowait(method, tuple(args), kwargs)
        except MailboxFull:
            return False
        except ActorError as exc:
            self._undelivered(target, method, exc)
        self._consumed(nbytes)
        return True

    def _undelivered(self, target: str, method: str, error: ActorError) -> None:
        """A tell has no reply to carry the error, so it is counted where local ones are."""
        logger.info("tell %s.%s from %s not delivered: %s", target, method, self.peer, error)
        if self._dead_letters is not None:
            self._dead_letters.record(target, method, f"{type(error).__name__} (from {self.peer})")

    def _ask_now(self, envelope: list[Any], nbytes: int) -> bool:
        """The fast path: an ask that finds room is queued into the mailbox on the spot with a
        reply slot that writes the answer when the handler returns; no task, no future. False
        when the mailbox is full, so the ask must wait its turn in the inbox."""
        _, request, target, method, args, kwargs, timeout = envelope
        slot = Served(self, request, nbytes)
        try:
            self._lookup(target)._ask_nowait(method, tuple(args), kwargs, timeout, slot)
        except MailboxFull:
            return False
        except Exception as exc:
            slot.set_exception(exc)
            return True
        slot.start(f"{target}.{method}", timeout)
        return True

    async def _ask_when_room(self, envelope: list[Any]) -> None:
        _, request, target, method, args, kwargs, timeout, nbytes = envelope
        slot = Served(self, request, nbytes)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            await self._lookup(target)._ask_queued(method, tuple(args), kwargs, timeout, slot)
        except Exception as exc:
            slot.set_exception(exc)
            return
        # The wait for room counts against the ask's timeout, as for a local ask.
        slot.start(f"{target}.{method}", timeout, max(deadline - loop.time(), 0.0))

    async def _deliver_tell(
        self, target: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        try:
            await self._lookup(target)._tell(method, args, kwargs)
        except ActorError as exc:
            self._undelivered(target, method, exc)

    def answer(self, request: int, nbytes: int, result: Any) -> None:
        """A served ask's result (from its `Served` slot): give the credit back and write the
        reply (a `fail` if the result cannot cross)."""
        self._consumed(nbytes)
        if self.error is not None:
            return
        try:
            frame = wire.encode([REPLY, request, result], self._config.max_frame_bytes)
        except WireError as exc:
            frame = fail_frame(request, exc)
        self._writer.write(frame)

    def answer_failed(self, request: int, nbytes: int, error: BaseException) -> None:
        """A served ask's failure (from its `Served` slot): give the credit back, write a `fail`."""
        self._consumed(nbytes)
        if self.error is None:
            self._writer.write(fail_frame(request, error))

    def _consumed(self, nbytes: int) -> None:
        grant = self._receive_credit.consumed(nbytes)
        if grant is not None and self.error is None:
            self._writer.write(wire.encode([CREDIT, *grant]))

    # -- closing -------------------------------------------------------------------------

    async def close(self, error: WireError | None = None, *, tell_peer: bool = False) -> None:
        """Close once: fail pending asks and waiting senders, stop the tasks, say why to the peer."""
        if self.error is not None:
            return
        self.error = error or LinkClosed(f"link to {self.peer} was closed by this process")
        self._writer.stopped = True
        closed = self.error if isinstance(self.error, LinkClosed) else LinkClosed(str(self.error))
        self._send_credit.close(closed)
        for reply in self._pending.values():
            if not reply.done():
                reply.set_exception(self.error if error is not None and not tell_peer else closed)
        self._pending.clear()
        current = asyncio.current_task()
        others = [task for task in [*self._tasks, *self._serving] if task is not current]
        for task in others:
            task.cancel()
        if self._writer.stream is not None:
            self._writer.stream.close()
        await asyncio.gather(*others, return_exceptions=True)
        try:
            # Bounded: a peer that stopped reading must not keep this link half-closed.
            async with asyncio.timeout(_CLOSE_TIMEOUT):
                if tell_peer and not self._ws.closed:
                    frame = wire.encode([ERROR, type(error).__name__, str(error)])
                    await self._ws.send_bytes(b"".join(bytes(p) for p in frame.parts))
                await self._ws.close()
        except (ConnectionError, aiohttp.ClientError, RuntimeError, TimeoutError):
            pass
        finally:
            if not self._closed.done():
                self._closed.set_result(None)


class _Broken(Exception):
    """The peer reported an error about us, or the socket broke: the link closes without
    answering. Carried out of the read loop."""

    def __init__(self, error: WireError) -> None:
        super().__init__(str(error))
        self.error = error


_CLOSE_TIMEOUT = 2.0
