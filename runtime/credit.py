"""Credit-based flow control for one link, in frames and bytes.

The receiver grants a window; the sender spends one frame and the frame's size per request
and waits when either runs out; the receiver gives credit back as its actors take the
messages in. A slow consumer therefore stalls its producers instead of filling memory: at
most one window (plus the one frame that overdrew it) is ever in flight or queued.
"""

from __future__ import annotations

import asyncio

from shoal.runtime.errors import LinkClosed, MailboxFull, MalformedFrame


class SendCredit:
    """The sender's side. Used from tasks on the link's loop."""

    def __init__(self, frames: int, nbytes: int) -> None:
        self.frames = frames
        self.nbytes = nbytes
        self._changed = asyncio.Event()
        self._closed: LinkClosed | None = None

    def __repr__(self) -> str:
        return f"<SendCredit frames={self.frames} bytes={self.nbytes}>"

    @property
    def available(self) -> bool:
        """A frame may go out while both counts are positive; its size may overdraw bytes, so a
        frame larger than the whole window still gets through, alone."""
        return self.frames > 0 and self.nbytes > 0

    def take_nowait(self, nbytes: int) -> None:
        if self._closed is not None:
            raise LinkClosed(str(self._closed))
        if not self.available:
            raise MailboxFull(
                "the link's credit window is spent (the remote actors are behind); "
                "use await tell to wait, or raise credit_frames/credit_bytes"
            )
        self.frames -= 1
        self.nbytes -= nbytes

    async def take(self, nbytes: int) -> None:
        while self._closed is None and not self.available:
            self._changed.clear()
            await self._changed.wait()
        self.take_nowait(nbytes)

    def grant(self, frames: int, nbytes: int) -> None:
        self.frames += frames
        self.nbytes += nbytes
        if self.available:
            self._changed.set()

    def close(self, error: LinkClosed) -> None:
        """Fail every waiting and later sender with `error`."""
        self._closed = error
        self._changed.set()


class ReceiveCredit:
    """The receiver's side: counts what was consumed and says when to hand it back, and
    refuses a peer that sends beyond the window it was granted.

    Credit goes back in batches of a quarter window, which keeps grant frames rare; since a
    stalled sender means a whole window is outstanding, a batch is always due once it drains."""

    def __init__(self, frames: int, nbytes: int) -> None:
        self._window = (frames, nbytes)
        self._frame_batch = max(1, frames // 4)
        self._byte_batch = max(1, nbytes // 4)
        self._frames = 0
        self._nbytes = 0
        self._held_frames = 0
        self._held_bytes = 0

    def received(self, nbytes: int) -> None:
        """Count one arriving request; raise `MalformedFrame` if the peer had no credit for it.
        The peer learns of grants later than they are made here, so a conforming peer never
        trips this."""
        frames, window_bytes = self._window
        if self._held_frames >= frames or self._held_bytes >= window_bytes:
            raise MalformedFrame(
                f"the peer sent beyond the credit window it was granted ({frames} frames, "
                f"{window_bytes} bytes); it is not a conforming shoal peer"
            )
        self._held_frames += 1
        self._held_bytes += nbytes

    def consumed(self, nbytes: int) -> tuple[int, int] | None:
        """Record one consumed frame; return (frames, bytes) to grant now, or None."""
        self._frames += 1
        self._nbytes += nbytes
        if self._frames < self._frame_batch and self._nbytes < self._byte_batch:
            return None
        grant = (self._frames, self._nbytes)
        self._held_frames -= self._frames
        self._held_bytes -= self._nbytes
        self._frames = self._nbytes = 0
        return grant
