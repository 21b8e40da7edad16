"""What an episode's facts mean: the verdict types and `judge`, a pure function.

The sandbox server reports facts: what it observed itself (exit status, signal, timeout, how
much was written) and the raw bytes of the child's two channels (see sandbox_channel). This
module decides the status and the reward. What the server observed and the control channel
come first; the result channel, which the episode's program can write to, is parsed as hostile
input and only ever fails an episode or reports values the program could have returned anyway.
The child never sees the expected values.
"""

from __future__ import annotations

import errno
import json
import math
import signal
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from shoal.envs.errors import ResultChannelViolation, SandboxError
from shoal.envs.sandbox_channel import (
    ErrorInfo,
    Results,
    parse_control,
    parse_results,
)


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
    CHANNEL_VIOLATION = "channel_violation"
    SANDBOX_ERROR = "sandbox_error"


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


_NETWORK_ERRNOS = {
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.EHOSTUNREACH,
    errno.EAFNOSUPPORT,
    errno.EADDRNOTAVAIL,
    errno.ECONNREFUSED,
}


@dataclass(frozen=True)
class Facts:
    """What the server reports about one episode, its shape checked (`from_wire`).

    `control` and `events` are the raw bytes of the control and result channels."""

    control: bytes
    events: bytes
    events_overflow: bool
    stdout: str
    stderr: str
    output_dropped: int
    timed_out: bool
    exit_code: int | None
    signal: int | None
    duration_s: float

    @classmethod
    def from_wire(cls, raw: Any) -> Facts:
        """Check one entry of the server's reply; SandboxError if the server is broken."""
        if not isinstance(raw, dict) or raw.keys() != _FACT_TYPES.keys():
            raise SandboxError(f"malformed facts from the sandbox server: {_keys(raw)}")
        for name, kinds in _FACT_TYPES.items():
            if type(raw[name]) not in kinds:
                kind = type(raw[name]).__name__
                raise SandboxError(f"malformed facts from the sandbox server: {name} is a {kind}")
        if raw["output_dropped"] < 0 or not math.isfinite(raw["duration_s"]):
            raise SandboxError("malformed facts from the sandbox server: a negative or odd count")
        try:
            control, events = raw["control"].encode("latin-1"), raw["events"].encode("latin-1")
        except UnicodeEncodeError as exc:
            raise SandboxError(f"malformed facts from the sandbox server: {exc}") from exc
        return cls(**{**raw, "control": control, "events": events})

    @property
    def killed(self) -> bool:
        """The child was stopped from outside (or by the kernel), so a line may be cut short."""
        return self.timed_out or self.signal is not None


_FACT_TYPES: dict[str, tuple[type, ...]] = {
    "control": (str,),
    "events": (str,),
    "events_overflow": (bool,),
    "stdout": (str,),
    "stderr": (str,),
    "output_dropped": (int,),
    "timed_out": (bool,),
    "exit_code": (int, type(None)),
    "signal": (int, type(None)),
    "duration_s": (float,),
}


def _keys(raw: Any) -> str:
    return repr(sorted(map(str, raw))[:12]) if isinstance(raw, dict) else type(raw).__name__


def classify_error(error: ErrorInfo) -> Status | None:
    """The limit an exception reveals, or None for an ordinary bug in the code."""
    kind, code = error.type, error.errno
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


def _same(actual: Any, expected: Any) -> bool:
    """Equality after a JSON round trip, so a tuple equals a list and 1 equals 1.0 as in Python."""
    return bool(actual == json.loads(json.dumps(expected)))


def judge(facts: Facts, tests: Sequence[TestCase]) -> SandboxResult:
    """Turn the server's facts about one episode into a verdict (pure; hypothesis tests it)."""
    try:
        results: Results | str = parse_results(facts.events, len(tests), facts.killed)
    except ResultChannelViolation as exc:
        results = str(exc)
    status, message = _before_the_code(facts) or _after_the_code(facts, results)
    outcomes = tuple(_outcome(test, i, results) for i, test in enumerate(tests))
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
        stdout=facts.stdout,
        stderr=facts.stderr,
        output_truncated=facts.output_dropped > 0,
        duration_s=facts.duration_s,
    )


def _before_the_code(facts: Facts) -> tuple[Status, str] | None:
    """The verdict from what the server saw and the control channel, which the program cannot
    reach; None when that leaves it to the result channel."""
    try:
        control = parse_control(facts.control, facts.killed)
    except ResultChannelViolation as exc:
        return Status.SANDBOX_ERROR, f"the sandbox's control channel is malformed: {exc}"
    if control.phase == "setup" and control.error is not None:
        return (
            Status.SANDBOX_ERROR,
            f"the sandbox could not confine the child: {control.error.text()}",
        )
    if facts.events_overflow:
        return Status.OUTPUT_LIMIT, "the test results exceeded the result channel's size limit"
    if facts.timed_out:
        return Status.TIMEOUT, "the wall-clock timeout expired; the episode was killed"
    if facts.signal is not None:
        return _signal_status(facts.signal)
    if control.phase == "compile" and control.error is not None:
        return classify_error(control.error) or Status.SYNTAX_ERROR, control.error.text()
    if control.phase is None:
        return (
            Status.SANDBOX_ERROR,
            f"the child exited with status {facts.exit_code} before it was confined",
        )
    return None


def _after_the_code(facts: Facts, results: Results | str) -> tuple[Status, str]:
    """The verdict from the result channel (`str`: why it is invalid) once the code ran."""
    if isinstance(results, str):
        return Status.CHANNEL_VIOLATION, f"the program wrote to its result channel: {results}"
    if results.error is not None:
        return classify_error(results.error) or Status.RUNTIME_ERROR, results.error.text()
    for record in results.tests:
        limit = None if record.error is None else classify_error(record.error)
        if record.error is not None and limit is not None and limit is not Status.EXITED:
            return limit, f"test {record.index}: {record.error.text()}"
    if not results.done:
        return Status.EXITED, f"exited with status {facts.exit_code} before the tests finished"
    return Status.OK, ""


def _outcome(test: TestCase, index: int, results: Results | str) -> TestOutcome:
    if isinstance(results, str):
        return TestOutcome(test.call, test.expected, None, False, "not judged: " + results)
    if index >= len(results.tests):
        return TestOutcome(test.call, test.expected, None, False, "not run")
    record = results.tests[index]
    if record.error is not None:
        return TestOutcome(test.call, test.expected, None, False, record.error.text())
    passed = _same(record.value, test.expected)
    return TestOutcome(test.call, test.expected, record.value, passed, None)
