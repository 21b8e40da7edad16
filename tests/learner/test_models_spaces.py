"""Spaces as JSON and policy specs read back from storage: round trips, and hostile values
(deep, huge, wrong types, absurd sizes) refused with PolicyError, never another exception."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gymnasium import spaces
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.learner.errors import PolicyError
from shoal.learner.models import model_from_spec, space_from_json, space_to_json
from shoal.learner.models.spaces import MAX_DEPTH, MAX_NODES

shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)
finite = st.floats(-1e6, 1e6, allow_nan=False, width=32)


@st.composite
def boxes(draw):
    shape = draw(shapes)
    dtype = draw(st.sampled_from([np.float32, np.float64, np.uint8, np.int32, np.int64]))
    if np.dtype(dtype).kind == "f":
        low = draw(st.one_of(st.just(-np.inf), finite))
        high = draw(st.one_of(st.just(np.inf), finite.filter(lambda v: v >= low)))
        if not np.isinf(low) and not np.isinf(high) and high < low:
            low, high = high, low
        if draw(st.booleans()) and np.isfinite(low):
            size = int(np.prod(shape))
            lows = np.array(draw(st.lists(finite, min_size=size, max_size=size)), np.float64)
            return spaces.Box(
                np.minimum(lows, high).reshape(shape).astype(dtype), high, shape, dtype
            )
        return spaces.Box(low, high, shape, dtype)
    info = np.iinfo(dtype)
    low = draw(st.integers(int(info.min), int(info.max)))
    high = draw(st.integers(low, int(info.max)))
    return spaces.Box(low, high, shape, dtype)


space_strategy = st.one_of(
    boxes(),
    st.builds(spaces.Discrete, st.integers(1, 2**31), start=st.integers(-100, 100)),
    st.lists(st.integers(1, 1000), min_size=1, max_size=6).map(
        lambda nvec: spaces.MultiDiscrete(np.array(nvec))
    ),
)


@given(space=space_strategy)
@settings(max_examples=150, deadline=None)
def test_spaces_round_trip_through_json_text(space):
    value = space_to_json(space)
    back = space_from_json(json.loads(json.dumps(value, allow_nan=False)))
    assert back == space
    assert space_to_json(back) == value


json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=8),
        st.sampled_from(["box", "discrete", "multi_discrete", "inf", "-inf", "float32", "uint8"]),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.dictionaries(
            st.sampled_from(
                ["type", "shape", "dtype", "low", "high", "n", "start", "nvec", "family",
                 "observation_space", "action_space", "hidden", "channels", "lm_config", "x"]
            ),
            children,
            max_size=6,
        ),
    ),
    max_leaves=30,
)  # fmt: skip


@given(value=json_values)
@settings(max_examples=300, deadline=None)
def test_arbitrary_json_is_a_space_or_a_policy_error(value):
    try:
        space_from_json(value)
    except PolicyError:
        pass


@given(value=json_values)
@settings(max_examples=200, deadline=None)
def test_arbitrary_json_is_a_policy_or_a_policy_error(value):
    try:
        model_from_spec(value)
    except PolicyError:
        pass


@given(depth=st.integers(MAX_DEPTH + 1, 5000))
@settings(max_examples=10, deadline=None)
def test_deep_specs_are_refused_without_recursion(depth):
    value: object = {"type": "discrete", "n": 2}
    for _ in range(depth):
        value = {"observation_space": [value]}
    with pytest.raises(PolicyError, match="deeper than"):
        model_from_spec(value)  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match="deeper than"):
        space_from_json(value)


def test_oversized_specs_and_absurd_shapes_are_refused_before_allocating():
    with pytest.raises(PolicyError, match="larger than"):
        space_from_json({"type": "box", "shape": [1], "low": [0] * MAX_NODES, "high": 1})
    for shape in ([1 << 20, 1 << 20], [2] * 9, [0], []):
        box = {"type": "box", "shape": shape, "dtype": "uint8", "low": 0, "high": 255}
        with pytest.raises(PolicyError, match=r"space\.shape"):
            space_from_json(box)
    box = {"type": "box", "shape": [3], "dtype": "uint8", "low": [0, 0], "high": 255}
    with pytest.raises(PolicyError, match="lists 2 values"):
        space_from_json(box)
    for low in (-1, 256):
        box = {"type": "box", "shape": [3], "dtype": "uint8", "low": low, "high": 255}
        with pytest.raises(PolicyError, match="outside the range of uint8"):
            space_from_json(box)
    box = {"type": "box", "shape": [3], "dtype": "float32", "low": 1.0, "high": 0.0}
    with pytest.raises(PolicyError, match="must not exceed"):
        space_from_json(box)
    with pytest.raises(PolicyError, match=r"space\.n "):
        space_from_json({"type": "discrete", "n": 1 << 40, "start": 0})
    with pytest.raises(PolicyError, match=r"space\.dtype"):
        space_from_json({"type": "box", "shape": [3], "dtype": "object", "low": 0, "high": 1})


def test_unsupported_spaces_are_named():
    with pytest.raises(PolicyError, match="cannot be described"):
        space_to_json(spaces.MultiBinary(3))
    big = spaces.Box(np.zeros(1 << 17, np.float32), np.arange(1 << 17, dtype=np.float32) + 1)
    with pytest.raises(PolicyError, match="one low and one high"):
        space_to_json(big)
