"""Bounds on the shape of msgpack bytes, checked before msgpack is asked to build anything.

msgpack builds nested arrays and maps without recursion, but every extension value (our arrays,
tensors, tuples and messages) is unpacked by a hook that calls msgpack again, tens of KB of C
stack per level: a 700-byte frame of extensions nested 200 deep overflowed the stack and killed
the process with SIGSEGV before anyone had authenticated. So each header is walked here first,
iteratively and without building a value, and refused unless its nesting, its extension nesting
and its number of values stay within the limits. The walk reads lengths and skips payloads, so it
costs one step per value, not per byte.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from shoal.runtime.errors import MalformedFrame


@dataclass(frozen=True)
class ShapeLimits:
    """How deep and how large one decoded header may be.

    `depth` counts every array, map and extension a value sits inside; `ext_depth` counts only
    the extensions (each costs a C stack frame of msgpack's unpacker); `values` counts every
    value, containers included, which bounds the Python objects a frame can make us build."""

    depth: int = 64
    ext_depth: int = 16
    values: int = 1 << 22


DEFAULT_LIMITS = ShapeLimits()

# What each lead byte is: (kind, argument).
_SCALAR = 0  # argument: the value's whole size in bytes
_BLOB = 1  # str/bin with a length field; argument: the field's width
_FIXED_ARRAY = 2  # argument: element count
_FIXED_MAP = 3  # argument: pair count
_ARRAY = 4  # argument: width of the count field
_MAP = 5  # argument: width of the count field
_FIXED_EXT = 6  # argument: payload size
_EXT = 7  # argument: width of the length field
_INVALID = 8

_WIDTH = {1: struct.Struct(">B"), 2: struct.Struct(">H"), 4: struct.Struct(">I")}


def _lead_table() -> tuple[tuple[int, int], ...]:
    table: list[tuple[int, int]] = [(_INVALID, 0)] * 256
    for b in range(0x80):
        table[b] = (_SCALAR, 1)
    for b in range(0x80, 0x90):
        table[b] = (_FIXED_MAP, b & 0x0F)
    for b in range(0x90, 0xA0):
        table[b] = (_FIXED_ARRAY, b & 0x0F)
    for b in range(0xA0, 0xC0):
        table[b] = (_SCALAR, 1 + (b & 0x1F))
    for b in range(0xE0, 0x100):
        table[b] = (_SCALAR, 1)
    fixed = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9}
    fixed.update({0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9})
    for b, size in fixed.items():
        table[b] = (_SCALAR, size)
    for b, width in {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}.items():
        table[b] = (_BLOB, width)
    for b, width in {0xC7: 1, 0xC8: 2, 0xC9: 4}.items():
        table[b] = (_EXT, width)
    for b, size in {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}.items():
        table[b] = (_FIXED_EXT, size)
    table[0xDC], table[0xDD] = (_ARRAY, 2), (_ARRAY, 4)
    table[0xDE], table[0xDF] = (_MAP, 2), (_MAP, 4)
    return tuple(table)


_LEAD = _lead_table()

# Every open container or extension starts with one of these bytes, so a header with few of
# them anywhere (payload bytes included) cannot nest deeply: counted at C speed, this lets the
# common small frame skip the walk below.
_EXT_LEADS = bytes([0xC7, 0xC8, 0xC9, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8])
_CONTAINER_LEADS = bytes([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])
# One translate keeps only those bytes, extension leads as b"E": the count is a C loop.
_MARK = bytes(ord("E") if b in _EXT_LEADS else b for b in range(256))
_UNMARKED = bytes(b for b in range(256) if b not in _EXT_LEADS + _CONTAINER_LEADS)


def _surely_within(data: bytes | bytearray | memoryview, limits: ShapeLimits) -> bool:
    """Whether `data` holds too few lead bytes to break a limit, whatever they mean."""
    if len(data) > limits.values:
        return False
    leads = bytes(data).translate(_MARK, _UNMARKED)
    return len(leads) < limits.depth and leads.count(b"E") <= limits.ext_depth


def check_shape(data: bytes | bytearray | memoryview, limits: ShapeLimits = DEFAULT_LIMITS) -> None:
    """Raise `MalformedFrame` unless the one msgpack value in `data` stays within `limits`.

    It checks the shape only: a value it passes may still be refused by msgpack (trailing
    bytes inside an extension, invalid UTF-8), but msgpack never sees one it refuses. One loop
    with local names, since it runs on every frame: `remaining` holds how many values each
    open container still owes, `exts` the depths at which an extension is open."""
    if _surely_within(data, limits):
        return
    end = len(data)
    pos = 0
    values = 0
    remaining = [1]
    exts: list[int] = []
    lead = _LEAD
    while remaining:
        remaining[-1] -= 1
        if pos >= end:
            raise MalformedFrame(f"frame header ends inside a value after {end} bytes")
        kind, arg = lead[data[pos]]
        values += 1
        if kind == _SCALAR:
            pos += arg
        else:
            pos, count, ext = _read_lead(data, pos, end, kind, arg)
            if ext:
                exts.append(len(remaining))
                if len(exts) > limits.ext_depth:
                    raise MalformedFrame(
                        f"frame header nests more than {limits.ext_depth} extension values"
                    )
            if count >= 0:
                _check_open(count, end - pos, len(remaining), limits)
                remaining.append(count)
        if values > limits.values:
            raise MalformedFrame(f"frame header holds more than {limits.values} values")
        while remaining and not remaining[-1]:
            remaining.pop()
            if exts and exts[-1] == len(remaining):
                exts.pop()
    if pos > end:
        raise MalformedFrame(f"frame header ends inside a value after {end} bytes")


def _check_open(count: int, left: int, depth: int, limits: ShapeLimits) -> None:
    """Each value takes at least one byte: a count beyond the bytes left is a lie, refused
    before msgpack would size a list by it."""
    if depth >= limits.depth:
        raise MalformedFrame(
            f"frame header nests deeper than {limits.depth} levels; a shoal peer never sends that"
        )
    if count > left:
        raise MalformedFrame(
            f"frame header claims {count} values with only {left} bytes left to hold them"
        )


def _read_lead(
    data: bytes | bytearray | memoryview, pos: int, end: int, kind: int, arg: int
) -> tuple[int, int, bool]:
    """Step past the head of a value that is not a plain scalar: where its contents start,
    how many values it holds (-1 for a string or blob, skipped whole) and whether it is an
    extension."""
    if kind == _FIXED_ARRAY:
        return pos + 1, arg, False
    if kind == _FIXED_MAP:
        return pos + 1, 2 * arg, False
    if kind == _BLOB:
        return pos + 1 + arg + _length(data, pos + 1, arg, end), -1, False
    if kind in (_ARRAY, _MAP):
        count = _length(data, pos + 1, arg, end)
        return pos + 1 + arg, count if kind == _ARRAY else 2 * count, False
    if kind == _FIXED_EXT:
        return pos + 2, 1, True
    if kind == _EXT:
        _length(data, pos + 1, arg, end)
        return pos + 2 + arg, 1, True
    raise MalformedFrame(f"frame header has the reserved msgpack byte 0x{data[pos]:02x}")


def _length(data: bytes | bytearray | memoryview, pos: int, width: int, end: int) -> int:
    if pos + width > end:
        raise MalformedFrame(f"frame header ends inside a length field after {end} bytes")
    (length,) = _WIDTH[width].unpack_from(data, pos)
    return int(length)
