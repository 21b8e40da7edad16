"""`ActorRef`: the only handle to an actor, the same whether the actor is local or remote.

Calls are method-call style: `await ref.ask.push(batch)`, `await ref.tell.push(batch)`,
`ref.tell_nowait.push(batch)`, `await ref.ask(timeout=2.0).push(batch)`. Subclasses supply the
three primitives (`_tell`, `_tell_nowait`, `_ask`); a local ref puts into a mailbox, a remote
ref writes a frame on a link. Refs are used from tasks on the owning system's event loop.
"""

from __future__ import annotations

import asyncio
import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from shoal.runtime.errors import InvalidTimeout

DEFAULT_ASK_TIMEOUT = 10.0


class Reply(Protocol):
    """Where an ask's outcome goes: an asyncio future for a local ask, or the transport's
    reply slot. The actor's consumer settles it once; later settlements are ignored by
    checking `done()` first."""

    def done(self) -> bool: ...

    def set_result(self, result: Any, /) -> None: ...

    def set_exception(self, exception: BaseException, /) -> None: ...


_running: set[asyncio.Future[Any]] = set()


def _settle(reply: Reply, task: asyncio.Future[Any]) -> None:
    _running.discard(task)
    if reply.done():
        return
    if task.cancelled():
        reply.set_exception(asyncio.CancelledError())
    elif (error := task.exception()) is not None:
        reply.set_exception(error)
    else:
        reply.set_result(task.result())


class ActorRef(ABC):
    """A handle to one actor, compared and hashed by its path."""

    def __init__(self, path: str) -> None:
        self._path = path

    @property
    def path(self) -> str:
        """Where the actor lives: a bare name, or `shoal://host:port/name`."""
        return self._path

    @abstractmethod
    async def _tell(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Deliver without a reply, waiting while the mailbox or the link has no room."""

    @abstractmethod
    def _tell_nowait(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Deliver without a reply or raise `MailboxFull` at once."""

    @abstractmethod
    async def _ask(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float
    ) -> Any:
        """Deliver and wait for the handler's result, raising `AskTimeout` after `timeout` s."""

    def _ask_nowait(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
        reply: Reply,
    ) -> None:
        """Start an ask now whose outcome goes to `reply`; raise `MailboxFull` if it cannot be
        queued at once. The transport serves every remote ask through this, from its read
        loop, with a reply slot that writes the answer the moment the handler returns and
        that times itself out. A local ref queues the message on the spot, with no task and
        no future; this default, for other refs, runs `_ask` in a task."""
        task = asyncio.ensure_future(self._ask(method, args, kwargs, timeout))
        _running.add(task)
        task.add_done_callback(functools.partial(_settle, reply))

    async def _ask_queued(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
        reply: Reply,
    ) -> None:
        """`_ask_nowait` that waits for mailbox room (at most `timeout`, then `AskTimeout`)
        instead of raising; returns once the message is queued."""
        self._ask_nowait(method, args, kwargs, timeout, reply)

    # Proxies are built once per ref and remember each method's sender, so the hot path
    # `ref.tell_nowait.push(x)` is two dictionary hits, not two allocations and a closure.
    @functools.cached_property
    def tell(self) -> _TellProxy:
        return _TellProxy(self)

    @functools.cached_property
    def tell_nowait(self) -> _TellNowaitProxy:
        return _TellNowaitProxy(self)

    @functools.cached_property
    def ask(self) -> _AskProxy:
        return _AskProxy(self, DEFAULT_ASK_TIMEOUT)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorRef) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.path}>"


def _remember(proxy: object, method: str, sender: Callable[..., Any]) -> None:
    """Cache a public method's sender on the proxy so `__getattr__` runs once per method."""
    if not method.startswith("_"):
        proxy.__dict__[method] = sender


class _TellProxy:
    def __init__(self, ref: ActorRef) -> None:
        self._ref = ref

    def __getattr__(self, method: str) -> Callable[..., Awaitable[None]]:
        ref = self._ref

        def send(*args: Any, **kwargs: Any) -> Awaitable[None]:
            return ref._tell(method, args, kwargs)

        _remember(self, method, send)
        return send


class _TellNowaitProxy:
    def __init__(self, ref: ActorRef) -> None:
        self._ref = ref

    def __getattr__(self, method: str) -> Callable[..., None]:
        ref = self._ref

        def send(*args: Any, **kwargs: Any) -> None:
            ref._tell_nowait(method, args, kwargs)

        _remember(self, method, send)
        return send


class _AskProxy:
    def __init__(self, ref: ActorRef, timeout: float) -> None:
        self._ref = ref
        self._timeout = timeout

    def __call__(self, *, timeout: float) -> _AskProxy:
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout < math.inf
        ):
            raise InvalidTimeout(
                f"ask timeout={timeout!r} is invalid: use a positive, finite number of seconds"
            )
        return _AskProxy(self._ref, timeout)

    def __getattr__(self, method: str) -> Callable[..., Awaitable[Any]]:
        ref, timeout = self._ref, self._timeout

        def call(*args: Any, **kwargs: Any) -> Awaitable[Any]:
            return ref._ask(method, args, kwargs, timeout)

        _remember(self, method, call)
        return call
