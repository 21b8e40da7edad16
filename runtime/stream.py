"""The frame stream: a raw TCP connection beside a link's websocket that carries its frames.

aiohttp's websocket copies every byte of a message several times (assembly into `bytes`,
the client's masking, our reassembly) and wakes a reader task per message; a plain TCP
stream read with `BufferedProtocol` hands each frame to the link from the read callback
itself, and receives big frames straight into their own buffer, so the kernel's copy is the
only one. Small frames are cut out of one reusable read buffer; a frame of `DIRECT_BYTES` or
more gets a buffer of its own, sized from its prefix after the size limit is checked, so a
hostile length costs an error, never memory. Sending writes a frame's parts (an array's own
memory among them) without joining them.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Callable, Iterable
from typing import cast

import numpy as np

from shoal.runtime import wire
from shoal.runtime.errors import LinkClosed, WireError

# A frame at least this big is received into a buffer of its own (no copy after the kernel's).
DIRECT_BYTES = 64 * 1024
# The reusable read buffer for smaller frames; a read fills as much of it as has arrived.
READ_BYTES = 256 * 1024
# Frames held for `next_frame` (the handshake) before the stream stops reading.
MAX_UNCLAIMED = 4

FrameHandler = Callable[[memoryview], None]


class FrameStream(asyncio.BufferedProtocol):
    """One end of a frame stream, used from the loop it was created on.

    Until a link takes it (`on_frame`), whole frames queue for `next_frame` (the stream's
    handshake); after, each frame goes to `on_frame` from the read callback, in order. A
    broken stream (bad prefix, oversize, the peer gone) reports once to `on_broken`."""

    def __init__(
        self, limit: int, on_connected: Callable[[FrameStream], None] | None = None
    ) -> None:
        self._limit = limit
        self.on_frame: FrameHandler | None = None
        self.on_broken: Callable[[WireError], None] | None = None
        self.error: WireError | None = None
        self.received = 0
        self._on_connected = on_connected
        self._transport: asyncio.Transport | None = None
        # Until the handshake raises the limit, a stranger's connection costs a few KiB.
        self._buffer = bytearray(_read_bytes(limit))
        self._view = memoryview(self._buffer)
        self._start = 0  # unparsed bytes of the read buffer are [_start, _end)
        self._end = 0
        self._frame: np.ndarray | None = None  # a big frame being received in place
        self._filled = 0
        self._frames: deque[memoryview] = deque()
        self._arrived: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._paused_reading = False

    def __repr__(self) -> str:
        state = f"broken ({self.error})" if self.error else "open"
        return f"<FrameStream {state} received={self.received}>"

    @property
    def limit(self) -> int:
        """The largest frame accepted now: small during the handshake, then the link's."""
        return self._limit

    @limit.setter
    def limit(self, limit: int) -> None:
        self._limit = limit
        size = _read_bytes(limit)
        if size > len(self._buffer):  # keep the unparsed bytes, at the front of the new one
            rest = self._view[self._start : self._end]
            buffer = bytearray(size)
            buffer[: len(rest)] = rest
            self._buffer, self._view = buffer, memoryview(buffer)
            self._start, self._end = 0, len(rest)

    # -- asyncio callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = transport = cast(asyncio.Transport, transport)
        # No user-space buffering beyond one write: `drain` returns only once the kernel holds
        # every byte, so a sender may reuse a tensor as soon as its `await tell` returns.
        # Over TLS the plaintext is encrypted into the SSL layer's own buffers, but its flow
        # control pauses at `size >= high`: with high=0 it would pause on an empty buffer and
        # never resume. high=1 pauses while any byte is still pending, as high=0 does in TCP.
        tls = transport.get_extra_info("ssl_object") is not None
        transport.set_write_buffer_limits(high=1 if tls else 0, low=0)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # Without it a lone small frame may wait for the peer's delayed ack.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._on_connected is not None:
            self._on_connected(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.error is not None:  # broken: what still arrives is read and dropped
            return self._view
        frame = self._frame
        if frame is not None:
            return frame.data[self._filled :]
        if len(self._buffer) - self._end < _room(len(self._buffer)) and self._start:
            self._compact()  # a partial small frame near the end: move it to the front
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.error is not None:
            return
        self.received += nbytes
        frame = self._frame
        if frame is not None:
            self._filled += nbytes
            if self._filled == len(frame):
                self._frame = None
                self._deliver(frame.data)
            return
        self._end += nbytes
        try:
            self._parse()
        except WireError as exc:
            self._broken(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        cut = " in the middle of a frame" if self._frame is not None or self._end else ""
        reason = f": {exc}" if exc is not None else ""
        self._broken(LinkClosed(f"the frame stream was closed{cut}{reason}"))
        self.resume_writing()

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        writable = self._writable
        if writable is not None and not writable.done():
            writable.set_result(None)

    # -- the owner's side ----------------------------------------------------------------

    @property
    def writing_paused(self) -> bool:
        writable = self._writable
        return writable is not None and not writable.done()

    def write(self, parts: Iterable[wire.Buffer]) -> None:
        """Queue parts, in order, without copying them together (one writev)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            raise LinkClosed(f"cannot write to the frame stream: {self.error or 'it is closed'}")
        transport.writelines(parts)

    async def drain(self) -> None:
        """Wait until the kernel has taken everything written so far."""
        writable = self._writable
        if writable is not None and not writable.done():
            await asyncio.shield(writable)
        if self.error is not None:
            raise self.error

    async def next_frame(self, stall: float) -> memoryview:
        """The next whole frame (before a link takes the stream); raises the stream's error
        once it broke, or `LinkClosed` when no byte arrived for `stall` seconds."""
        while not self._frames:
            if self.error is not None:
                raise self.error
            seen = self.received
            arrived = self._arrived = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(asyncio.shield(arrived), stall)
            except TimeoutError:
                if self.received == seen:
                    raise LinkClosed(
                        f"the peer sent nothing on the frame stream for {stall}s"
                    ) from None
            finally:
                self._arrived = None
        frame = self._frames.popleft()
        if self._paused_reading and self._transport is not None:
            self._paused_reading = False
            self._transport.resume_reading()
        return frame

    def take(self, on_frame: FrameHandler, on_broken: Callable[[WireError], None]) -> None:
        """Hand the stream to a link: frames already queued go first, then each as it comes."""
        self.on_frame = on_frame
        self.on_broken = on_broken
        while self._frames and self.on_frame is not None:
            on_frame(self._frames.popleft())
        if self._paused_reading and self._transport is not None:
            self._paused_reading = False
            self._transport.resume_reading()
        if self.error is not None:
            on_broken(self.error)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def close_gently(self, grace: float) -> None:
        """Close after telling the peer something: send EOF and keep reading (and dropping)
        until it hangs up or `grace` passes. Closing at once with its bytes unread would make
        the kernel reset the connection, and the peer might never read our last words."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if self.error is None:
            self.error = LinkClosed("the frame stream was closed by this process")
        if transport.can_write_eof():
            transport.write_eof()
        transport.resume_reading()
        asyncio.get_running_loop().call_later(grace, transport.close)

    # -- internals -----------------------------------------------------------------------

    def _parse(self) -> None:
        """Cut the whole frames out of the read buffer; start a big one's own buffer."""
        view = self._view
        start, end = self._start, self._end
        while end - start >= wire.PREFIX_SIZE and self.error is None:
            total = wire.frame_length(view[start : start + wire.PREFIX_SIZE], self.limit)
            if end - start >= total:
                # Its own bytearray: decoded arrays may share it, and the read buffer is reused.
                frame = bytearray(view[start : start + total])
                start += total
                self._start = start
                self._deliver(memoryview(frame))
                continue
            if total >= DIRECT_BYTES:
                # np.empty, not bytearray: the kernel overwrites every byte, so zeroing is waste.
                big = self._frame = np.empty(total, dtype=np.uint8)
                self._filled = end - start
                big.data[: self._filled] = view[start:end]
                start = end
            break
        if start == end:
            start = end = 0
        self._start, self._end = start, end

    def _compact(self) -> None:
        rest = self._end - self._start
        self._view[:rest] = self._view[self._start : self._end]
        self._start, self._end = 0, rest

    def _deliver(self, frame: memoryview) -> None:
        on_frame = self.on_frame
        if on_frame is not None:
            on_frame(frame)
            return
        self._frames.append(frame)
        if len(self._frames) >= MAX_UNCLAIMED and self._transport is not None:
            self._paused_reading = True
            self._transport.pause_reading()
        arrived = self._arrived
        if arrived is not None and not arrived.done():
            arrived.set_result(None)

    def _broken(self, error: WireError) -> None:
        """Record the first failure, wake the handshake and tell the owner once. Not closed
        here: before a link takes it, its handshake still answers why."""
        if self.error is not None:
            return
        self.error = error
        self._frame = None
        self._start = self._end = 0
        arrived = self._arrived
        if arrived is not None and not arrived.done():
            arrived.set_result(None)
        if self.on_broken is not None:
            self.on_broken(error)


def _read_bytes(limit: int) -> int:
    """The read buffer a frame limit needs: twice the largest frame kept in it, so one always
    fits once the buffer is compacted; bigger frames get buffers of their own."""
    return READ_BYTES if limit >= DIRECT_BYTES else 2 * max(limit, wire.PREFIX_SIZE)


def _room(size: int) -> int:
    """The free space below which a read buffer of `size` bytes is compacted first."""
    return min(DIRECT_BYTES, size // 2)
