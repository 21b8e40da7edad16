"""The ask half of a `Link`: timing out an ask, the reply slot of an ask served here, and an
ask's failure as a `fail` frame and back.

An ask crosses as `ask` → `reply` | `fail`; these pieces are what turns a local actor's answer
into those frames and a remote `fail` into the exception the asker raises. Apart from link.py,
which moves frames, because they decide what a failure looks like to the other side.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from shoal.runtime import wire
from shoal.runtime.envelope import FAIL
from shoal.runtime.errors import (
    ActorError,
    ActorNotFound,
    AskTimeout,
    MailboxFull,
    RemoteError,
    UnknownMessageType,
    UnknownMethod,
    WireError,
)

logger = logging.getLogger("shoal.runtime.link")

# Errors a reply may name that the asker re-raises as themselves, not as RemoteError.
RUNTIME_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (ActorNotFound, AskTimeout, UnknownMethod, MailboxFull, UnknownMessageType)
}


class Answering(Protocol):
    """What a `Served` slot answers through: the link the ask came on."""

    peer: str

    def answer(self, request: int, nbytes: int, result: Any) -> None: ...

    def answer_failed(self, request: int, nbytes: int, error: BaseException) -> None: ...


def expire(reply: asyncio.Future[Any], call: str, peer: str, timeout: float) -> None:
    """An ask's timer: fail the reply with AskTimeout unless it came."""
    if not reply.done():
        reply.set_exception(
            AskTimeout(
                f"{call} on {peer} did not answer within {timeout}s; it may still run. "
                "Raise the timeout with ref.ask(timeout=...)"
            )
        )


async def credit_or_timeout(wait: Awaitable[None], reply: asyncio.Future[Any]) -> None:
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


class Served:
    """The reply slot of one ask served to a local actor (a `Reply`). The actor's consumer
    settles it directly, so the answer is written in the same loop turn as the handler
    returns, one turn sooner than a future's done-callbacks would run. It times itself out
    like a local ask, so a stuck handler still gives its credit back."""

    __slots__ = ("_done", "_link", "_nbytes", "_request", "_timer")

    def __init__(self, link: Answering, request: int, nbytes: int) -> None:
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
            self._guarded(self._link.answer, result)

    def set_exception(self, exception: BaseException, /) -> None:
        if self._settle():
            self._guarded(self._link.answer_failed, exception)

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


def fail_frame(request: int, error: BaseException) -> wire.EncodedFrame:
    """A served ask's error as a `fail` frame: runtime errors keep their type at the asker,
    anything else arrives as `RemoteError` naming the type."""
    if isinstance(error, RemoteError):
        fields = [False, error.type_name, error.message]
    else:
        name = type(error).__name__
        runtime = isinstance(error, ActorError | WireError) and name in RUNTIME_ERRORS
        fields = [runtime, name, str(error)]
    return wire.encode([FAIL, request, *fields])


def failure(runtime: bool, type_name: str, message: str) -> Exception:
    """A `fail` frame as the exception the asker raises."""
    cls = RUNTIME_ERRORS.get(type_name) if runtime else None
    return cls(message) if cls is not None else RemoteError(type_name, message)
