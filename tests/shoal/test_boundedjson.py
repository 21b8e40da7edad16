"""The bounded JSON parser: property tests of its depth scan against plain oracles, and of
`loads` on any bytes (a `JsonRefused` or the same value json gives, never anything else)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.boundedjson import JsonRefused, JsonTooDeep, JsonTooLarge, loads, within_depth

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from('ab[]{}"\\\n\u00e9\u2028'), max_size=8)
)
KEYS = st.text(alphabet=st.sampled_from('k[]{}"\\'), max_size=4)


def json_values(max_leaves: int = 30) -> st.SearchStrategy[Any]:
    return st.recursive(
        SCALARS,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
        max_leaves=max_leaves,
    )


@st.composite
def nests(draw: st.DrawFn) -> Any:
    """A value wrapped to a drawn depth (up to 200) in arrays and objects, a sibling beside
    some levels (drawn once and reused: drawing per level makes the strategy slow)."""
    value = draw(json_values(5))
    sibling = draw(SCALARS)
    for kind in draw(st.lists(st.integers(0, 3), max_size=200)):
        if kind == 0:
            value = [value]
        elif kind == 1:
            value = [sibling, value]
        elif kind == 2:
            value = {"in": value}
        else:
            value = {"[": sibling, "in": value}
    return value


def depth(value: Any) -> int:
    """The oracle: recursion is fine here, the values are Python's own and shallow enough."""
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    return 0


def dumps(value: Any, layout: int) -> bytes:
    if layout == 0:
        return json.dumps(value).encode()
    if layout == 1:
        return json.dumps(value, indent=1, ensure_ascii=False).encode()
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


@settings(max_examples=300, deadline=None)
@given(json_values() | nests(), st.integers(0, 40), st.integers(0, 2))
def test_the_depth_scan_agrees_with_the_depth_of_any_json_value(
    value: Any, limit: int, layout: int
) -> None:
    assert within_depth(dumps(value, layout), limit) == (depth(value) <= limit)


def bracket_oracle(shape: str, limit: int) -> bool:
    level = 0
    for char in shape.translate(str.maketrans("{}", "[]")):
        level += 1 if char == "[" else -1
        if level < 0 or level > limit:
            return False
    return level == 0


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="[]{}", max_size=200), st.integers(0, 12))
def test_any_bracket_shape_is_within_iff_balanced_and_shallow(shape: str, limit: int) -> None:
    data = shape.encode()
    if data.count(b"[") + data.count(b"{") <= limit:
        return  # the scan does not look; json.loads then judges the shape, shallowly
    assert within_depth(data, limit) == bracket_oracle(shape, limit)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300) | st.text(max_size=100).map(str.encode), st.integers(0, 8))
def test_loads_refuses_or_agrees_with_json_on_any_bytes(data: bytes, limit: int) -> None:
    try:
        value = loads(data, max_bytes=200, max_depth=limit)
    except JsonRefused:
        return
    assert len(data) <= 200
    assert depth(value) <= limit
    assert value == json.loads(data)


@settings(max_examples=100, deadline=None)
@given(nests(), st.integers(0, 60))
def test_loads_parses_what_is_within_and_names_what_is_too_deep(value: Any, limit: int) -> None:
    data = dumps(value, 0)
    if depth(value) <= limit:
        assert loads(data, max_bytes=len(data), max_depth=limit) == value
        return
    with pytest.raises(JsonTooDeep, match=f"deeper than {limit} levels"):
        loads(data, max_bytes=len(data), max_depth=limit)


@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_a_hundred_thousand_levels_are_refused_without_recursion(opener: str) -> None:
    data = (opener * 100_000).encode()
    with pytest.raises(JsonTooDeep):
        loads(data, max_bytes=len(data))


def test_size_nan_infinity_and_overflow_are_refused_by_name() -> None:
    with pytest.raises(JsonTooLarge, match="more than the limit of 3"):
        loads(b"[1, 2]", max_bytes=3)
    for text, word in ((b"NaN", "NaN"), (b"[-Infinity]", "Infinity"), (b"1e999", "overflows")):
        with pytest.raises(JsonRefused, match=word):
            loads(text, max_bytes=100)
