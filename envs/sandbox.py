"""`SandboxPool`: run untrusted Python against unit tests, each episode in a fresh confined child.

The pool starts `workers` pre-forked servers (envs/sandbox_server.py, each its own interpreter);
`run` borrows an idle server, which forks one child for the episode, confines it (network and
IPC namespaces, chroot into a fresh directory on a tmpfs, an unprivileged uid, CPU/memory/file/
process/open-file limits, a new session), runs the source and the test calls, and reports back
raw facts as JSON, which `sandbox_verdict.judge` turns into a `SandboxResult`. `run_many` sends
up to `batch` episodes to a server in one request; the server runs them at once, each in a
slot with a uid, a tmpfs and namespaces of its own, which costs far less per episode.

`run` and `run_many` are thread-safe (each request holds one server; requests beyond
`workers` wait for one); `run_async` runs `run` on the pool's own threads so an event loop
never blocks.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from shoal.envs.errors import SandboxError
from shoal.envs.sandbox_channel import CHANNEL_BYTES, CONTROL_BYTES, wire_limits
from shoal.envs.sandbox_verdict import (
    Facts,
    SandboxResult,
    Status,
    TestCase,
    TestOutcome,
    judge,
)
from shoal.errors import ConfigError

__all__ = [
    "Limits",
    "SandboxClosed",
    "SandboxConfigError",
    "SandboxError",
    "SandboxPool",
    "SandboxResult",
    "Status",
    "TestCase",
    "TestOutcome",
]

_SERVER = Path(__file__).with_name("sandbox_server.py")
_UID_BASE = 200_000
_MAX_BATCH = 64  # sandbox_server.MAX_SLOTS: uids are laid out for that many slots a server
_START_TIMEOUT_S = 30.0
_REPLY_GRACE_S = 10.0
_REPLY_SLACK = 1024 * 1024
_SERVER_ENV = {"LD_BIND_NOW": "1"}
"""Added to the server's environment: the dynamic linker resolves every symbol when the server
starts. Lazily bound, each child would resolve (and write, on a page the fork made it copy)
those the server never called itself, such as chroot and setuid (~14 pages an episode)."""


class SandboxClosed(SandboxError):
    """The pool was closed; create a new `SandboxPool` to run more episodes."""


class SandboxConfigError(SandboxError, ConfigError):
    """A sandbox limit or argument is invalid; the message names it and what is valid."""


@dataclass(frozen=True)
class Limits:
    """Per-episode limits; every child of the pool gets the same."""

    cpu_s: int = 2
    memory_mb: int = 512
    file_size_mb: int = 4
    disk_mb: int = 64
    """Room for all files of an episode together (a private tmpfs where it can be mounted)."""
    open_files: int = 32
    processes: int = 16
    output_bytes: int = 64 * 1024
    timeout_s: float = 5.0
    """Wall-clock limit when `run` is given no timeout."""

    def __post_init__(self) -> None:
        for name, low in (
            ("cpu_s", 1),
            ("memory_mb", 64),
            ("file_size_mb", 1),
            ("disk_mb", 1),
            ("open_files", 8),
            ("processes", 1),
            ("output_bytes", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise SandboxConfigError(f"Limits.{name}={value!r}: must be an integer ≥ {low}")
        _check_timeout("Limits.timeout_s", self.timeout_s)

    def to_wire(self) -> dict[str, int]:
        return {
            "cpu_s": self.cpu_s,
            "memory_bytes": self.memory_mb * 1024 * 1024,
            "file_size_bytes": self.file_size_mb * 1024 * 1024,
            "disk_bytes": self.disk_mb * 1024 * 1024,
            "open_files": self.open_files,
            "processes": self.processes,
            "output_bytes": self.output_bytes,
        }


def _check_timeout(name: str, value: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise SandboxConfigError(f"{name}={value!r}: must be a positive number of seconds")


# ---------------------------------------------------------------- the servers (I/O)


def _frame(obj: Any) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


class _Server:
    """One pre-forked server process and its pipes; used by one thread at a time."""

    def __init__(self, limits: Limits, root: Path, slots: int) -> None:
        config = {
            "limits": limits.to_wire(),
            "root": str(root),
            "uid_base": _UID_BASE,
            "slots": slots,
            "channel": wire_limits(),
        }
        # Nothing the server sends can be longer: JSON escapes a byte in at most 6.
        per_episode = CHANNEL_BYTES + CONTROL_BYTES + 2 * limits.output_bytes
        self.reply_limit = 6 * slots * per_episode + _REPLY_SLACK
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(_SERVER), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
            start_new_session=True,
            env={**os.environ, **_SERVER_ENV},
        )
        try:
            hello = self._read(time.monotonic() + _START_TIMEOUT_S)
        except SandboxError:
            self.kill()
            raise
        if not _is_hello(hello):
            self.kill()
            raise SandboxError(f"sandbox server {self.proc.pid} sent a malformed greeting")
        self.pid: int = hello["pid"]
        self.uids: list[int] = hello["uids"]
        self.isolation: dict[str, str] = hello["isolation"]

    def run_batch(self, episodes: list[dict[str, Any]], timeout: float) -> list[Facts]:
        """The facts of each episode, in order; they all run at once, so `timeout` bounds all."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(_frame({"episodes": episodes}))
            self.proc.stdin.flush()
        except OSError as exc:
            raise SandboxError(f"sandbox server {self.proc.pid} is gone: {exc}") from exc
        results = self._read(time.monotonic() + timeout + _REPLY_GRACE_S).get("results")
        if not isinstance(results, list) or len(results) != len(episodes):
            raise SandboxError(f"sandbox server {self.proc.pid} sent a malformed reply")
        return [Facts.from_wire(facts) for facts in results]

    def _read(self, deadline: float) -> dict[str, Any]:
        """One frame from the server. It runs no untrusted code itself (its children do, and
        reach it only as bytes it quotes), but a broken one must still not break the pool."""
        (length,) = struct.unpack(">I", self._read_exact(4, deadline))
        if length > self.reply_limit:
            raise SandboxError(f"sandbox server {self.proc.pid} sent a {length}-byte frame")
        try:
            reply = json.loads(self._read_exact(length, deadline))
        except (ValueError, RecursionError) as exc:
            raise SandboxError(f"sandbox server {self.proc.pid} sent a malformed reply") from exc
        if not isinstance(reply, dict):
            raise SandboxError(f"sandbox server {self.proc.pid} sent a malformed reply")
        return reply

    def _read_exact(self, n: int, deadline: float) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        data = b""
        while len(data) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise SandboxError(f"sandbox server {self.proc.pid} did not answer in time")
            chunk = os.read(fd, n - len(data))
            if not chunk:
                raise SandboxError(
                    f"sandbox server {self.proc.pid} exited (status {self.proc.poll()})"
                )
            data += chunk
        return data

    def close(self, timeout: float) -> None:
        """Ask the server to stop (end of its stdin); kill it if it does not within `timeout`."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


class SandboxPool:
    """`workers` pre-forked sandbox servers; use as a context manager so they always stop.

    `batch` is how many episodes one server runs at once for `run_many` (each in a slot of
    its own); at worst each may use `limits.memory_mb`, so memory at risk is
    workers × batch × memory_mb.
    """

    def __init__(self, workers: int = 2, limits: Limits | None = None, batch: int = 16) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise SandboxConfigError(f"workers={workers!r}: must be an integer ≥ 1")
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= _MAX_BATCH:
            raise SandboxConfigError(f"batch={batch!r}: must be an integer from 1 to {_MAX_BATCH}")
        self.batch = batch
        self.limits = limits or Limits()
        self._tmp = tempfile.TemporaryDirectory(prefix="shoal-sandbox-", dir=_scratch_root())
        os.chmod(self._tmp.name, 0o711)
        self._idle: queue.SimpleQueue[_Server] = queue.SimpleQueue()
        self._servers: list[_Server] = []
        self._lock = threading.Lock()
        self._closed = False
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="sandbox")
        # Two request threads per server: while one judges a reply (the server is already
        # back in the idle queue), the other has sent that server its next request.
        self._batches = ThreadPoolExecutor(2 * workers, thread_name_prefix="sandbox-batch")
        # A server gets SIGKILL when the *thread* that started it ends (its parent-death
        # signal follows the thread), so every server is started from this one, which lives
        # as long as the pool; a caller's thread may end any time.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="sandbox-spawner")
        try:
            for _ in range(workers):
                self._add_server()
        except BaseException:
            self.close()
            raise

    def _add_server(self) -> None:
        server = self._spawner.submit(
            _Server, self.limits, Path(self._tmp.name), self.batch
        ).result()
        with self._lock:
            self._servers.append(server)
        self._idle.put(server)

    @property
    def isolation(self) -> dict[str, str]:
        """What confinement really applies on this machine (the same for every server)."""
        return dict(self._servers[0].isolation) if self._servers else {}

    def server_pids(self) -> list[int]:
        with self._lock:
            return [s.pid for s in self._servers]

    def uids(self) -> list[int]:
        """Every uid an episode may run as (one per slot of each server)."""
        with self._lock:
            return [uid for s in self._servers for uid in s.uids]

    def run(
        self, source: str, tests: Sequence[TestCase] = (), timeout: float | None = None
    ) -> SandboxResult:
        """Run `source`, then each test's call, in a fresh confined child; thread-safe."""
        wall = self.limits.timeout_s if timeout is None else timeout
        _check_timeout("timeout", wall)
        message, cases = _message((source, tests), wall)
        return self._run_chunk([message], [cases], wall)[0]

    def run_many(
        self, episodes: Sequence[tuple[str, Sequence[TestCase]]], timeout: float | None = None
    ) -> list[SandboxResult]:
        """Run each `(source, tests)` as `run` would, and as isolated, in order; thread-safe.

        The episodes go to the servers in requests of up to `batch`, spread over all servers;
        within a request they run at once, so `timeout` is each episode's wall clock.
        """
        wall = self.limits.timeout_s if timeout is None else timeout
        _check_timeout("timeout", wall)
        prepared = [_message(episode, wall) for episode in episodes]
        messages = [message for message, _ in prepared]
        tests = [cases for _, cases in prepared]
        size = min(self.batch, max(1, math.ceil(len(messages) / max(1, len(self._servers)))))
        starts = range(0, len(messages), size)
        chunks = [(messages[i : i + size], tests[i : i + size], wall) for i in starts]
        if len(chunks) == 1:
            return self._run_chunk(*chunks[0])
        return [r for rs in self._batches.map(lambda c: self._run_chunk(*c), chunks) for r in rs]

    def _run_chunk(
        self, messages: list[dict[str, Any]], tests: list[list[TestCase]], wall: float
    ) -> list[SandboxResult]:
        server = self._borrow()
        try:
            facts = server.run_batch(messages, wall)
        except SandboxError as exc:
            self._replace(server)
            return [_sandbox_failure(str(exc), t, server.isolation) for t in tests]
        self._idle.put(server)
        return [_with_isolation(judge(f, t), server.isolation) for f, t in zip(facts, tests)]

    def _borrow(self) -> _Server:
        while True:
            if self._closed:
                raise SandboxClosed("this SandboxPool is closed; create a new one")
            try:
                return self._idle.get(timeout=0.1)
            except queue.Empty:
                continue

    async def run_async(
        self, source: str, tests: Sequence[TestCase] = (), timeout: float | None = None
    ) -> SandboxResult:
        """`run` on the pool's threads, so the calling event loop keeps running."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(self.run, source, tests, timeout))

    def _replace(self, broken: _Server) -> None:
        broken.kill()
        with self._lock:
            if broken in self._servers:
                self._servers.remove(broken)
        if self._closed:
            return
        try:
            self._add_server()
        except RuntimeError:  # the spawner was shut down by a close() racing with us
            if not self._closed:
                raise

    def close(self) -> None:
        """Stop every server (each removes its episode directories) and the temp root; idempotent."""
        self._closed = True
        self._executor.shutdown(wait=True)
        self._batches.shutdown(wait=True)
        with self._lock:
            servers, self._servers = self._servers, []
        for server in servers:
            server.close(timeout=self.limits.timeout_s + _REPLY_GRACE_S)
        self._spawner.shutdown(wait=True)
        self._tmp.cleanup()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"servers={len(self._servers)}"
        return f"<SandboxPool {state} limits={self.limits}>"


def _is_hello(hello: dict[str, Any]) -> bool:
    uids, isolation = hello.get("uids"), hello.get("isolation")
    return (
        type(hello.get("pid")) is int
        and isinstance(uids, list)
        and all(type(uid) is int for uid in uids)
        and isinstance(isolation, dict)
        and all(isinstance(value, str) for value in isolation.values())
    )


def _scratch_root() -> str | None:
    """Episode directories live in memory (tmpfs) where it exists: creating and removing one
    there costs microseconds, against about a millisecond on a journalled disk."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


