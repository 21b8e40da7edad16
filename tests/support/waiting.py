"""Polling for a condition in tests that drive real processes: the one `eventually`, in a
blocking and an asyncio flavour with the same signature.

A timeout here is a failure detector, never a performance claim: it is generous enough for a
loaded 2-core machine, and a test that needs it to be tighter is a test to fix."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.1
DEFAULT_TIMEOUT_S = 40.0


def eventually(
    check: Callable[[], T | None],
    what: str,
    timeout: float = DEFAULT_TIMEOUT_S,
    detail: Callable[[], str] | None = None,
) -> T:
    """`check()`'s first truthy value, polled every POLL_S; fails naming `what` after `timeout`,
    followed by `detail()` (a log tail, the last answer) when given."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, _failure(what, timeout, detail)
        time.sleep(POLL_S)


async def eventually_async(
    check: Callable[[], Awaitable[T | None]] | Callable[[], T | None],
    what: str,
    timeout: float = DEFAULT_TIMEOUT_S,
    detail: Callable[[], str] | None = None,
) -> T:
    """`check()`'s first truthy value (awaited if `check` is a coroutine function, or a plain
    look at state on this loop), polled every POLL_S without blocking the loop; fails as
    `eventually` does."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, _failure(what, timeout, detail)
        await asyncio.sleep(POLL_S)


def _failure(what: str, timeout: float, detail: Callable[[], str] | None) -> str:
    message = f"not within {timeout} s: {what}"
    return message if detail is None else f"{message}\n{detail()}"
