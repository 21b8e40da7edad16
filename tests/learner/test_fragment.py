"""Fragment: wire round trip and the refusal of every malformed field."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import ShoalError
from shoal.learner.errors import BadFragment, LearnerError
from shoal.learner.fragment import Fragment


def make_fragment(
    t: int = 4,
    n: int = 3,
    obs_shape: tuple[int, ...] = (2,),
    continuous: int = 0,
    k: int = 1,
    seed: int = 0,
) -> Fragment:
    rng = np.random.default_rng(seed)
    if continuous:
        actions = rng.normal(size=(t, n, continuous)).astype(np.float32)
    else:
        actions = rng.integers(0, 2, size=(t, n)).astype(np.int64)
    return Fragment(
        actor_id="a1",
        seq=0,
        policy_version=3,
        env_hash="abc",
        obs=rng.normal(size=(t, n, *obs_shape)).astype(np.float32),
        actions=actions,
        logprobs=rng.normal(size=(t, n)).astype(np.float32),
        values=rng.normal(size=(t, n)).astype(np.float32),
        rewards=np.ones((t, n), np.float32),
        dones=rng.random((t, n)) < 0.2,
        truncated=np.zeros((t, n), bool),
        bootstrap_value=np.zeros(n, np.float32),
        final_values=np.zeros((t, n), np.float32),
        episode_returns=np.arange(k, dtype=np.float32),
        episode_lengths=np.arange(k, dtype=np.int32),
    )


@given(
    t=st.integers(1, 6),
    n=st.integers(1, 5),
    obs_shape=st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple),
    continuous=st.integers(0, 3),
    k=st.integers(0, 4),
)
@settings(max_examples=40, deadline=None)
def test_wire_round_trip_keeps_every_field(t, n, obs_shape, continuous, k):
    frag = make_fragment(t, n, obs_shape, continuous, k)
    back = Fragment.from_wire(frag.to_wire())
    assert back.num_steps == t * n
    assert back.obs_shape == obs_shape
    for name, value in frag.to_wire().items():
        other = getattr(back, name)
        if isinstance(value, np.ndarray):
            assert other.dtype == value.dtype
            np.testing.assert_array_equal(other, value)
        else:
            assert other == value


def test_to_wire_shares_the_arrays():
    frag = make_fragment()
    assert frag.to_wire()["obs"] is frag.obs


def test_bad_fragment_is_a_shoal_error():
    assert issubclass(BadFragment, LearnerError)
    assert issubclass(LearnerError, ShoalError)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("obs", np.zeros((4, 3, 2), np.float64), "fragment.obs must have dtype float32"),
        ("obs", np.zeros((4, 2, 2), np.float32), "fragment.obs must be [T, N, *obs_shape]"),
        ("actions", np.zeros((4, 3), np.int32), "fragment.actions must be int64"),
        ("actions", np.zeros((4, 3, 2), np.int64), "fragment.actions must be int64"),
        ("logprobs", np.zeros((4, 3), np.float64), "fragment.logprobs must have dtype float32"),
        ("dones", np.zeros((4, 3), np.float32), "fragment.dones must have dtype bool"),
        ("rewards", np.zeros((4,), np.float32), "fragment.rewards must be [T, N]"),
        ("values", np.zeros((3, 3), np.float32), "fragment.values must have shape [4, 3]"),
        (
            "bootstrap_value",
            np.zeros(4, np.float32),
            "fragment.bootstrap_value must have shape [3]",
        ),
        ("final_values", [0.0], "fragment.final_values must be a numpy array"),
        (
            "episode_lengths",
            np.zeros(1, np.int64),
            "fragment.episode_lengths must have dtype int32",
        ),
        ("episode_lengths", np.zeros(2, np.int32), "must be 1-D of equal length"),
        ("seq", -1, "must be >= 0"),
        ("seq", "1", "fragment.seq must be int"),
        ("policy_version", True, "fragment.policy_version must be int"),
        ("actor_id", 7, "fragment.actor_id must be str"),
        ("rewards", np.full((4, 3), np.nan, np.float32), "fragment.rewards holds NaN"),
        ("obs", np.full((4, 3, 2), np.inf, np.float32), "fragment.obs holds NaN or infinite"),
        ("actions", np.full((4, 3, 2), np.nan, np.float32), "fragment.actions holds NaN"),
    ],
)
def test_from_wire_refuses_malformed_fields(field, value, message):
    wire = make_fragment().to_wire()
    wire[field] = value
    with pytest.raises(BadFragment) as info:
        Fragment.from_wire(wire)
    assert message in str(info.value)


def test_from_wire_names_missing_and_unknown_fields():
    wire = make_fragment().to_wire()
    del wire["rewards"]
    with pytest.raises(BadFragment, match=r"missing field\(s\) \['rewards'\]"):
        Fragment.from_wire(wire)
    wire = make_fragment().to_wire()
    wire["extra"] = 1
    with pytest.raises(BadFragment, match=r"unknown field\(s\) \['extra'\]"):
        Fragment.from_wire(wire)
    with pytest.raises(BadFragment, match="must arrive as a dict"):
        Fragment.from_wire([1, 2])


@given(
    t=st.integers(1, 5),
    n=st.integers(1, 4),
    continuous=st.integers(0, 2),
    k=st.integers(0, 3),
)
@settings(max_examples=20, deadline=None)
def test_a_fragment_crosses_the_runtime_wire_codec_intact(t, n, continuous, k):
    from shoal.runtime.wire import decode, encode

    frag = make_fragment(t, n, (3,), continuous, k)
    frame = b"".join(bytes(part) for part in encode(frag.to_wire()).parts)
    back = Fragment.from_wire(decode(frame))
    for name, value in frag.to_wire().items():
        other = getattr(back, name)
        if isinstance(value, np.ndarray):
            assert other.dtype == value.dtype
            np.testing.assert_array_equal(other, value)
        else:
            assert other == value
