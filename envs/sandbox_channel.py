"""What an episode child writes to the pool, parsed as the hostile bytes it is.

Two channels come out of every child. The *control channel* carries what the harness learns
before any code of the episode runs (confinement failed, the source does not compile, or the
code starts now) and is closed before it does, so the program can neither reach nor forge it.
The *result channel* carries the module's exception or each test's value, then `done`; the
program runs in the same process as the harness, so it can write there too. Nothing here trusts
either: the size, the line count and each line's nesting depth are bounded before any JSON is
parsed, every record's shape is checked, and records must come in the one order the harness
writes them. Anything else raises `ResultChannelViolation`, whose message becomes the failed
episode's reason. Pure functions only (property-tested).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shoal.boundedjson import within_depth
from shoal.envs.errors import ResultChannelViolation

CHANNEL_BYTES = 4 * 1024 * 1024
"""The server ends an episode whose result channel grows past this (status output_limit)."""
CONTROL_BYTES = 8 * 1024
RECORD_BYTES = 1024 * 1024
"""One line; the harness reports a value whose record would be longer by its repr."""
RECORD_ELEMENTS = 65536
"""Commas and opening brackets in one line (even inside strings): at most about this many
values are built when it is parsed, so a line of a million tiny lists costs nothing."""
VALUE_DEPTH = 32
"""How deep a test value may nest; the harness reports a deeper one by its repr."""
TEXT_CHARS = 500
"""An exception's message, or a value's repr, as the harness shortens it."""
TYPE_CHARS = 100
INT_DIGITS = 4300
"""Python's own default: parsing an integer costs time quadratic in its digits. A longer run
of digits is refused even inside a string; the harness reports such a value by its repr."""
_ERRNO_RANGE = range(-(2**31), 2**31)
_LINE_DEPTH = VALUE_DEPTH + 1  # the record object around the value

# Numbers are looked at with every digit written as 0, so that plain substring searches (linear,
# in C) find a run of digits longer than INT_DIGITS (refused, whatever Python's own limit is
# set to) and what may overflow to an infinity, which json.loads would accept: a digit before
# an exponent, or a run of 309 digits.
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_NUMBER = b"0" * (INT_DIGITS + 1)
_OVERFLOW_RUN = b"0" * 309
_NON_ASCII = re.compile(rb"[\x80-\xff]")
_SURROGATES = re.compile("[\ud800-\udfff]")


def wire_limits() -> dict[str, int]:
    """The bounds the server's harness keeps to, sent in its config (one source of truth)."""
    return {
        "channel_bytes": CHANNEL_BYTES,
        "control_bytes": CONTROL_BYTES,
        "record_bytes": RECORD_BYTES,
        "record_elements": RECORD_ELEMENTS,
        "int_digits": INT_DIGITS,
        "value_depth": VALUE_DEPTH,
        "text_chars": TEXT_CHARS,
        "type_chars": TYPE_CHARS,
    }


