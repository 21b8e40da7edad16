"""The envelopes a link carries: their kinds, their fields in order, and the check on arrival.

Every link frame is a msgpack list whose first item names its kind and whose other items are
the kind's fields by position (lists pack smaller and faster than maps on the hot path). The
kinds are one-letter strings on the wire; the names below exist so the code says which
envelope it means. The letters must never change: a peer running older code reads the same
bytes. They are plain `str` constants, not an Enum, so encoding stays msgpack's native path.
"""

from __future__ import annotations

from typing import Any, Final

from shoal.runtime.errors import MalformedFrame, UnknownMessageType

TELL: Final = "t"
"""`[TELL, target, method, args, kwargs]`: a one-way message to an actor."""
ASK: Final = "a"
"""`[ASK, request, target, method, args, kwargs, timeout]`: a request that awaits a reply."""
REPLY: Final = "r"
"""`[REPLY, request, result]`: the answer to an ask."""
FAIL: Final = "f"
"""`[FAIL, request, runtime, type_name, message]`: an ask that raised; `runtime` says whether
the asker re-raises the named runtime error itself or a `RemoteError`."""
CREDIT: Final = "c"
"""`[CREDIT, frames, nbytes]`: the receiver's grant of send credit back to the sender."""
ERROR: Final = "e"
"""`[ERROR, type_name, message]`: the peer broke the protocol; the link closes."""

REQUESTS: Final = (TELL, ASK)
"""The kinds that carry work for an actor and count against receive credit."""

MAX_ASK_TIMEOUT: Final = 7 * 24 * 3600.0

_SHAPES: dict[str, tuple[type | tuple[type, ...], ...]] = {
    TELL: (str, str, list, dict),
    ASK: (int, str, str, list, dict, float),
    REPLY: (int, object),
    FAIL: (int, bool, str, str),
    CREDIT: (int, int),
    ERROR: (str, str),
}


def check_envelope(value: Any) -> list[Any]:
    """Check a decoded frame is one of the link's envelopes, so handlers can trust its fields."""
    if not isinstance(value, list) or not value or not isinstance(value[0], str):
        raise MalformedFrame("a link frame must be a list starting with its kind")
    shape = _SHAPES.get(value[0])
    if shape is None:
        raise UnknownMessageType(f"unknown link frame kind {value[0]!r}")
    if len(value) != len(shape) + 1:
        raise MalformedFrame(f"a {value[0]!r} frame has the wrong fields")
    if not all(map(isinstance, value[1:], shape)):
        raise MalformedFrame(f"a {value[0]!r} frame has the wrong fields")
    if value[0] == CREDIT and (value[1] < 0 or value[2] < 0):
        raise MalformedFrame("a credit grant cannot be negative")
    if value[0] == ASK and not 0 < value[6] <= MAX_ASK_TIMEOUT:
        raise MalformedFrame(f"an ask timeout must be in (0, {MAX_ASK_TIMEOUT}] seconds")
    return value
