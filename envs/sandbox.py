"""`SandboxPool`: run untrusted Python against unit tests, each episode in a fresh confined child.

The pool starts `workers` pre-forked servers (envs/sandbox_server.py, each its own interpreter);
`run` borrows an idle server, which forks one child for the episode, confines it (network
namespace, chroot into a fresh directory, an unprivileged uid of its own, CPU/memory/file/
process/open-file limits, a new session), runs the source and the test calls, and reports back
raw facts as JSON. This module turns those facts into a verdict: the child never sees the
expected values, and nothing it writes is trusted to say whether it passed.

`run` is thread-safe (each call holds one server; calls beyond `workers` wait for one);
`run_async` runs it on the pool's own threads so an event loop never blocks.
"""

from __future__ import annotations

import asyncio
import errno
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
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import Any

from shoal.envs.errors import EnvError
from shoal.errors import ConfigError

_SERVER = Path(__file__).with_name("sandbox_server.py")
_UID_BASE = 200_000
_START_TIMEOUT_S = 30.0
_REPLY_GRACE_S = 10.0


class SandboxError(EnvError):
    """The sandbox itself failed or was misused (not the episode's code); the message says how."""


class SandboxClosed(SandboxError):
    """The pool was closed; create a new `SandboxPool` to run more episodes."""


class SandboxConfigError(SandboxError, ConfigError):
    """A sandbox limit or argument is invalid; the message names it and what is valid."""


class Status(StrEnum):
    """Why an episode ended; anything but OK earns zero reward."""

    OK = "ok"
    SYNTAX_ERROR = "syntax_error"
    RUNTIME_ERROR = "runtime_error"
    TIMEOUT = "timeout"
    CPU_LIMIT = "cpu_limit"
    MEMORY_LIMIT = "memory_limit"
    FILE_SIZE_LIMIT = "file_size_limit"
    DISK_LIMIT = "disk_limit"
    PROCESS_LIMIT = "process_limit"
    NETWORK_BLOCKED = "network_blocked"
    FORBIDDEN = "forbidden"
    CRASHED = "crashed"
    EXITED = "exited"
    OUTPUT_LIMIT = "output_limit"
    SANDBOX_ERROR = "sandbox_error"


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


@dataclass(frozen=True)
class TestCase:
    """One unit test: a Python expression evaluated after the source, and the JSON value it must equal."""

    __test__ = False  # not a pytest test class, despite the name

    call: str
    expected: Any


@dataclass(frozen=True)
class TestOutcome:
    call: str
    expected: Any
    actual: Any
    passed: bool
    error: str | None


@dataclass(frozen=True)
class SandboxResult:
    """The verdict on one episode. `reward` is the fraction of tests passed, 0 unless status is OK."""

    status: Status
    message: str
    reward: float
    passed: int
    total: int
    tests: tuple[TestOutcome, ...]
    stdout: str
    stderr: str
    output_truncated: bool
    duration_s: float
    isolation: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return data


# ---------------------------------------------------------------- verdict (pure)

_NETWORK_ERRNOS = {
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.EHOSTUNREACH,
    errno.EAFNOSUPPORT,
    errno.EADDRNOTAVAIL,
    errno.ECONNREFUSED,
}


def classify_error(error: dict[str, Any]) -> Status | None:
    """The limit an exception reveals, or None for an ordinary bug in the code."""
    kind, code = error.get("type"), error.get("errno")
    if kind == "MemoryError":
        return Status.MEMORY_LIMIT
    if code == errno.EAGAIN and kind == "BlockingIOError":
        return Status.PROCESS_LIMIT
    if code == errno.EFBIG:
        return Status.FILE_SIZE_LIMIT
    if code in (errno.ENOSPC, errno.EDQUOT):
        return Status.DISK_LIMIT
    if code == errno.EMFILE:
        return Status.FORBIDDEN
    if code in _NETWORK_ERRNOS:
        return Status.NETWORK_BLOCKED
    if kind == "PermissionError" or code in (errno.EACCES, errno.EPERM):
        return Status.FORBIDDEN
    if kind == "SystemExit":
        return Status.EXITED
    return None


