"""SequenceFragment: wire round trip, dispatch beside Fragment, refusal of every hostile field."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shoal.learner.errors import BadFragment
from shoal.learner.fragment import Fragment
from shoal.learner.sequences import (
    MAX_MAGNITUDE,
    MAX_ROWS,
    SequenceFragment,
    fragment_from_wire,
)
from shoal.runtime import wire
from tests.learner.test_fragment import make_fragment
from tests.support.sequences import make_sequences


def _through_wire(payload: dict[str, Any]) -> Any:
    return wire.decode(b"".join(bytes(part) for part in wire.encode(payload).parts))


@given(
    groups=st.integers(1, 4),
    group_size=st.integers(1, 4),
    max_prompt=st.integers(1, 6),
    max_completion=st.integers(1, 6),
    version=st.integers(0, 1000),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=40, deadline=None)
def test_round_trip_through_the_wire_keeps_every_field(
    groups, group_size, max_prompt, max_completion, version, seed
):
    frag = make_sequences(groups, group_size, 16, max_prompt, max_completion, version, seed)
    back = fragment_from_wire(_through_wire(frag.to_wire()), vocab_size=16)
    assert isinstance(back, SequenceFragment)
    for name, value in frag.to_wire().items():
        if isinstance(value, np.ndarray):
            assert np.array_equal(getattr(back, name), value)
            assert getattr(back, name).dtype == value.dtype
        elif name != "kind":
            assert getattr(back, name) == value
    assert back.num_steps == int(frag.completion_lengths.sum()) == frag.completion_mask().sum()
    assert back.num_envs == groups * group_size
    assert back.obs_shape == (max_prompt + max_completion,)
    assert np.array_equal(back.episode_returns, frag.rewards)
    assert np.array_equal(back.episode_lengths, frag.completion_lengths)


def test_fragment_from_wire_dispatches_on_kind():
    steps = fragment_from_wire(_through_wire(make_fragment().to_wire()))
    assert type(steps) is Fragment
    assert type(fragment_from_wire(make_sequences().to_wire())) is SequenceFragment
    wrong = {**make_sequences().to_wire(), "kind": "episodes"}
    with pytest.raises(BadFragment, match="kind 'sequences'"):
        fragment_from_wire(wrong)
    with pytest.raises(BadFragment, match="must arrive as a dict"):
        fragment_from_wire([1, 2])
    with pytest.raises(BadFragment, match="unknown field"):
        Fragment.from_wire({**make_fragment().to_wire(), "tokens": np.zeros(2)})


def test_vocab_bound_is_checked_where_the_learner_knows_it():
    payload = make_sequences(vocab=16).to_wire()
    assert fragment_from_wire(payload) is not None
    with pytest.raises(BadFragment, match="vocabulary has 8 ids"):
        fragment_from_wire(payload, vocab_size=8)


def _with(name: str, fn) -> dict[str, Any]:
    payload = make_sequences().to_wire()
    payload[name] = fn(payload[name])
    return payload


def _poke(value: np.ndarray, index: tuple[int, ...], new: float) -> np.ndarray:
    out = value.copy()
    out[index] = new
    return out


MALFORMED = [
    ("tokens", lambda v: v.astype(np.int32), "tokens must have dtype int64"),
    ("tokens", lambda v: v.tolist(), "tokens must be a numpy array"),
    ("tokens", lambda v: v[None], r"tokens must be \[N, L\]"),
    ("tokens", lambda v: _poke(v, (0, 0), -1), "ids in"),
    ("tokens", lambda v: _poke(v, (0, 0), 1 << 40), "ids in"),
    ("logprobs", lambda v: v[:, :-1], r"logprobs must have shape \[6, 9\]"),
    ("logprobs", lambda v: _poke(v, (0, 8), np.nan), "NaN or infinite"),
    ("logprobs", lambda v: np.abs(v) + 1.0, "must be <= 0"),
    ("logprobs", lambda v: _poke(v, (0, 0), -1.0), "logprobs must be 0 outside"),
    ("values", lambda v: _poke(v, (1, 0), np.inf), "NaN or infinite"),
    ("values", lambda v: _poke(v, (0, 0), 1.0), "values must be 0 outside"),
    ("rewards", lambda v: _poke(v, (0,), 1e30), "within"),
    ("rewards", lambda v: v.astype(np.float64), "rewards must have dtype float32"),
    ("rewards", lambda v: v[:-1], r"rewards must have shape \[6\]"),
    ("prompt_lengths", lambda v: v * 0, "must be >= 1"),
    ("completion_lengths", lambda v: v * 0, "must be >= 1"),
    ("completion_lengths", lambda v: v + 100, "exceeds the row length 9"),
    ("completion_lengths", lambda v: np.full_like(v, 2**31 - 1), "exceeds the row length"),
    ("versions", lambda v: np.where(v >= 0, -1, v).astype(np.int32), "versions must be >= 0"),
    ("versions", lambda v: np.zeros_like(v), "versions must be -1 outside"),
    ("groups", lambda v: np.arange(6, dtype=np.int64) * 0, "prompts differ"),
    ("groups", lambda v: v - 5, "groups must be ids >= 0"),
    ("seq", lambda v: -1, "must be >= 0"),
    ("seq", lambda v: True, "seq must be int"),
    ("actor_id", lambda v: 7, "actor_id must be str"),
    ("policy_source", lambda v: "x" * 65, "policy_source has 65 characters"),
    ("env_hash", lambda v: "x" * 10_000, "env_hash is longer"),
]


@pytest.mark.parametrize(("field", "change", "message"), MALFORMED)
def test_from_wire_refuses_malformed_fields(field, change, message):
    with pytest.raises(BadFragment, match=message):
        SequenceFragment.from_wire(_with(field, change))


def test_policy_version_must_be_the_oldest_token_stamp():
    payload = make_sequences(version=3).to_wire()
    versions = payload["versions"].copy()
    versions[0, versions[0] >= 0] = 5  # row 0 resumed on version 5 after a weight swap
    assert SequenceFragment.from_wire({**payload, "versions": versions}).policy_version == 3
    payload["policy_version"] = 5
    with pytest.raises(BadFragment, match="oldest version stamped on a completion token is 3"):
        SequenceFragment.from_wire(payload)


def test_missing_and_unknown_fields_are_named():
    payload = make_sequences().to_wire()
    del payload["groups"]
    with pytest.raises(BadFragment, match=r"missing field\(s\) \['groups'\]"):
        fragment_from_wire(payload)
    with pytest.raises(BadFragment, match="unknown field"):
        fragment_from_wire({**make_sequences().to_wire(), "extra": 1})


def test_row_count_is_bounded():
    n = MAX_ROWS + 1
    with pytest.raises(BadFragment, match=f"N <= {MAX_ROWS}"):
        SequenceFragment.from_wire(_with("tokens", lambda v: np.zeros((n, 9), np.int64)))


_DTYPES = st.sampled_from(
    [np.int64, np.int32, np.float32, np.float64, np.bool_, np.uint8, np.int8, np.float16]
)
_JUNK = st.one_of(
    st.none(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=80),
    st.booleans(),
    st.lists(st.integers(), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
    hnp.arrays(_DTYPES, hnp.array_shapes(min_dims=0, max_dims=3, max_side=10)),
)
_FIELDS = st.sampled_from(sorted(make_sequences().to_wire()))


@given(
    edits=st.lists(st.tuples(_FIELDS, _JUNK), min_size=1, max_size=3),
    drop=st.lists(_FIELDS, max_size=2),
)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_hostile_payloads_are_refused_with_bad_fragment_only(edits, drop):
    payload = make_sequences().to_wire()
    for name, value in edits:
        payload[name] = value
    for name in drop:
        payload.pop(name, None)
    try:
        frag = fragment_from_wire(payload, vocab_size=16)
    except BadFragment as exc:
        message = str(exc)
    else:
        _assert_consistent(frag)
        return
    assert message.startswith(("fragment", "a fragment", "a sequence fragment", "sequence"))


def _int_array(dtype, shape, low, high):
    return hnp.arrays(dtype, shape, elements=st.integers(low, high))


@given(data=st.data())
@settings(max_examples=200, deadline=None)
def test_hostile_numbers_in_well_typed_arrays_never_pass_inconsistent(data):
    """Right dtypes and shapes, arbitrary contents: accepted only when every invariant holds."""
    n, length = data.draw(st.integers(1, 4)), data.draw(st.integers(2, 6))
    payload = make_sequences(groups=1, group_size=1, max_prompt=1, max_completion=1).to_wire()
    floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
    payload.update(
        tokens=data.draw(_int_array(np.int64, (n, length), -2, 20)),
        prompt_lengths=data.draw(_int_array(np.int32, (n,), -1, length + 1)),
        completion_lengths=data.draw(_int_array(np.int32, (n,), -1, length + 1)),
        logprobs=data.draw(hnp.arrays(np.float32, (n, length), elements=floats)),
        versions=data.draw(_int_array(np.int32, (n, length), -2, 3)),
        values=data.draw(hnp.arrays(np.float32, (n, length), elements=floats)),
        rewards=data.draw(hnp.arrays(np.float32, (n,), elements=floats)),
        groups=data.draw(_int_array(np.int64, (n,), -1, 2)),
        policy_version=data.draw(st.integers(0, 3)),
    )
    try:
        frag = fragment_from_wire(payload, vocab_size=16)
    except BadFragment:
        return
    _assert_consistent(frag)


def _assert_consistent(frag: object) -> None:
    if isinstance(frag, Fragment):
        return
    assert isinstance(frag, SequenceFragment)
    mask = frag.completion_mask()
    assert (frag.prompt_lengths >= 1).all()
    assert (frag.completion_lengths >= 1).all()
    assert (frag.prompt_lengths + frag.completion_lengths <= frag.horizon).all()
    assert ((frag.tokens >= 0) & (frag.tokens < 16)).all()
    assert np.isfinite(frag.logprobs).all()
    assert (frag.logprobs <= 0).all()
    assert np.abs(frag.rewards).max() <= MAX_MAGNITUDE
    assert (frag.versions[~mask] == -1).all()
    assert frag.versions[mask].min() == frag.policy_version
    assert not frag.logprobs[~mask].any()
    assert not frag.values[~mask].any()
