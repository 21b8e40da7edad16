"""Frame headers an attacker would send: nesting that would exhaust the C stack or Python's
recursion, and counts that claim more values than the bytes hold. Shared by the in-process
tests of every transport path and the test against a real child process."""

from __future__ import annotations

import msgpack

from shoal.runtime import wire


def nested_ext(depth: int) -> bytes:
    """Extension values nested `depth` deep: ~3.5 bytes a level, so 200 levels fit in 700
    bytes (the pre-authentication crash of issue 14)."""
    value = msgpack.packb(1)
    for _ in range(depth):
        value = msgpack.packb(msgpack.ExtType(4, value))
    return value


def nested_arrays(depth: int) -> bytes:
    return b"\x91" * depth + b"\x01"


def nested_maps(depth: int) -> bytes:
    return b"\x81\x01" * depth + b"\x01"


def huge_count() -> bytes:
    """An array32 claiming 2**32 - 1 elements with nothing behind it."""
    return b"\xdd\xff\xff\xff\xff"


def header_only_frame(header: bytes) -> bytes:
    total = wire.PREFIX_SIZE + len(header)
    return wire.PREFIX.pack(wire.MAGIC, len(header), 0, total) + header


# name -> (header, a phrase of the refusal). Every one fits in a handshake message (4 KiB).
HOSTILE_HEADERS: dict[str, tuple[bytes, str]] = {
    "ext nested 200 deep": (nested_ext(200), "extension values"),
    "ext nested 17 deep": (nested_ext(17), "extension values"),
    "arrays nested 2000 deep": (nested_arrays(2000), "nests deeper"),
    "maps nested 1000 deep": (nested_maps(1000), "nests deeper"),
    "array claiming 4 billion values": (huge_count(), "4294967295"),
}
