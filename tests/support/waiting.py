"""Polling for a condition in tests that drive real processes: the one `eventually`, in a
blocking and an asyncio flavour with the same signature.

A timeout here is a failure detector, never a performance claim: it is generous enough for a
loaded 2-core machine, and a test that needs it to be tighter is a test to fix."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.1
DEFAULT_TIMEOUT_S = 40.0


def eventually(check: Callable[[], T | None], what: str, timeout: float = DEFAULT_TIMEOUT_S) -> T:
    """`check()`'s first truthy value, polled every POLL_S; fails naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(POLL_S)


async def eventually_async(
    check: Callable[[], Awaitable[T | None]], what: str, timeout: float = DEFAULT_TIMEOUT_S
) -> T:
    """`await check()`'s first truthy value, polled every POLL_S without blocking the loop;
    fails naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(POLL_S)
