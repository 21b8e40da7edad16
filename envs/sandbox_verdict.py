"""What an episode's facts mean: the verdict types and `judge`, a pure function.

The sandbox server reports facts (exit status, signal, JSON events the child wrote, captured
output); this module decides the status and the reward. The child never sees the expected
values, and nothing it writes is trusted to say whether it passed.
"""

from __future__ import annotations

import errno
import json
import signal
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


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


def parse_events(text: str) -> list[dict[str, Any]]:
    """The JSON objects among the lines the child wrote; anything else is ignored."""
    events = []
    for line in text.split("\n"):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def judge(facts: dict[str, Any], tests: Sequence[TestCase]) -> SandboxResult:
    """Turn the server's facts about one episode into a verdict (pure; hypothesis tests it).

    `facts["events"]` is the raw text of the child's result channel, one JSON object a line.
    """
    events = parse_events(str(facts.get("events", "")))
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
    status, message = _verdict(facts, failure, done)
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
    facts: dict[str, Any], failure: tuple[Status, str] | None, done: bool
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