def _signal_status(signum: int) -> tuple[Status, str]:
    name = (
        signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else str(signum)
    )
    if signum == signal.SIGXCPU:
        return Status.CPU_LIMIT, f"killed by {name}: the CPU-time limit was reached"
    if signum == signal.SIGXFSZ:
        return Status.FILE_SIZE_LIMIT, f"killed by {name}: a file grew past the size limit"
    return Status.CRASHED, f"killed by {name}"


def _error_text(error: dict[str, Any]) -> str:
    message = error.get("message") or ""
    return f"{error.get('type')}: {message}" if message else str(error.get("type"))


def _same(actual: Any, expected: Any) -> bool:
    """Equality after a JSON round trip, so a tuple equals a list and 1 equals 1.0 as in Python."""
    return bool(actual == json.loads(json.dumps(expected)))


def judge(facts: dict[str, Any], tests: Sequence[TestCase], limits: Limits) -> SandboxResult:
    """Turn the server's facts about one episode into a verdict (pure; hypothesis tests it)."""
    events = facts.get("events", [])
    by_index: dict[int, dict[str, Any]] = {}
    failure: tuple[Status, str] | None = None
    done = False
    for event in events:
        kind = event.get("event")
        if kind == "done":
            done = True
        elif kind == "test" and isinstance(event.get("index"), int):
            by_index.setdefault(event["index"], event)
        elif kind == "error" and failure is None:
            failure = _module_failure(event)
    outcomes = tuple(_outcome(i, test, by_index.get(i)) for i, test in enumerate(tests))
    for i, event in sorted(by_index.items()):
        limit = classify_error(event["error"]) if "error" in event else None
        if failure is None and limit is not None and limit is not Status.EXITED:
            failure = (limit, f"test {i}: {_error_text(event['error'])}")
    status, message = _verdict(facts, failure, done, limits)
    passed = sum(o.passed for o in outcomes)
    if status is Status.OK:
        reward = passed / len(tests) if tests else 1.0
        message = f"{passed}/{len(tests)} tests passed"
    else:
        reward = 0.0
    return SandboxResult(
        status=status,
        message=message,
        reward=reward,
        passed=passed,
        total=len(tests),
        tests=outcomes,
        stdout=str(facts.get("stdout", "")),
        stderr=str(facts.get("stderr", "")),
        output_truncated=bool(facts.get("output_dropped", 0)),
        duration_s=float(facts.get("duration_s", 0.0)),
    )


def _module_failure(event: dict[str, Any]) -> tuple[Status, str]:
    phase = event.get("phase")
    text = _error_text(event)
    if phase == "compile":
        return Status.SYNTAX_ERROR, text
    if phase == "setup":
        return Status.SANDBOX_ERROR, f"the sandbox could not confine the child: {text}"
    return classify_error(event) or Status.RUNTIME_ERROR, text


def _verdict(
    facts: dict[str, Any], failure: tuple[Status, str] | None, done: bool, limits: Limits
) -> tuple[Status, str]:
    if facts.get("events_overflow"):
        return Status.OUTPUT_LIMIT, "the test results exceeded the result channel's size limit"
    if facts.get("timed_out"):
        return Status.TIMEOUT, "the wall-clock timeout expired; the episode was killed"
    if facts.get("signal") is not None:
        return _signal_status(int(facts["signal"]))
    if failure is not None:
        return failure
    if not done:
        return (
            Status.EXITED,
            f"exited with status {facts.get('exit_code')} before the tests finished",
        )
    return Status.OK, ""