def _message(
    episode: tuple[str, Sequence[TestCase]], wall: float
) -> tuple[dict[str, Any], list[TestCase]]:
    """The request for one episode, and its tests as a list (read once, even from an iterator)."""
    if not isinstance(episode, tuple) or len(episode) != 2:
        raise SandboxConfigError(f"an episode must be a (source, tests) tuple, got {episode!r}")
    try:
        source, tests = episode[0], list(episode[1])
    except TypeError as exc:
        raise SandboxConfigError(
            f"tests must be a sequence of TestCase, got {episode[1]!r}"
        ) from exc
    if not isinstance(source, str):
        raise SandboxConfigError(
            f"source must be a str of Python code, not {type(source).__name__}"
        )
    return {"source": source, "calls": [_call(t) for t in tests], "timeout": wall}, tests


def _call(test: TestCase) -> str:
    if not isinstance(test, TestCase) or not isinstance(test.call, str):
        raise SandboxConfigError(f"tests must be TestCase(call: str, expected), got {test!r}")
    try:
        json.dumps(test.expected)
    except (TypeError, ValueError) as exc:
        raise SandboxConfigError(
            f"TestCase {test.call!r}: expected value must be JSON-serialisable ({exc})"
        ) from exc
    return test.call


def _sandbox_failure(
    message: str, tests: Sequence[TestCase], isolation: dict[str, str]
) -> SandboxResult:
    outcomes = tuple(TestOutcome(t.call, t.expected, None, False, "not run") for t in tests)
    return SandboxResult(
        Status.SANDBOX_ERROR, message, 0.0, 0, len(tests), outcomes, "", "", False, 0.0, isolation
    )


def _with_isolation(result: SandboxResult, isolation: dict[str, str]) -> SandboxResult:
    return replace(result, isolation=dict(isolation))
