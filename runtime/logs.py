"""Logging for every shoal process: bounded in bytes per minute and in bytes on disk.

Every shoal process logs to stderr and its parent points stderr at a per-process file, so a
peer that can make a process log (a malformed HTTP request, a refused link) could otherwise
grow that file without limit. `configure_logging` installs one handler on the root logger that

- rate-limits: per (logger, message template, level) the first `burst` records of a window pass,
  the rest are counted and one line "suppressed K similar messages ..." follows when the window
  rolls (or when the process exits);
- shortens aiohttp's report of a malformed HTTP request to one line, without the traceback and
  without the request bytes aiohttp quotes;
- cuts any single record at `max_record_chars` characters;
- copy-truncates stderr when it is a regular file that has grown past `max_bytes`: the file is
  copied to `<file>.1` (replacing the older copy) and truncated in place, because the process
  cannot rename a file its parent opened. Parents open it with O_APPEND, so writes continue at the
  new end; without O_APPEND the shared offset is moved back to 0.

So a log file never holds much more than `max_bytes`, and with its copy takes about twice that.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TextIO

from aiohttp.http_exceptions import HttpProcessingError

from shoal.errors import ConfigError

MAX_BYTES_ENV = "SHOAL_LOG_MAX_BYTES"
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
MIN_MAX_BYTES = 4096
DEFAULT_BURST = 20
DEFAULT_WINDOW = 60.0
DEFAULT_MAX_KEYS = 128
DEFAULT_MAX_RECORD_CHARS = 64 * 1024
FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

# Loggers aiohttp reports a malformed request on (web_protocol's logger is "aiohttp.server").
AIOHTTP_LOGGERS = frozenset({"aiohttp.server", "aiohttp.web_protocol", "aiohttp.access"})
# Loggers whose messages arrive already formatted, so the message itself is no template.
PREFORMATTED = {"aiohttp.access": "(an access log line)"}
OVERFLOW = "(messages of more kinds than the rate limiter tracks)"
TEMPLATE_CHARS = 200
REASON_CHARS = 80
_SUMMARY = "_shoal_log_summary"

Key = tuple[str, str, int]
"""(logger name, message template, level) — the records a window counts together."""


@dataclass
class _Window:
    start: float
    passed: int = 0
    suppressed: int = 0


@dataclass(frozen=True)
class Suppressed:
    """`count` records of `key` were dropped in the window that began at `start`."""

    key: Key
    count: int
    start: float


class RateLimiter:
    """Counts records per key in fixed windows of `window` seconds, each starting at the key's
    first record after the previous one ended; the first `burst` of a window pass.

    Pure: the caller supplies the time, which must not go backwards (a monotonic clock). At
    most `max_keys` keys are tracked at once; records of further keys share one overflow key per
    level, so distinct messages cannot buy an unbounded number of bursts."""

    def __init__(self, burst: int, window: float, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if burst < 1 or not window > 0 or max_keys < 1:
            raise ConfigError(
                f"log rate limit: burst={burst}, window={window}, max_keys={max_keys}; "
                "all must be positive"
            )
        self.burst = burst
        self.window = window
        self.max_keys = max_keys
        self._windows: OrderedDict[Key, _Window] = OrderedDict()  # oldest window first
        self._now = float("-inf")

    def admit(self, key: Key, now: float) -> tuple[bool, list[Suppressed]]:
        """Whether this record of `key` at `now` passes, and the summaries of every window that
        has ended by `now` and dropped something (to be logged before this record)."""
        self._now = now = max(now, self._now)
        due = self._expire(now)
        key = self._tracked(key)
        current = self._windows.get(key)
        if current is None:
            current = self._windows[key] = _Window(now)
        if current.passed < self.burst:
            current.passed += 1
            return True, due
        current.suppressed += 1
        return False, due

    def drain(self) -> list[Suppressed]:
        """Ends every window now: the summaries of those that dropped something."""
        ended = [self._summary(key, w) for key, w in self._windows.items() if w.suppressed]
        self._windows.clear()
        return ended

    def _tracked(self, key: Key) -> Key:
        if key in self._windows or len(self._windows) < self.max_keys:
            return key
        return ("", OVERFLOW, key[2])

    def _expire(self, now: float) -> list[Suppressed]:
        due: list[Suppressed] = []
        while self._windows:
            key, oldest = next(iter(self._windows.items()))
            if oldest.start + self.window > now:
                break
            del self._windows[key]
            if oldest.suppressed:
                due.append(self._summary(key, oldest))
        return due

    @staticmethod
    def _summary(key: Key, window: _Window) -> Suppressed:
        return Suppressed(key, window.suppressed, window.start)


def template(record: logging.LogRecord) -> str:
    """What makes two records "similar": the message before its arguments are filled in."""
    if record.name in PREFORMATTED:
        return PREFORMATTED[record.name]
    text = record.msg if isinstance(record.msg, str) else type(record.msg).__name__
    return text[:TEMPLATE_CHARS]


class RateLimitFilter(logging.Filter):
    """Drops records beyond the limiter's burst and hands the summaries to `emit`."""

    def __init__(
        self,
        limiter: RateLimiter,
        emit: Callable[[logging.LogRecord], object],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.limiter = limiter
        self._emit = emit
        self._clock = clock
        self._lock = threading.Lock()  # pysyncobj and torch log from their own threads

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, _SUMMARY, False):
            return True
        key = (record.name, template(record), record.levelno)
        with self._lock:
            admitted, due = self.limiter.admit(key, self._clock())
        self._report(due)
        return admitted

    def flush(self) -> None:
        """Logs the summaries of the windows still open (at exit, so no count is lost)."""
        with self._lock:
            due = self.limiter.drain()
        self._report(due)

    def _report(self, due: list[Suppressed]) -> None:
        for ended in due:
            self._emit(self._summary_record(ended))

    def _summary_record(self, ended: Suppressed) -> logging.LogRecord:
        name, text, level = ended.key
        record = logging.LogRecord(
            name or "shoal.logs",
            level,
            __file__,
            0,
            "suppressed %d similar messages (more than %d in %g s): %s",
            (ended.count, self.limiter.burst, self.limiter.window, text),
            None,
        )
        setattr(record, _SUMMARY, True)
        return record


