"""The bulk stream: a raw TCP connection beside a link's websocket that carries its big frames.

aiohttp's websocket copies every byte of a message several times (assembly into `bytes`,
the client's masking, our reassembly); a plain TCP stream read with `BufferedProtocol`
receives straight into the frame's own buffer and writes the array's own memory, so the
kernel's copy is the only one. The link decides what goes here and keeps the order (see
link.py); this module moves whole wire frames and checks each one's size from its prefix
before allocating, so a hostile length costs an error, never memory.
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

# Completed frames whose marker has not arrived yet; beyond this the stream stops reading, so
# a peer that sends bulk frames without markers is held back by TCP instead of filling memory.
MAX_UNCLAIMED = 4


class BulkStream(asyncio.BufferedProtocol):
    """One end of a bulk connection, used from the loop it was created on.

    Receiving fills one preallocated buffer per frame; `next_frame` hands them out in order.
    Sending writes a frame's parts (the arrays' own memory among them) without joining
    them; `drain` waits until the kernel has taken everything, after which the caller may
    reuse its arrays. A broken stream (bad prefix, oversize, the peer gone) reports once to
    `on_broken`, which the link uses to close itself."""

    def __init__(
        self, limit: int, on_connected: Callable[[BulkStream], None] | None = None
    ) -> None:
        self.limit = limit
        """The largest frame accepted now: small during the bulk handshake, then the link's."""
        self.on_broken: Callable[[WireError], None] | None = None
        self._on_connected = on_connected
        self.error: WireError | None = None
        self.received = 0
        self._transport: asyncio.Transport | None = None
        self._head = bytearray(wire.PREFIX_SIZE)
        self._frame: np.ndarray | None = None
        self._filled = 0
        self._frames: deque[np.ndarray] = deque()
        self._arrived: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._paused_reading = False

    def __repr__(self) -> str:
        state = f"broken ({self.error})" if self.error else "open"
        return f"<BulkStream {state} unclaimed={len(self._frames)}>"

    # -- asyncio callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = transport = cast(asyncio.Transport, transport)
        # No user-space buffering beyond one write: `drain` returns only once the kernel holds
        # every byte, so a sender may reuse a tensor as soon as its `await tell` returns.
        transport.set_write_buffer_limits(high=0)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # Without it the tail segment of a frame may wait for the peer's delayed ack.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._on_connected is not None:
            self._on_connected(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.error is not None:  # broken: what still arrives is read and dropped
            return memoryview(self._head)
        frame = self._frame
        if frame is None:
            return memoryview(self._head)[self._filled :]
        return frame.data[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.error is not None:
            return
        self.received += nbytes
        self._filled += nbytes
        frame = self._frame
        if frame is None:
            if self._filled < wire.PREFIX_SIZE:
                return
            try:
                total = wire.frame_length(self._head, self.limit)
            except WireError as exc:
                self._broken(exc)
                return
            # np.empty, not bytearray: the kernel overwrites every byte, so zeroing is waste.
            frame = self._frame = np.empty(total, dtype=np.uint8)
            frame[: wire.PREFIX_SIZE] = np.frombuffer(self._head, dtype=np.uint8)
            if total > wire.PREFIX_SIZE:
                return
        if self._filled < len(frame):
            return
        self._frame = None
        self._filled = 0
        self._frames.append(frame)
        if len(self._frames) >= MAX_UNCLAIMED and self._transport is not None:
            self._paused_reading = True
            self._transport.pause_reading()
        self._wake_reader()

    def connection_lost(self, exc: Exception | None) -> None:
        cut = " in the middle of a frame" if self._frame is not None or self._filled else ""
        reason = f": {exc}" if exc is not None else ""
        self._broken(LinkClosed(f"the bulk stream was closed{cut}{reason}"))
        writable = self._writable
        if writable is not None and not writable.done():
            writable.set_result(None)

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        writable = self._writable
        if writable is not None and not writable.done():
            writable.set_result(None)

    # -- the link's side -----------------------------------------------------------------

    def write(self, parts: Iterable[wire.Buffer]) -> None:
        """Queue one frame's parts, in order, without copying them together."""
        transport = self._transport
        if transport is None or transport.is_closing():
            raise LinkClosed(f"cannot write to the bulk stream: {self.error or 'it is closed'}")
        transport.writelines(parts)

    async def drain(self) -> None:
        """Wait until the kernel has taken everything written so far."""
        writable = self._writable
        if writable is not None and not writable.done():
            await asyncio.shield(writable)
        if self.error is not None:
            raise self.error

    async def next_frame(self, stall: float) -> memoryview:
        """The next whole frame; raises the stream's error once it broke, or `LinkClosed` when
        no byte arrived for `stall` seconds while waiting (a peer announcing a frame it never
        sends cannot hang the link)."""
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
                        f"the peer sent nothing on the bulk stream for {stall}s while a frame "
                        "was due"
                    ) from None
            finally:
                self._arrived = None
        frame = self._frames.popleft().data
        if self._paused_reading and self._transport is not None:
            self._paused_reading = False
            self._transport.resume_reading()
        return frame

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
            self.error = LinkClosed("the bulk stream was closed by this process")
        if transport.can_write_eof():
            transport.write_eof()
        transport.resume_reading()
        asyncio.get_running_loop().call_later(grace, transport.close)

    # -- internals -----------------------------------------------------------------------

    def _wake_reader(self) -> None:
        arrived = self._arrived
        if arrived is not None and not arrived.done():
            arrived.set_result(None)

    def _broken(self, error: WireError) -> None:
        """Record the first failure, stop reading, wake the reader and tell the owner once."""
        if self.error is not None:
            return
        # Not closed here: before it joins a link, its handshake still answers why.
        self.error = error
        self._frame = None
        self._filled = 0
        self._wake_reader()
        if self.on_broken is not None:
            self.on_broken(error)
