"""GAE: a hand-computed case and properties (λ = γ = 1, λ = 0, truncation vs terminal)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from shoal.learner.ppo import gae


def col(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32).reshape(-1, 1)


def flags(*values: bool) -> np.ndarray:
    return np.array(values, dtype=bool).reshape(-1, 1)


def test_hand_computed_case_with_terminal_and_truncation():
    # steps 0,1 | episode ends terminally after step 1 | step 2 truncated (final value 4) | step 3
    r = col(1, 2, 3, 4)
    v = col(0.5, 0.6, 0.7, 0.8)
    dones = flags(False, True, True, False)
    trunc = flags(False, False, True, False)
    final = col(0, 0, 4, 0)
    g, lam = 0.9, 0.8
    adv, ret = gae(r, v, dones, trunc, final, np.array([1.0], np.float32), g, lam)
    d3 = 4 + 0.9 * 1.0 - 0.8  # bootstraps from the value after the fragment
    d2 = 3 + 0.9 * 4.0 - 0.7  # truncated: bootstraps from the final observation's value, trace cut
    d1 = 2 - 0.6  # terminal: nothing after
    d0 = 1 + 0.9 * 0.6 - 0.5
    expected = [d0 + g * lam * d1, d1, d2, d3]
    np.testing.assert_allclose(adv[:, 0], expected, rtol=1e-6)
    np.testing.assert_allclose(ret, adv + v, rtol=1e-6)
    assert adv.dtype == ret.dtype == np.float32


finite = st.floats(-10, 10, width=32)


def step_arrays(t: int, n: int):
    return st.tuples(
        arrays(np.float32, (t, n), elements=finite),
        arrays(np.float32, (t, n), elements=finite),
        arrays(np.float32, (n,), elements=finite),
    )


shapes = st.tuples(st.integers(1, 8), st.integers(1, 4))


@given(data=st.data(), shape=shapes)
@settings(max_examples=50, deadline=None)
def test_lambda_one_gamma_one_without_dones_is_the_monte_carlo_return(data, shape):
    t, n = shape
    r, v, boot = data.draw(step_arrays(t, n))
    none = np.zeros((t, n), bool)
    adv, ret = gae(r, v, none, none, np.zeros((t, n), np.float32), boot, 1.0, 1.0)
    mc = np.flip(np.cumsum(np.flip(r, 0), 0), 0) + boot
    np.testing.assert_allclose(ret, mc, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(adv, mc - v, rtol=1e-4, atol=1e-3)


@given(data=st.data(), shape=shapes, gamma=st.floats(0, 1))
@settings(max_examples=50, deadline=None)
def test_lambda_zero_is_the_one_step_td_error(data, shape, gamma):
    t, n = shape
    r, v, boot = data.draw(step_arrays(t, n))
    dones = data.draw(arrays(bool, (t, n)))
    trunc = dones & data.draw(arrays(bool, (t, n)))
    final = data.draw(arrays(np.float32, (t, n), elements=finite))
    adv, _ = gae(r, v, dones, trunc, final, boot, gamma, 0.0)
    nxt = np.concatenate([v[1:], boot[None]], 0)
    after = np.where(dones, np.where(trunc, final, 0.0), nxt)
    np.testing.assert_allclose(adv, r + gamma * after - v, rtol=1e-5, atol=1e-4)


@given(data=st.data(), shape=shapes, gamma=st.floats(0, 1), lam=st.floats(0, 1))
@settings(max_examples=50, deadline=None)
def test_truncation_is_terminal_with_the_final_value_folded_into_the_reward(
    data, shape, gamma, lam
):
    t, n = shape
    r, v, boot = data.draw(step_arrays(t, n))
    dones = data.draw(arrays(bool, (t, n)))
    trunc = dones & data.draw(arrays(bool, (t, n)))
    final = np.where(trunc, data.draw(arrays(np.float32, (t, n), elements=finite)), 0).astype(
        np.float32
    )
    adv, _ = gae(r, v, dones, trunc, final, boot, gamma, lam)
    folded = (r + gamma * final).astype(np.float32)
    none = np.zeros((t, n), bool)
    adv_terminal, _ = gae(folded, v, dones, none, np.zeros((t, n), np.float32), boot, gamma, lam)
    np.testing.assert_allclose(adv, adv_terminal, rtol=1e-4, atol=1e-3)


@given(data=st.data(), shape=shapes, gamma=st.floats(0, 1), lam=st.floats(0, 1))
@settings(max_examples=30, deadline=None)
def test_a_done_cuts_the_trace_so_later_rewards_cannot_leak_back(data, shape, gamma, lam):
    t, n = shape
    r, v, boot = data.draw(step_arrays(t, n))
    dones = np.zeros((t, n), bool)
    dones[0] = True
    none = np.zeros((t, n), bool)
    zeros = np.zeros((t, n), np.float32)
    adv, _ = gae(r, v, dones, none, zeros, boot, gamma, lam)
    np.testing.assert_allclose(adv[0], r[0] - v[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.99])
def test_truncated_with_zero_final_value_equals_terminal(gamma):
    r, v = col(1, 1, 1), col(0.3, 0.2, 0.1)
    dones = flags(False, True, False)
    zeros = np.zeros((3, 1), np.float32)
    a, _ = gae(r, v, dones, dones, zeros, np.ones(1, np.float32), gamma, 0.9)
    b, _ = gae(r, v, dones, flags(False, False, False), zeros, np.ones(1, np.float32), gamma, 0.9)
    np.testing.assert_allclose(a, b)
