"""The result channel's parser against hostile bytes: a parse or ResultChannelViolation, nothing else.

Depth and size strategies build the inputs a program could write to fd 3 (nesting far past any
recursion limit, lines past the record size, channels past the channel size); the last tests
check that whatever the real harness writes for any value, the parser accepts.
"""

from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.boundedjson import within_depth
from shoal.envs.errors import ResultChannelViolation
from shoal.envs.sandbox_channel import (
    CHANNEL_BYTES,
    RECORD_BYTES,
    RECORD_ELEMENTS,
    VALUE_DEPTH,
    Results,
    parse_control,
    parse_results,
    wire_limits,
)
from shoal.envs.sandbox_server import _value_line

NO_DEADLINE = settings(deadline=None)  # no wall-clock bound: the machine may be loaded
DONE = b'{"event": "done"}\n'
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=8,
)


def _parsed(data: bytes, calls: int = 1, killed: bool = False) -> Results | None:
    """The parse, or None when refused with a reason; any other exception fails the test."""
    try:
        return parse_results(data, calls, killed)
    except ResultChannelViolation as exc:
        reason = str(exc)
    assert reason
    return None


def _nested(depth: int, opener: bytes, closed: bool) -> bytes:
    """A value `depth` arrays or objects deep, or only their opening half."""
    prefix, closer = (b"[", b"]") if opener == b"[" else (b'{"k": ', b"}")
    return prefix * depth + b"0" + (closer * depth if closed else b"")


def _elements(line: bytes) -> int:
    return line.count(b",") + line.count(b"[") + line.count(b"{")


def _depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


@NO_DEADLINE
@given(st.binary(max_size=4000), st.integers(0, 5), st.booleans())
def test_any_bytes_parse_or_are_refused(data, calls, killed):
    _parsed(data, calls, killed)
    try:
        parse_control(data, killed)
    except ResultChannelViolation:
        pass


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 300_000),
    st.sampled_from([b"[", b"{"]),
    st.booleans(),
    st.sampled_from(["record", "bare", "string"]),
)
def test_nesting_of_any_depth_is_bounded_before_it_is_parsed(depth, opener, closed, where):
    nested = _nested(depth, opener, closed)
    if where == "record":
        line = b'{"event": "test", "index": 0, "value": ' + nested + b"}"
    elif where == "bare":
        line = nested
    else:  # brackets inside a string are text, however many
        line = (
            b'{"event": "test", "index": 0, "value": ' + json.dumps(nested.decode()).encode() + b"}"
        )
    result = _parsed(line + b"\n" + DONE)
    fits = len(line) <= RECORD_BYTES and _elements(line) <= RECORD_ELEMENTS
    if where == "string" and fits:
        assert result is not None
    if where == "record" and closed and depth <= VALUE_DEPTH and fits:
        assert result is not None
        assert _depth(result.tests[0].value) == depth
    if where == "record" and depth > VALUE_DEPTH:
        assert result is None


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2 * RECORD_BYTES), st.integers(1, 6), st.booleans())
def test_lines_and_channels_of_any_size_are_bounded(length, lines, terminated):
    records = (
        b'{"event": "test", "index": %d, "value": "' % i + b"x" * length + b'"}\n'
        for i in range(lines)
    )
    data = b"".join(records) + (b"" if terminated else b"tail")
    result = _parsed(data, calls=lines, killed=False)
    valid = length + 50 <= RECORD_BYTES and len(data) <= CHANNEL_BYTES and terminated
    assert (result is not None) == valid


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 4 * RECORD_ELEMENTS), st.sampled_from([b"0", b"[]", b"{}", b"1e-5"]))
def test_lines_of_any_element_count_are_bounded(count, element):
    value = b"[" + b",".join([element] * count) + b"]"
    line = b'{"event": "test", "index": 0, "value": ' + value + b"}"
    result = _parsed(line + b"\n" + DONE)
    assert (result is not None) == (_elements(line) <= RECORD_ELEMENTS)


@NO_DEADLINE
@given(st.lists(json_values, max_size=4), st.data())
def test_a_valid_channel_with_any_byte_changed_still_parses_or_is_refused(values, data):
    channel = b"".join(
        _value_line(i, v, wire_limits()).encode() + b"\n" for i, v in enumerate(values)
    )
    channel += DONE
    at = data.draw(st.integers(0, len(channel)))
    cut = data.draw(st.integers(0, 8))
    splice = data.draw(st.binary(max_size=8))
    _parsed(channel[:at] + splice + channel[at + cut :], len(values), data.draw(st.booleans()))


