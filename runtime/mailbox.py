"""A bounded single-consumer mailbox, and the dead-letter office for messages nobody handled.

The mailbox is a hand-rolled deque rather than `asyncio.Queue` because it is the hot path of
every actor: a put that finds room costs one append and at most one wake-up, nothing else.
Senders that find it full wait in FIFO order and have priority over later senders, so a
waiting `tell` is never overtaken by a `tell_nowait` that arrives after it. All methods are
called from tasks on the owning loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from shoal.errors import ConfigError
from shoal.runtime.errors import MailboxFull

T = TypeVar("T")

DEFAULT_DEAD_LETTER_RECORDS = 1000


class MailboxClosed(Exception):
    """The mailbox's actor has stopped; local refs turn this into a dead letter or `ActorNotFound`."""


class Mailbox(Generic[T]):
    """Bounded FIFO with one consumer: `put` waits for room, `put_nowait` raises `MailboxFull`."""

    __slots__ = ("_capacity", "_closed", "_getter", "_items", "_putters", "_reserved")

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(
                f"mailbox_size={capacity!r} is invalid: use a whole number of messages >= 1"
            )
        self._capacity = capacity
        self._items: deque[T] = deque()
        self._getter: asyncio.Future[None] | None = None
        self._putters: deque[asyncio.Future[None]] = deque()
        self._reserved = 0
        self._closed = False

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<Mailbox {len(self._items)}/{self._capacity} putters={len(self._putters)}{state}>"

    def offer(self, item: T) -> bool:
        """Append if there is room now (and no earlier sender is waiting); False if not.

        The senders' fast path: one call, no exception when full."""
        if self._closed:
            raise MailboxClosed
        items = self._items
        if len(items) + self._reserved >= self._capacity or self._putters:
            return False
        items.append(item)
        getter = self._getter
        if getter is not None:
            self._getter = None
            if not getter.done():
                getter.set_result(None)
        return True

    def put_nowait(self, item: T) -> None:
        """Append at once or raise `MailboxFull` (also while earlier senders are waiting)."""
        if not self.offer(item):
            raise self.full_error()

    def full_error(self) -> MailboxFull:
        return MailboxFull(
            f"mailbox is full ({self._capacity} messages); await tell to wait for room, "
            "or raise mailbox_size"
        )

    async def put(self, item: T) -> None:
        """Append, waiting in line while the mailbox is full; raises `MailboxClosed` if it closes.

        A woken sender owns a reserved slot until it runs, so no later sender can take it.
        """
        if self.offer(item):
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._putters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._reserved -= 1
                self._wake_putters()
            else:
                try:
                    self._putters.remove(waiter)
                except ValueError:
                    pass
            raise
        self._reserved -= 1
        if self._closed:
            raise MailboxClosed
        self._items.append(item)
        self._wake_getter()

    def _wake_getter(self) -> None:
        getter = self._getter
        if getter is not None:
            self._getter = None
            if not getter.done():
                getter.set_result(None)

    def _wake_putters(self) -> None:
        """Hand each free slot to the longest-waiting sender, reserving it for them."""
        putters = self._putters
        while putters and len(self._items) + self._reserved < self._capacity:
            waiter = putters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._reserved += 1

    @property
    def consumer_waiting(self) -> bool:
        """Whether the consumer is parked on an empty mailbox: nothing queued, nothing being
        handled (a consumer busy in a handler or yielding has no pending getter)."""
        getter = self._getter
        return getter is not None and not getter.done() and not self._items

    def get_nowait(self) -> T | None:
        """The oldest message, or None when empty; the consumer's fast path."""
        if not self._items:
            return None
        item = self._items.popleft()
        if self._putters:
            self._wake_putters()
        return item

    async def wait_nonempty(self) -> None:
        """Suspend the consumer until a message arrives; raises `MailboxClosed` once closed."""
        while not self._items:
            if self._closed:
                raise MailboxClosed
            getter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._getter = getter
            try:
                await getter
            finally:
                if self._getter is getter:
                    self._getter = None

    def close(self) -> list[T]:
        """Refuse further puts, fail waiting senders with `MailboxClosed`; return what was left."""
        self._closed = True
        while self._putters:
            waiter = self._putters.popleft()
            if not waiter.done():
                waiter.set_exception(MailboxClosed())
        self._wake_getter()
        left = list(self._items)
        self._items.clear()
        return left


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message that reached no handler. Arguments are not kept, so big payloads are freed."""

    recipient: str
    method: str
    reason: str
    at: float


class DeadLetters:
    """Counts every dead letter and keeps the most recent ones for inspection."""

    def __init__(self, keep: int = DEFAULT_DEAD_LETTER_RECORDS) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ConfigError(f"dead_letter_records={keep!r} is invalid: use a whole number >= 0")
        self.total = 0
        self.recent: deque[DeadLetter] = deque(maxlen=keep)

    def record(self, recipient: str, method: str, reason: str) -> None:
        """Called by local refs and by the transport (for frames to unknown actors)."""
        self.total += 1
        if self.recent.maxlen:
            self.recent.append(DeadLetter(recipient, method, reason, time.time()))

    def __iter__(self) -> Iterator[DeadLetter]:
        return iter(self.recent)

    def __repr__(self) -> str:
        return f"<DeadLetters total={self.total} kept={len(self.recent)}>"
