"""JSON from outside, parsed only once its size and nesting depth are known to be safe.

`json.loads` recurses once per level of nesting, so 100,000 `[` in a request body raise
`RecursionError` (an HTTP 500, a CLI traceback) or worse. `loads` here checks the byte count
first, then the nesting depth by a scan that never recurses, and only then parses; it also
refuses what `json` accepts but JSON does not (NaN, Infinity, a float that overflows).
Every refusal is a `JsonRefused` whose message names the limit or rule broken. This module
imports only the error root, so any package may use it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from shoal.errors import ShoalError

DEFAULT_MAX_DEPTH = 64
"""Deeper than any document shoal reads (a job spec inside a body is a few levels)."""

_ESCAPES = re.compile(rb"\\.", re.DOTALL)
_STRINGS = re.compile(rb'"[^"]*"')
_BRACES_AS_BRACKETS = bytes.maketrans(b"{}", b"[]")
_ALL_BUT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_RUNS = re.compile(rb"\[+|\]+")
_OPEN = ord("[")
_SLOW_PEEL = 8
"""Peeling stops once a sweep removes less than 1/8 of the shape; runs are counted then."""


class JsonRefused(ShoalError, ValueError):
    """Bytes that are not JSON within the limits given; the message says which rule failed."""


class JsonTooLarge(JsonRefused):
    """More bytes than the reader accepts: send less (split it, or leave out what is optional)."""


class JsonTooDeep(JsonRefused):
    """Arrays and objects nested deeper than the reader accepts: flatten the document."""


def within_depth(data: bytes, limit: int) -> bool:
    """Whether `data` nests at most `limit` arrays and objects deep, found without recursion.

    When there are no more opening brackets than `limit`, that settles it. Otherwise escapes
    and then strings are dropped (a bracket in a string is text) and braces become brackets:
    the shape. Removing every innermost `[]` pair lowers a shape's depth by exactly one and
    keeps it balanced or not, so the shape is first peeled that way (one C-level sweep each)
    while that shrinks it fast, then what is left is measured run by run. Unbalanced brackets
    are not JSON: `False`, as for too deep. At most a few sweeps of the bytes in all.
    """
    if data.count(b"[") + data.count(b"{") <= limit:
        return True
    shape = _STRINGS.sub(b"", _ESCAPES.sub(b"", data))
    shape = shape.translate(_BRACES_AS_BRACKETS, _ALL_BUT_BRACKETS)
    peeled = 0
    while shape and peeled < limit:
        shorter = shape.replace(b"[]", b"")
        if len(shorter) == len(shape):
            return False  # non-empty with no innermost pair: unbalanced
        peeled += 1
        slow = len(shorter) * _SLOW_PEEL > len(shape) * (_SLOW_PEEL - 1)
        shape = shorter
        if slow:
            break
    return _runs_within(shape, limit - peeled)


def _runs_within(shape: bytes, limit: int) -> bool:
    """The depth of a bracket shape measured over its runs of `[` and of `]`: after a peel
    that removed few pairs there are few runs, since each run boundary needs a pair."""
    depth = 0
    for run in _RUNS.finditer(shape):
        if run.group()[0] == _OPEN:
            depth += len(run.group())
            if depth > limit:
                return False
        else:
            depth -= len(run.group())
            if depth < 0:
                return False
    return depth == 0


def loads(data: bytes, *, max_bytes: int, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """Parse `data` as JSON if it is at most `max_bytes` long and `max_depth` deep.

    Raises `JsonTooLarge`, `JsonTooDeep` or `JsonRefused` (not JSON or not UTF-8, NaN or
    Infinity, an overflowing float, an integer longer than Python parses).
    """
    if len(data) > max_bytes:
        raise JsonTooLarge(f"{len(data)} bytes, more than the limit of {max_bytes}")
    if not within_depth(data, max_depth):
        raise JsonTooDeep(
            f"nests arrays and objects deeper than {max_depth} levels (or its brackets do "
            "not balance)"
        )
    try:
        return json.loads(data, parse_constant=_no_constant, parse_float=_finite)
    except ValueError as exc:
        raise JsonRefused(f"not valid JSON ({exc})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} overflows a float")
    return value
