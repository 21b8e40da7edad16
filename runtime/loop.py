"""The event loop every shoal process runs: uvloop when it is importable, plain asyncio otherwise.

One place decides the loop so a daemon, a test and a benchmark all measure the same thing.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None


def uses_uvloop() -> bool:
    """Whether `new_event_loop` hands out uvloop loops (benchmarks report it beside figures)."""
    return _HAS_UVLOOP


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A fresh loop of the process's kind; the caller owns it and must close it."""
    if _HAS_UVLOOP:
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """Run `main` to completion on a new loop, then cancel leftover tasks and close the loop."""
    with asyncio.Runner(debug=debug, loop_factory=new_event_loop) as runner:
        return runner.run(main)