class BadRequestFilter(logging.Filter):
    """aiohttp logs each malformed HTTP request with a traceback and the offending request
    bytes; this turns such a record into one line naming the peer and the reason."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name in AIOHTTP_LOGGERS and record.exc_info:
            exc = record.exc_info[1]
            if isinstance(exc, HttpProcessingError):
                self._shorten(record, exc)
        return True

    @staticmethod
    def _shorten(record: logging.LogRecord, exc: HttpProcessingError) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        peer = args[0] if len(args) == 1 else "a peer"
        record.msg = "bad HTTP request from %s: %s %s (%s)"
        record.args = (peer, exc.code, reason(exc.message), type(exc).__name__)
        record.exc_info = None
        record.exc_text = None


def reason(message: str) -> str:
    """aiohttp's message up to where it quotes the request: first line, no bytes, escaped."""
    first = message.strip().split("\n", 1)[0]
    for quote in (" b'", ' b"'):
        first = first.split(quote, 1)[0]
    return ascii(first.rstrip(" :."))[1:-1][:REASON_CHARS]


def regular_file_fd(stream: TextIO) -> int | None:
    """The descriptor under `stream` when it is a regular file (what can be truncated)."""
    try:
        fd = stream.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (OSError, ValueError, AttributeError):  # pytest's capture, a closed stream
        return None


