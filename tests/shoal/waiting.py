"""Polling for a condition in tests that drive real processes: the shared `eventually`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(check: Callable[[], T | None], what: str, timeout: float = 40.0) -> T:
    """`check()`'s first truthy value, polled every 0.1 s; fails naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)
