"""SeqRanges against a plain set of ints: the compact form must mean exactly the same set."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.learner.errors import LearnerError
from shoal.learner.seqranges import SeqRanges, ranges_by_actor

seqs = st.lists(st.integers(0, 200), max_size=80)


@given(seqs)
def test_added_numbers_form_sorted_disjoint_merged_ranges(numbers: list[int]) -> None:
    ranges = SeqRanges()
    for n in numbers:
        ranges.add(n)
    assert list(ranges) == sorted(set(numbers))
    assert len(ranges) == len(set(numbers))
    pairs = ranges.to_json()
    assert all(lo < hi for lo, hi in pairs)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(pairs))  # gaps between
    assert all((n in ranges) == (n in set(numbers)) for n in range(-1, 202))


@given(seqs, seqs)
def test_update_is_set_union_and_json_round_trips(left: list[int], right: list[int]) -> None:
    a, b = SeqRanges((n, n + 1) for n in left), SeqRanges((n, n + 1) for n in right)
    a.update(b)
    assert list(a) == sorted(set(left) | set(right))
    assert SeqRanges.from_json(a.to_json()) == a


def test_an_actor_in_order_stays_one_range() -> None:
    ranges = SeqRanges()
    for n in range(1000):
        ranges.add(n)
    assert ranges.to_json() == [[0, 1000]]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0-3", "must be a list"),
        ([[0, 1, 2]], r"is not an \[lo, hi\] pair"),
        ([[3, 1]], r"\[3, 1\) must have 0 <= lo <= hi"),
        ([[-1, 1]], "must have 0 <= lo"),
        ([[0, True]], "pair of ints"),
    ],
)
def test_malformed_ranges_are_named(value: object, message: str) -> None:
    with pytest.raises(LearnerError, match=message):
        SeqRanges.from_json(value)


def test_ranges_by_actor_wants_an_object() -> None:
    with pytest.raises(LearnerError, match="must be a JSON object"):
        ranges_by_actor([[0, 1]])
    assert ranges_by_actor({"a": [[0, 2]]}) == {"a": SeqRanges([(0, 2)])}
