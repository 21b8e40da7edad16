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
loop turn at once and the rest of the turn coalesced. Any bytes the peer gets wrong close
that link, never the process.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
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
    ActorNotFound,
    AskTimeout,
    AuthenticationFailed,
    FrameTooLarge,
    InvalidTimeout,
    LinkClosed,
    MailboxFull,
    MalformedFrame,
    RemoteError,
    UnknownMessageType,
    UnknownMethod,
    WireError,
)
from shoal.runtime.mailbox import DeadLetters
from shoal.runtime.ref import ActorRef
from shoal.runtime.stream import DIRECT_BYTES, FrameStream

if TYPE_CHECKING:
    from shoal.runtime.transport import TransportConfig

logger = logging.getLogger(__name__)

Lookup = Callable[[str], ActorRef]

# Errors a reply may name that the asker re-raises as themselves, not as RemoteError.
_RUNTIME_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (ActorNotFound, AskTimeout, UnknownMethod, MailboxFull, UnknownMessageType)
}
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
        self._outbox: deque[wire.Buffer] = deque()
        self._writing = False
        self._burst = False
        self._inbox: deque[list[Any]] = deque()
        self._wake_delivery = asyncio.Event()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._serving: set[asyncio.Task[None]] = set()
        self._closed = asyncio.get_running_loop().create_future()
        self.error: WireError | None = None
        self._failing = False
        self._stream: FrameStream | None = None
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
    def has_stream(self) -> bool:
        return self._stream is not None

    def attach_stream(self, stream: FrameStream) -> None:
        """From now on every frame of this link travels on `stream`; its failure closes the
        link, and the link's closing closes it. Both ends attach before their first frame."""
        if self.error is not None:
            stream.close()
            return
        self._stream = stream
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

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    # -- sending -------------------------------------------------------------------------

    def _encode(self, envelope: list[Any]) -> wire.EncodedFrame:
        if self.error is not None:
            raise LinkClosed(f"link to {self.peer} is closed: {self.error}")
        return wire.encode(envelope, self._config.max_frame_bytes)

    def _write(self, frame: wire.EncodedFrame) -> None:
        """Send a frame from synchronous code (a reply's done-callback, a credit grant).

        Like `_send`, the first small frame of a loop turn goes to the socket at once, so a
        lone reply costs no task and no extra loop turn; the rest queue for a task that
        writes them, coalesced, on the next turn."""
        if self._stream is not None:
            self._write_stream(frame, self._stream)
            return
        self._outbox.extend(frame.parts)
        if self._writing:
            return
        first = self._outbox[0]
        if self._burst or len(self._outbox) > 1 or len(first) >= self._config.chunk_bytes // 2:
            self._flush_soon()
            return
        self._burst = True
        asyncio.get_running_loop().call_soon(self._end_burst)
        self._outbox.popleft()
        self._write_at_once(first)

    def _write_at_once(self, data: wire.Buffer) -> None:
        """Run the websocket's send up to its first suspension. Uncompressed, aiohttp puts the
        frame into the socket's buffer before it can suspend, and suspends only to wait for
        that buffer to drain; that wait is dropped here (the next flush waits instead)."""
        # aiohttp writes any bytes-like object, though its annotation says bytes.
        sending = self._ws.send_bytes(data)  # type: ignore[arg-type]
        try:
            sending.send(None)
        except StopIteration:
            return
        except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
            self._spawn(
                self.close(LinkClosed(f"writing to {self.peer} failed: {exc}"), tell_peer=False)
            )
            return
        sending.close()

    def _write_stream(self, frame: wire.EncodedFrame, stream: FrameStream) -> None:
        """The first frame of a loop turn, and any big one, is written at once (a big one
        after what queued before it); later small frames of the turn queue and go out
        together, in one writev, when the turn ends."""
        if not self._burst:
            self._burst = True
            asyncio.get_running_loop().call_soon(self._end_burst)
            stream.write(frame.parts)
            return
        self._outbox.extend(frame.parts)
        if frame.nbytes >= DIRECT_BYTES:
            self._flush_stream()

    def _flush_stream(self) -> None:
        stream = self._stream
        if self._outbox and stream is not None and self.error is None:
            parts = list(self._outbox)
            self._outbox.clear()
            try:
                stream.write(parts)
            except LinkClosed:
                pass  # the stream's own callback is closing the link

    async def _send(self, frame: wire.EncodedFrame) -> None:
        """Send a frame with the least latency that still batches.

        The first frame of a loop turn is written at once in the caller's task (no trip
        through the event loop, which is most of a small ask's latency); later frames of the
        same turn queue and go out together on the next turn, coalesced into websocket
        messages of up to `chunk_bytes` (which is what makes pipelined tells cheap)."""
        stream = self._stream
        if stream is not None:
            self._write_stream(frame, stream)
            if stream.writing_paused:
                # Back-pressure: return once the kernel holds it all (arrays are free again).
                await stream.drain()
            return
        self._outbox.extend(frame.parts)
        if self._writing:
            return
        if self._burst:
            self._flush_soon()
            return
        self._burst = True
        asyncio.get_running_loop().call_soon(self._end_burst)
        self._writing = True
        await self._flush()

    def _end_burst(self) -> None:
        self._burst = False
        if self._stream is not None:
            self._flush_stream()

    def _flush_soon(self) -> None:
        self._writing = True
        task = asyncio.create_task(self._flush())
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)

    async def tell(
        self, target: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        frame = self._encode([TELL, target, method, list(args), kwargs])
        await self._send_credit.take(frame.nbytes)
        await self._send(frame)

    def tell_nowait(
        self, target: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        frame = self._encode([TELL, target, method, list(args), kwargs])
        self._send_credit.take_nowait(frame.nbytes)
        self._write(frame)

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
        timer = loop.call_later(timeout, _expire, reply, f"{target}.{method}", self.peer, timeout)
        try:
            if not self._send_credit.available:
                await _first(self._send_credit.take(frame.nbytes), reply)
            else:
                self._send_credit.take_nowait(frame.nbytes)
            self._pending[request] = reply
            await self._send(frame)
            return await reply
        finally:
            timer.cancel()
            self._pending.pop(request, None)

    async def _flush(self) -> None:
        """Write the outbox; the caller has set `_writing`, so only one task writes at a time.
        Small parts are coalesced into messages of about `chunk_bytes` (at most 1.5x), together
        with a buffer that fits; a bigger buffer (an array's own memory) goes out in slices,
        never copied here."""
        chunk = self._config.chunk_bytes
        outbox = self._outbox
        # aiohttp writes any bytes-like object, though its annotation says bytes.
        send: Callable[[wire.Buffer], Awaitable[None]] = self._ws.send_bytes  # type: ignore[assignment]
        try:
            while outbox and self.error is None:
                first = outbox.popleft()
                if len(first) >= chunk // 2:
                    view = memoryview(first)
                    if len(view) > chunk:
                        outbox.appendleft(view[chunk:])
                    await send(view[:chunk])
                    continue
                if not outbox:  # a lone small frame (a single ask or reply): no copy
                    await send(first)
                    continue
                batch = bytearray(first)
                while outbox and len(batch) < chunk:
                    size = len(outbox[0])
                    if size >= chunk // 2 and len(batch) + size > chunk + chunk // 2:
                        break
                    # A header and the buffer behind it in one message: a memcpy costs less
                    # than a websocket message more on both ends.
                    batch += outbox.popleft()
                await send(batch)
        except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
            await self.close(LinkClosed(f"writing to {self.peer} failed: {exc}"), tell_peer=False)
        finally:
            self._writing = False
            if outbox and self.error is None:
                # The writing caller was cancelled mid-way; what is queued (perhaps the rest of
                # a half-written frame) must still go out, or the stream would be cut.
                self._flush_soon()

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
                    if self._stream is not None and envelope[0] != ERROR:
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
                reply.set_exception(_failure(runtime, type_name, message))
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
        slot = _Served(self, request, nbytes)
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
        slot = _Served(self, request, nbytes)
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

    def _answer(self, request: int, nbytes: int, result: Any) -> None:
        """Give the credit back and write the reply (a `fail` if the result cannot cross)."""
        self._consumed(nbytes)
        if self.error is not None:
            return
        try:
            frame = wire.encode([REPLY, request, result], self._config.max_frame_bytes)
        except WireError as exc:
            frame = _fail_frame(request, exc)
        self._write(frame)

    def _answer_failed(self, request: int, nbytes: int, error: BaseException) -> None:
        self._consumed(nbytes)
        if self.error is None:
            self._write(_fail_frame(request, error))

    def _consumed(self, nbytes: int) -> None:
        grant = self._receive_credit.consumed(nbytes)
        if grant is not None and self.error is None:
            self._write(wire.encode([CREDIT, *grant]))

    # -- closing -------------------------------------------------------------------------

    async def close(self, error: WireError | None = None, *, tell_peer: bool = False) -> None:
        """Close once: fail pending asks and waiting senders, stop the tasks, say why to the peer."""
        if self.error is not None:
            return
        self.error = error or LinkClosed(f"link to {self.peer} was closed by this process")
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
        if self._stream is not None:
            self._stream.close()
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


def _expire(reply: asyncio.Future[Any], call: str, peer: str, timeout: float) -> None:
    if not reply.done():
        reply.set_exception(
            AskTimeout(
                f"{call} on {peer} did not answer within {timeout}s; it may still run. "
                "Raise the timeout with ref.ask(timeout=...)"
            )
        )


async def _first(wait: Awaitable[None], reply: asyncio.Future[Any]) -> None:
    """Wait for credit unless the ask's timer fires first (then raise its AskTimeout)."""
    waiting = asyncio.ensure_future(wait)
    try:
        await asyncio.wait([waiting, reply], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not waiting.done():
            waiting.cancel()
    if reply.done():
        reply.result()
    waiting.result()


class _Served:
    """The reply slot of one ask served to a local actor (a `Reply`). The actor's consumer
    settles it directly, so the answer is written in the same loop turn as the handler
    returns, one turn sooner than a future's done-callbacks would run. It times itself out
    like a local ask, so a stuck handler still gives its credit back."""

    __slots__ = ("_done", "_link", "_nbytes", "_request", "_timer")

    def __init__(self, link: Link, request: int, nbytes: int) -> None:
        self._link = link
        self._request = request
        self._nbytes = nbytes
        self._done = False
        self._timer: asyncio.TimerHandle | None = None

    def start(self, call: str, timeout: float, delay: float | None = None) -> None:
        """Arm the ask's timeout: `delay` seconds from now, `timeout` unless part of it passed."""
        if not self._done:
            loop = asyncio.get_running_loop()
            wait = timeout if delay is None else delay
            self._timer = loop.call_later(wait, self._expire, call, timeout)

    def done(self) -> bool:
        return self._done

    def set_result(self, result: Any, /) -> None:
        if self._settle():
            self._guarded(self._link._answer, result)

    def set_exception(self, exception: BaseException, /) -> None:
        if self._settle():
            self._guarded(self._link._answer_failed, exception)

    def _guarded(self, answer: Callable[[int, int, Any], None], outcome: Any) -> None:
        """This runs inside the actor's consumer task: a failure to answer is the link's
        problem, never the actor's."""
        try:
            answer(self._request, self._nbytes, outcome)
        except Exception:
            logger.exception("answering ask %d from %s failed", self._request, self._link.peer)

    def _settle(self) -> bool:
        if self._done:
            return False
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
        return True

    def _expire(self, call: str, timeout: float) -> None:
        self.set_exception(
            AskTimeout(
                f"ask {call} got no reply within {timeout}s; the actor is busy or stuck (it "
                "may still handle it); pass a longer ref.ask(timeout=...)"
            )
        )


class _Broken(Exception):
    """The peer reported an error about us, or the socket broke: the link closes without
    answering. Carried out of the read loop."""

    def __init__(self, error: WireError) -> None:
        super().__init__(str(error))
        self.error = error


_CLOSE_TIMEOUT = 2.0


def _fail_frame(request: int, error: BaseException) -> wire.EncodedFrame:
    """A served ask's error as a `fail` frame: runtime errors keep their type at the asker,
    anything else arrives as `RemoteError` naming the type."""
    if isinstance(error, RemoteError):
        fields = [False, error.type_name, error.message]
    else:
        name = type(error).__name__
        runtime = isinstance(error, ActorError | WireError) and name in _RUNTIME_ERRORS
        fields = [runtime, name, str(error)]
    return wire.encode([FAIL, request, *fields])


def _failure(runtime: bool, type_name: str, message: str) -> Exception:
    cls = _RUNTIME_ERRORS.get(type_name) if runtime else None
    return cls(message) if cls is not None else RemoteError(type_name, message)
