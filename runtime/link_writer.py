"""`FrameWriter`: the sending half of a `Link`: the lowest latency that still batches.

The first frame of a loop turn goes to the socket at once in the caller's task (no trip through
the event loop, which is most of a small ask's latency); later frames of the same turn queue and
go out together: on the websocket coalesced into messages of up to `chunk_bytes`, on a frame
stream in one writev when the turn ends. Apart from link.py because this is the part tuned for
speed (docs/runtime.md, docs/benchmarks.md), and its state (outbox, burst, writing) is touched
by nothing else; the link hands it frames and tells it when to stop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import aiohttp

from shoal.runtime import auth, wire
from shoal.runtime.errors import LinkClosed
from shoal.runtime.stream import DIRECT_BYTES, FrameStream


class FrameWriter:
    """Writes a link's frames on its websocket, or on its stream once one is attached. Used from
    tasks on one loop. `spawn` runs a coroutine as one of the link's tasks (cancelled when it
    closes); `broken` closes the link after a failed write."""

    def __init__(
        self,
        ws: auth.Socket,
        chunk_bytes: int,
        peer: str,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        broken: Callable[[LinkClosed], Coroutine[Any, Any, None]],
    ) -> None:
        self._ws = ws
        self._chunk_bytes = chunk_bytes
        self._peer = peer
        self._spawn = spawn
        self._broken = broken
        self.stream: FrameStream | None = None
        """Once set, every frame travels on it (set before the link's first frame)."""
        self.stopped = False
        """Set when the link closes: nothing more is written."""
        self._outbox: deque[wire.Buffer] = deque()
        self._writing = False
        self._burst = False

    def write(self, frame: wire.EncodedFrame) -> None:
        """Send a frame from synchronous code (a reply's done-callback, a credit grant).

        Like `_send`, the first small frame of a loop turn goes to the socket at once, so a
        lone reply costs no task and no extra loop turn; the rest queue for a task that
        writes them, coalesced, on the next turn."""
        if self.stream is not None:
            self._write_stream(frame, self.stream)
            return
        self._outbox.extend(frame.parts)
        if self._writing:
            return
        first = self._outbox[0]
        if self._burst or len(self._outbox) > 1 or len(first) >= self._chunk_bytes // 2:
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
            self._spawn(self._broken(LinkClosed(f"writing to {self._peer} failed: {exc}")))
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
        stream = self.stream
        if self._outbox and stream is not None and not self.stopped:
            parts = list(self._outbox)
            self._outbox.clear()
            try:
                stream.write(parts)
            except LinkClosed:
                pass  # the stream's own callback is closing the link

    async def send(self, frame: wire.EncodedFrame) -> None:
        """Send a frame with the least latency that still batches.

        The first frame of a loop turn is written at once in the caller's task (no trip
        through the event loop, which is most of a small ask's latency); later frames of the
        same turn queue and go out together on the next turn, coalesced into websocket
        messages of up to `chunk_bytes` (which is what makes pipelined tells cheap)."""
        stream = self.stream
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
        if self.stream is not None:
            self._flush_stream()

    def _flush_soon(self) -> None:
        self._writing = True
        self._spawn(self._flush())

    async def _flush(self) -> None:
        """Write the outbox; the caller has set `_writing`, so only one task writes at a time.
        Small parts are coalesced into messages of about `chunk_bytes` (at most 1.5x), together
        with a buffer that fits; a bigger buffer (an array's own memory) goes out in slices,
        never copied here."""
        chunk = self._chunk_bytes
        outbox = self._outbox
        # aiohttp writes any bytes-like object, though its annotation says bytes.
        send: Callable[[wire.Buffer], Awaitable[None]] = self._ws.send_bytes  # type: ignore[assignment]
        try:
            while outbox and not self.stopped:
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
            await self._broken(LinkClosed(f"writing to {self._peer} failed: {exc}"))
        finally:
            self._writing = False
            if outbox and not self.stopped:
                # The writing caller was cancelled mid-way; what is queued (perhaps the rest of
                # a half-written frame) must still go out, or the stream would be cut.
                self._flush_soon()
