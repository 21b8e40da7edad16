"""pass@k: the unbiased estimator's properties, and split evaluation with its failure breakdown."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.learner.lm_eval import EvalError, pass_at_k

counts = st.integers(1, 30).flatmap(
    lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))
)


@given(counts)
def test_pass_at_k_is_the_closed_form(nck):
    n, c, k = nck
    expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@given(counts)
def test_pass_at_k_is_monotone_and_bounded(nck):
    n, c, k = nck
    value = pass_at_k(n, c, k)
    assert 0.0 <= value <= 1.0
    if k < n:
        assert pass_at_k(n, c, k + 1) >= value - 1e-12
    if c < n:
        assert pass_at_k(n, c + 1, k) >= value - 1e-12
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    assert (value == 0.0) == (c == 0)


@given(st.integers(1, 7).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))))
@settings(max_examples=30)
def test_pass_at_k_is_unbiased_over_every_subset(nc):
    """The estimator equals the fraction of k-subsets of the n samples holding a pass."""
    n, c = nc
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets))


@pytest.mark.parametrize(("n", "c", "k"), [(0, 0, 1), (3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)])
def test_impossible_counts_are_refused(n, c, k):
    with pytest.raises(EvalError, match="pass_at_k needs"):
        pass_at_k(n, c, k)
