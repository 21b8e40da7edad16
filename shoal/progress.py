"""A dependency-free one-line progress bar for a terminal, redrawn in place on stderr.

On a terminal the line is rewritten with a carriage return; when stderr is a file or a pipe
(CI, `2> log`) it prints a plain line at most every `plain_every_s` seconds instead, so logs
stay readable. `Ticker` redraws one from a thread, for work that reports nothing while it runs.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO


def bar(fraction: float, width: int = 20) -> str:
    """`[#####-----]` for a fraction in [0, 1] (clamped)."""
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def si(value: float) -> str:
    """Short human form of a count: 950, 12.3k, 4.56M."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.0f}"


class ProgressLine:
    """Draws one status line; call `update(text, fraction)` often and `close()` at the end."""

    def __init__(
        self, stream: TextIO | None = None, plain_every_s: float = 5.0, enabled: bool = True
    ) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.plain_every_s = plain_every_s
        self._last_plain = -float("inf")
        self._width = 0

    def update(self, text: str, fraction: float | None) -> None:
        """Redraw with `text`, after a bar when `fraction` is known (None: no bar)."""
        if not self.enabled:
            return
        line = text if fraction is None else f"{bar(fraction)} {text}"
        if self.tty:
            pad = max(0, self._width - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._width = len(line)
            self.stream.flush()
            return
        now = time.monotonic()
        if now - self._last_plain >= self.plain_every_s:
            self._last_plain = now
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self, final: str | None = None) -> None:
        """End the line (and print `final` on its own line, if given)."""
        if not self.enabled:
            return
        if self.tty and self._width:
            self.stream.write("\n")
        if final:
            self.stream.write(final + "\n")
        self.stream.flush()


def stderr_is_tty() -> bool:
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


class Ticker:
    """Redraws `progress` every `every_s` seconds from a daemon thread with what `render`
    returns (text, fraction or None), so a bar moves while the work itself is silent.
    `note(text)` keeps the latest message for `render` to show; use it as a context manager."""

    def __init__(
        self,
        progress: ProgressLine,
        render: Callable[[float, str], tuple[str, float | None]],
        every_s: float = 0.5,
    ) -> None:
        self.progress = progress
        self.render = render
        self.every_s = every_s
        self.message = ""
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="progress", daemon=True)

    def note(self, text: str) -> None:
        self.message = text
        self.draw()

    def draw(self) -> None:
        with self._lock:
            text, fraction = self.render(time.monotonic() - self._started, self.message)
            self.progress.update(text, fraction)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.draw()

    def __enter__(self) -> Ticker:
        self._started = time.monotonic()
        if self.progress.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.progress.close()