def _outcome(index: int, test: TestCase, event: dict[str, Any] | None) -> TestOutcome:
    if event is None:
        return TestOutcome(test.call, test.expected, None, False, "not run")
    if "error" in event:
        return TestOutcome(test.call, test.expected, None, False, _error_text(event["error"]))
    actual = event.get("value")
    return TestOutcome(test.call, test.expected, actual, _same(actual, test.expected), None)


# ---------------------------------------------------------------- the servers (I/O)


def _frame(obj: Any) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


class _Server:
    """One pre-forked server process and its pipes; used by one thread at a time."""

    def __init__(self, limits: Limits, root: Path) -> None:
        config = {"limits": limits.to_wire(), "root": str(root), "uid_base": _UID_BASE}
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(_SERVER), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
            start_new_session=True,
        )
        try:
            hello = self._read(time.monotonic() + _START_TIMEOUT_S)
        except SandboxError:
            self.kill()
            raise
        self.pid: int = hello["pid"]
        self.uid: int | None = hello["uid"]
        self.isolation: dict[str, str] = hello["isolation"]

    def request(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(_frame(message))
            self.proc.stdin.flush()
        except OSError as exc:
            raise SandboxError(f"sandbox server {self.proc.pid} is gone: {exc}") from exc
        return self._read(time.monotonic() + timeout + _REPLY_GRACE_S)

    def _read(self, deadline: float) -> dict[str, Any]:
        header = self._read_exact(4, deadline)
        reply = json.loads(self._read_exact(struct.unpack(">I", header)[0], deadline))
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
    """`workers` pre-forked sandbox servers; use as a context manager so they always stop."""

    def __init__(self, workers: int = 2, limits: Limits | None = None) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise SandboxConfigError(f"workers={workers!r}: must be an integer ≥ 1")
        self.limits = limits or Limits()
        self._tmp = tempfile.TemporaryDirectory(prefix="shoal-sandbox-", dir=_scratch_root())
        os.chmod(self._tmp.name, 0o711)
        self._idle: queue.SimpleQueue[_Server] = queue.SimpleQueue()
        self._servers: list[_Server] = []
        self._lock = threading.Lock()
        self._closed = False
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="sandbox")
        try:
            for _ in range(workers):
                self._add_server()
        except BaseException:
            self.close()
            raise

    def _add_server(self) -> None:
        server = _Server(self.limits, Path(self._tmp.name))
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
        with self._lock:
            return [s.uid for s in self._servers if s.uid is not None]

    def run(
        self, source: str, tests: Sequence[TestCase] = (), timeout: float | None = None
    ) -> SandboxResult:
        """Run `source`, then each test's call, in a fresh confined child; thread-safe."""
        if not isinstance(source, str):
            raise SandboxConfigError(
                f"source must be a str of Python code, not {type(source).__name__}"
            )
        wall = self.limits.timeout_s if timeout is None else timeout
        _check_timeout("timeout", wall)
        message = {"source": source, "calls": [_call(t) for t in tests], "timeout": wall}
        server = self._borrow()
        try:
            facts = server.request(message, wall)
        except SandboxError as exc:
            self._replace(server)
            return _sandbox_failure(str(exc), tests, server.isolation)
        self._idle.put(server)
        result = judge(facts, tests, self.limits)
        return _with_isolation(result, server.isolation)

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
        if not self._closed:
            self._add_server()

    def close(self) -> None:
        """Stop every server (each removes its episode directories) and the temp root; idempotent."""
        self._closed = True
        self._executor.shutdown(wait=True)
        with self._lock:
            servers, self._servers = self._servers, []
        for server in servers:
            server.close(timeout=self.limits.timeout_s + _REPLY_GRACE_S)
        self._tmp.cleanup()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"servers={len(self._servers)}"
        return f"<SandboxPool {state} limits={self.limits}>"


def _scratch_root() -> str | None:
    """Episode directories live in memory (tmpfs) where it exists: creating and removing one
    there costs microseconds, against about a millisecond on a journalled disk."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


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
    return SandboxResult(**{**result.__dict__, "isolation": dict(isolation)})