@dataclass(frozen=True)
class ErrorInfo:
    """An exception as the harness describes it: type name, errno (or None) and message."""

    type: str
    errno: int | None
    message: str

    def text(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type


@dataclass(frozen=True)
class TestRecord:
    """What one test call gave: a value, or the exception it raised."""

    __test__ = False  # not a pytest test class, despite the name

    index: int
    value: Any
    error: ErrorInfo | None


@dataclass(frozen=True)
class Control:
    """The control channel: how far the harness got before the episode's code ran.

    `phase` is "run" (the code started), "setup" (confinement failed), "compile" (the source
    does not compile) or None (the child ended before it wrote anything)."""

    phase: str | None
    error: ErrorInfo | None = None


_RUN = b'{"phase": "run"}\n'
"""The control channel of every episode whose code ran: recognised without parsing."""
_STARTED = Control("run")


@dataclass(frozen=True)
class Results:
    """The result channel, valid so far: a module-level exception, or the tests in order and
    whether the harness finished (`done`)."""

    error: ErrorInfo | None
    tests: tuple[TestRecord, ...]
    done: bool


def parse_control(data: bytes, killed: bool) -> Control:
    """The control channel's one record. `killed`: the child was killed (a timeout or a
    signal), so its last line may have been cut short."""
    if data == _RUN:
        return _STARTED
    lines = _lines(data, CONTROL_BYTES, killed)
    first = next(lines, None)
    if first is None:
        return Control(None)
    control = _control(_record(first, 1))
    if next(lines, None) is not None:
        raise ResultChannelViolation("line 2 comes after the harness's only record")
    return control


def _control(record: dict[str, Any]) -> Control:
    phase = record.get("phase")
    if phase == "run" and record.keys() == {"phase"}:
        return Control("run")
    if phase in ("setup", "compile") and record.keys() == {"phase", "error"}:
        return Control(phase, _error_info(record["error"], 1))
    raise ResultChannelViolation(f"line 1 is not a record the harness writes: {_show(record)}")


def parse_results(data: bytes, calls: int, killed: bool) -> Results:
    """The result channel of an episode with `calls` test calls. Raises ResultChannelViolation
    for anything the harness never writes: the episode's program wrote to the channel."""
    error: ErrorInfo | None = None
    tests: list[TestRecord] = []
    done = False
    for number, line in enumerate(_lines(data, CHANNEL_BYTES, killed), 1):
        if done or error is not None:
            raise ResultChannelViolation(f"line {number} comes after the harness's last record")
        record = _record(line, number)
        event = record.get("event")
        if event == "done" and record.keys() == {"event"}:
            if len(tests) != calls:
                raise ResultChannelViolation(
                    f"line {number} says done after {len(tests)} of {calls} tests"
                )
            done = True
        elif event == "error" and record.keys() == {"event", "error"} and not tests:
            error = _error_info(record["error"], number)
        elif event == "test":
            tests.append(_test_record(record, number, len(tests), calls))
        else:
            raise ResultChannelViolation(
                f"line {number} is not a record the harness writes here: {_show(record)}"
            )
    return Results(error, tuple(tests), done)


def _lines(data: bytes, limit: int, killed: bool) -> Iterator[bytes]:
    """The complete lines in order, each within the record size; the harness writes only
    ASCII and ends every line. Lazy: the grammar refuses the first line too many, so a channel
    of a million empty lines costs one."""
    if len(data) > limit:
        raise ResultChannelViolation(f"{len(data)} bytes, more than the limit of {limit}")
    at = None if data.isascii() else _NON_ASCII.search(data)
    if at is not None:
        raise ResultChannelViolation(
            f"byte {at.start()} is not ASCII (the harness writes ASCII JSON only)"
        )
    start = 0
    for number in itertools.count(1):
        end = data.find(b"\n", start)
        if end < 0:
            break
        if end - start > RECORD_BYTES:
            raise ResultChannelViolation(
                f"line {number} has {end - start} bytes, more than the limit of {RECORD_BYTES}"
            )
        yield data[start:end]
        start = end + 1
    if start < len(data) and not killed:
        raise ResultChannelViolation("the last line has no newline (the harness ends each)")


def _record(line: bytes, number: int) -> dict[str, Any]:
    """One line as a JSON object: its element count and depth are bounded before it is parsed."""
    elements = line.count(b",") + line.count(b"[") + line.count(b"{")
    if elements > RECORD_ELEMENTS:
        raise ResultChannelViolation(
            f"line {number} has {elements} commas and brackets, more than the limit of "
            f"{RECORD_ELEMENTS}"
        )
    if not within_depth(line, _LINE_DEPTH):
        raise ResultChannelViolation(
            f"line {number} nests deeper than {_LINE_DEPTH} levels or is not JSON"
        )
    digits = line.translate(_DIGITS_AS_ZERO)
    if _LONG_NUMBER in digits:
        raise ResultChannelViolation(f"line {number} has a number of more than {INT_DIGITS} digits")
    try:
        text = line.decode("ascii")
        record, end = _DECODER.raw_decode(text)
        if end != len(text):
            raise ValueError(f"extra data after the JSON value at column {end}")
    except ValueError as exc:
        raise ResultChannelViolation(
            f"line {number} is not JSON the harness writes: {exc}"
        ) from exc
    if (b"0e" in digits or b"0E" in digits or _OVERFLOW_RUN in digits) and not _finite(record):
        raise ResultChannelViolation(f"line {number} has a number too large for a float")
    if not isinstance(record, dict):
        raise ResultChannelViolation(f"line {number} is not a JSON object: {_show(record)}")
    return record


def _finite(record: Any) -> bool:
    """No infinity anywhere in `record` (a C-speed walk: worth it only where one may be)."""
    try:
        json.dumps(record, allow_nan=False)
    except ValueError:
        return False
    return True


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number (the harness never writes one)")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)
"""Made once: json.loads with an argument builds a decoder on every call."""


def _test_record(record: dict[str, Any], number: int, expected: int, calls: int) -> TestRecord:
    index = record.get("index")
    if type(index) is not int or index != expected or index >= calls:
        raise ResultChannelViolation(
            f"line {number} reports test {_show(index)}, but the harness's next record is "
            + (f"test {expected}" if expected < calls else "done")
        )
    if record.keys() == {"event", "index", "value"}:
        return TestRecord(index, record["value"], None)
    if record.keys() == {"event", "index", "error"}:
        return TestRecord(index, None, _error_info(record["error"], number))
    raise ResultChannelViolation(f"line {number} has keys {sorted(record)[:5]!r}")


def _error_info(raw: Any, number: int) -> ErrorInfo:
    if not isinstance(raw, dict) or raw.keys() != {"type", "errno", "message"}:
        raise ResultChannelViolation(f"line {number}: the error is not one the harness writes")
    kind, code, message = raw["type"], raw["errno"], raw["message"]
    if not _is_text(kind, TYPE_CHARS) or not _is_text(message, TEXT_CHARS):
        raise ResultChannelViolation(
            f"line {number}: the error's type and message must be text of at most "
            f"{TYPE_CHARS} and {TEXT_CHARS} characters"
        )
    if code is not None and (type(code) is not int or code not in _ERRNO_RANGE):
        raise ResultChannelViolation(f"line {number}: errno {_show(code)} is not an errno")
    return ErrorInfo(kind, code, message)


def _is_text(value: Any, limit: int) -> bool:
    """Short text that can be printed: no lone surrogates, which fail when encoded."""
    return type(value) is str and len(value) <= limit and not _SURROGATES.search(value)


def _show(value: Any) -> str:
    """A short, printable glimpse of something the program wrote, for the reason."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."