class BoundedStderrHandler(logging.StreamHandler[TextIO]):
    """Writes to `stream` (stderr), cuts long records, and copy-truncates the file under it
    past `max_bytes` (0: never)."""

    def __init__(
        self,
        stream: TextIO,
        max_bytes: int,
        max_record_chars: int = DEFAULT_MAX_RECORD_CHARS,
    ) -> None:
        super().__init__(stream)
        self.max_bytes = max_bytes
        self.max_record_chars = max_record_chars
        self._fd = regular_file_fd(stream) if max_bytes else None

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if len(text) <= self.max_record_chars:
            return text
        cut = len(text) - self.max_record_chars
        return f"{text[: self.max_record_chars]} ... ({cut} characters cut)"

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        if self._fd is None:
            return
        try:
            size = os.fstat(self._fd).st_size
            if size > self.max_bytes:
                self._rotate(self._fd, size)
        except OSError:  # the file cannot be truncated: stop trying, say so once
            self._fd = None
            self.handleError(record)

    def close(self) -> None:
        for limiter in self.filters:
            if isinstance(limiter, RateLimitFilter):
                limiter.flush()
        super().close()

    def _rotate(self, fd: int, size: int) -> None:
        kept = _keep_copy(fd)
        os.ftruncate(fd, 0)
        if not _appends(fd):
            os.lseek(fd, 0, os.SEEK_SET)
        note = logging.LogRecord(
            "shoal.logs",
            logging.INFO,
            __file__,
            0,
            "log truncated at %d bytes; %s",
            (size, kept),
            None,
        )
        self.stream.write(self.format(note) + self.terminator)
        self.flush()


def _appends(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND)


def _keep_copy(fd: int) -> str:
    """Copies the file under `fd` to `<file>.1`, replacing the older copy; says what it did."""
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "no copy kept (the file's name is unknown on this system)"
    if not os.path.isabs(path) or path.endswith(" (deleted)"):
        return "no copy kept (the file has no name)"
    partial = f"{path}.1.partial"
    try:
        shutil.copyfile(f"/proc/self/fd/{fd}", partial)
        os.replace(partial, f"{path}.1")
    except OSError as exc:
        _discard(partial)
        return f"no copy kept ({exc.strerror or exc})"
    return f"the earlier lines are in {path}.1"


def _discard(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def max_bytes_from(environ: Mapping[str, str]) -> int:
    """SHOAL_LOG_MAX_BYTES: the size past which a log file is truncated; 0 never truncates."""
    raw = environ.get(MAX_BYTES_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1  # not a number: refused below like a negative size
    return checked_max_bytes(value, f"{MAX_BYTES_ENV}={raw!r}")


def checked_max_bytes(value: int, source: str) -> int:
    """`value` when it is 0 (never truncate) or a workable size; else ConfigError naming `source`."""
    if value != 0 and value < MIN_MAX_BYTES:
        raise ConfigError(
            f"{source} is not a log size: give a whole number of bytes, "
            f"0 (never truncate) or at least {MIN_MAX_BYTES}"
        )
    return value


def _level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    named = logging.getLevelName(level.strip().upper())
    if not isinstance(named, int):
        raise ConfigError(
            f"log level {level!r} is unknown: use DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
    return named


def configure_logging(
    level: str | int,
    *,
    max_bytes: int | None = None,
    burst: int = DEFAULT_BURST,
    window: float = DEFAULT_WINDOW,
    stream: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> BoundedStderrHandler:
    """Sends this process's logs to `stream` (stderr) at `level`, rate-limited and size-bounded
    (see the module's docstring); `max_bytes` defaults to $SHOAL_LOG_MAX_BYTES, else 16 MiB.
    Replaces the handler an earlier call installed. Raises ConfigError for an unknown level or
    a bad size."""
    numeric = _level(level)
    if max_bytes is None:
        max_bytes = max_bytes_from(os.environ if environ is None else environ)
    checked_max_bytes(max_bytes, f"max_bytes={max_bytes}")
    handler = BoundedStderrHandler(sys.stderr if stream is None else stream, max_bytes)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(BadRequestFilter())
    handler.addFilter(RateLimitFilter(RateLimiter(burst, window), handler.handle))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, BoundedStderrHandler)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(numeric)
    return handler