def _error_with(**changes: st.SearchStrategy) -> st.SearchStrategy:
    fields = {"type": st.just("E"), "errno": st.none(), "message": st.just(""), **changes}
    return st.fixed_dictionaries(fields)


WRONG = {
    "event": st.one_of(st.integers(), st.none(), st.just("Test"), st.lists(st.none())),
    "index": st.one_of(st.booleans(), st.floats(), st.text(max_size=3), st.just(1)),
    "error": st.one_of(
        st.text(max_size=5),
        st.lists(st.integers(), max_size=2),
        _error_with(type=st.integers() | st.text(min_size=101)),
        _error_with(errno=st.text() | st.floats() | st.booleans() | st.just(2**40)),
        _error_with(message=st.integers() | st.just("\ud800") | st.text(min_size=501)),
    ),
}


@NO_DEADLINE
@given(st.sampled_from(["event", "index", "error"]), st.data())
def test_a_field_of_the_wrong_type_is_refused(field, data):
    record = {"event": "test", "index": 0, "error": {"type": "E", "errno": 1, "message": ""}}
    record[field] = data.draw(WRONG[field])
    line = json.dumps(record).encode() + b"\n"
    assert _parsed(line + DONE) is None


@NO_DEADLINE
@given(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e400", "9" * 5000]))
def test_numbers_the_harness_never_writes_are_refused(number):
    line = b'{"event": "test", "index": 0, "value": ' + number.encode() + b"}\n"
    assert _parsed(line + DONE) is None


def test_records_out_of_order_or_after_the_last_are_refused():
    test0 = b'{"event": "test", "index": 0, "value": 1}\n'
    test1 = b'{"event": "test", "index": 1, "value": 1}\n'
    error = b'{"event": "error", "error": {"type": "E", "errno": null, "message": ""}}\n'
    assert _parsed(test0 + test1 + DONE, calls=2) is not None
    assert _parsed(test0 + test0 + DONE, calls=2) is None  # the same test twice
    assert _parsed(test1 + test0 + DONE, calls=2) is None
    assert _parsed(test0 + DONE, calls=2) is None  # done before every test
    assert _parsed(test0 + test1 + DONE + DONE, calls=2) is None
    assert _parsed(test0 + test1 + DONE + test0, calls=2) is None
    assert _parsed(error + test0, calls=2) is None
    assert _parsed(test0 + error, calls=2) is None
    assert _parsed(b"\n" + test0 + test1 + DONE, calls=2) is None


exotic_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**6000), max_value=10**6000)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=4)
    | st.frozensets(st.integers(), max_size=2),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.integers() | st.text(max_size=3) | st.none(), inner, max_size=3)
    ),
    max_leaves=12,
)


@NO_DEADLINE
@given(exotic_values)
def test_whatever_the_harness_writes_for_any_value_is_accepted(value):
    line = _value_line(0, value, wire_limits()).encode() + b"\n"
    result = parse_results(line + DONE, 1, False)
    reported = result.tests[0].value
    if isinstance(reported, dict) and set(reported) == {"__repr__"}:
        return
    assert reported == json.loads(json.dumps(value))


@NO_DEADLINE
@given(st.integers(VALUE_DEPTH + 1, 3000), st.floats(allow_nan=True))
def test_the_harness_reports_a_value_the_parser_would_refuse_by_its_repr(depth, number):
    deep: object = number
    for _ in range(depth):
        deep = [deep]
    for value in (deep, "y" * RECORD_BYTES, [0] * RECORD_ELEMENTS, "1" * 5000):
        line = _value_line(0, value, wire_limits()).encode() + b"\n"
        assert set(parse_results(line + DONE, 1, False).tests[0].value) == {"__repr__"}
    if not math.isfinite(number):
        line = _value_line(0, number, wire_limits()).encode() + b"\n"
        assert parse_results(line + DONE, 1, False).tests[0].value == {"__repr__": repr(number)}


@NO_DEADLINE
@given(json_values, st.integers(0, 6))
def test_the_depth_bound_matches_the_real_depth_of_valid_json(value, limit):
    text = json.dumps(value).encode()
    assert within_depth(text, limit) == (_depth(value) <= limit)
