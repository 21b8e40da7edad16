"""The shape bound on frame headers: exact on every value msgpack can build, and never anything
but `MalformedFrame` (or a pass) on arbitrary bytes."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.runtime import wire
from shoal.runtime.errors import MalformedFrame, WireError
from shoal.runtime.wire_shape import ShapeLimits, check_shape
from tests.runtime.hostile_frames import HOSTILE_HEADERS, header_only_frame, nested_ext

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=40),
    st.binary(max_size=300),
)


# ExtType keeps its payload as bytes; `_Tree` remembers what is inside for the oracle below.
class _Tree:
    def __init__(self, code: int, inner: Any) -> None:
        self.code, self.inner = code, inner


def _packable(value: Any) -> Any:
    if isinstance(value, _Tree):
        return msgpack.ExtType(value.code, msgpack.packb(_packable(value.inner)))
    if isinstance(value, list):
        return [_packable(v) for v in value]
    if isinstance(value, dict):
        return {k: _packable(v) for k, v in value.items()}
    return value


values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.text(max_size=8), inner, max_size=5),
        st.builds(_Tree, st.integers(min_value=0, max_value=127), inner),
    ),
    max_leaves=60,
)


def depth(value: Any) -> int:
    """Levels a value spans; a container reserves a level for its values even when empty."""
    if isinstance(value, _Tree):
        return 1 + depth(value.inner)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=1)
    if isinstance(value, dict):
        return 1 + max((depth(v) for pair in value.items() for v in pair), default=1)
    return 1


def ext_depth(value: Any) -> int:
    if isinstance(value, _Tree):
        return 1 + ext_depth(value.inner)
    if isinstance(value, list):
        return max((ext_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return max((ext_depth(v) for v in value.values()), default=0)
    return 0


def count(value: Any) -> int:
    if isinstance(value, _Tree):
        return 1 + count(value.inner)
    if isinstance(value, list):
        return 1 + sum(count(v) for v in value)
    if isinstance(value, dict):
        return 1 + sum(count(k) + count(v) for k, v in value.items())
    return 1


@settings(max_examples=400, deadline=None)
@given(
    values,
    st.integers(min_value=1, max_value=8),
    st.integers(min_value=0, max_value=4),
    st.integers(min_value=1, max_value=80),
)
def test_the_bound_is_exact(value: Any, max_depth: int, max_ext: int, max_values: int) -> None:
    limits = ShapeLimits(depth=max_depth, ext_depth=max_ext, values=max_values)
    data = msgpack.packb(_packable(value))
    within = (
        depth(value) <= max_depth and ext_depth(value) <= max_ext and count(value) <= max_values
    )
    if within:
        check_shape(data, limits)
    else:
        with pytest.raises(MalformedFrame):
            check_shape(data, limits)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=600))
def test_arbitrary_header_bytes_give_a_value_or_a_wire_error(header: bytes) -> None:
    try:
        check_shape(header)
    except MalformedFrame:
        pass
    try:
        wire.decode(header_only_frame(header))
    except WireError:
        pass


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=1, max_value=3000), st.sampled_from([b"\x91", b"\x81\x01", b"\xd5\x04"])
)
def test_deep_prefixes_are_refused_before_msgpack_sees_them(levels: int, lead: bytes) -> None:
    """Any depth of arrays, maps or extensions: refused past the default limits, never a crash."""
    try:
        wire.decode(header_only_frame(lead * levels + b"\x01"))
    except WireError:
        pass


def test_the_crash_of_issue_14_is_a_malformed_frame() -> None:
    header = nested_ext(200)
    assert len(header) < 720
    with pytest.raises(MalformedFrame, match="more than 16 extension values"):
        wire.decode(header_only_frame(header))


@pytest.mark.parametrize("name", sorted(HOSTILE_HEADERS))
def test_every_hostile_header_is_refused_by_decode(name: str) -> None:
    header, needle = HOSTILE_HEADERS[name]
    with pytest.raises(MalformedFrame, match=needle):
        wire.decode(header_only_frame(header))


def test_what_shoal_sends_stays_well_within_the_limits() -> None:
    nested = ((1, (2, (3, [{"a": (4,)}]))),)
    assert wire.decode(b"".join(bytes(p) for p in wire.encode(nested).parts)) == nested
