"""ActorCritic: shapes and dtypes of act/evaluate, log-prob consistency, weights on the wire."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium import spaces
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.learner.errors import PolicyError
from shoal.learner.policy import ActorCritic

DISCRETE = spaces.Discrete(3)
BOX = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)


@given(batch=st.integers(1, 64), box=st.booleans(), deterministic=st.booleans())
@settings(max_examples=25, deadline=None)
def test_act_shapes_dtypes_and_logprobs_match_evaluate(batch, box, deterministic):
    torch.manual_seed(0)
    policy = ActorCritic((4,), BOX if box else DISCRETE)
    obs = np.random.default_rng(batch).normal(size=(batch, 4)).astype(np.float32)
    actions, logp, values = policy.act(obs, deterministic=deterministic)
    assert logp.shape == values.shape == (batch,)
    assert logp.dtype == values.dtype == np.float32
    if box:
        assert actions.shape == (batch, 2)
        assert actions.dtype == np.float32
    else:
        assert actions.shape == (batch,)
        assert actions.dtype == np.int64
        assert ((actions >= 0) & (actions < 3)).all()
    logp2, entropy, values2 = policy.evaluate_actions(
        torch.from_numpy(obs), torch.from_numpy(actions)
    )
    np.testing.assert_allclose(logp2.detach().numpy(), logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(values2.detach().numpy(), values, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(policy.value(obs), values, rtol=1e-5, atol=1e-5)
    assert entropy.shape == (batch,)
    assert (entropy.detach() > 0).all()


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny networks run fastest on one thread; two fight each other on a busy 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_initial_policy_is_near_uniform_and_value_near_zero():
    policy = ActorCritic((4,), DISCRETE)
    obs = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
    _, logp, values = policy.act(obs)
    np.testing.assert_allclose(logp, np.log(1 / 3), atol=0.05)
    assert np.abs(values).mean() < 5.0


def test_multi_dimensional_observations_are_flattened():
    policy = ActorCritic((2, 3), DISCRETE)
    actions, _, _ = policy.act(np.zeros((5, 2, 3), np.float32))
    assert actions.shape == (5,)


def test_weights_round_trip_into_a_fresh_policy():
    torch.manual_seed(1)
    source = ActorCritic((4,), BOX)
    torch.manual_seed(2)
    target = ActorCritic((4,), BOX)
    target.set_weights(source.get_weights())
    obs = np.ones((3, 4), np.float32)
    np.testing.assert_array_equal(source.value(obs), target.value(obs))
    np.testing.assert_array_equal(source.act(obs, True)[0], target.act(obs, True)[0])


def test_get_weights_is_a_copy():
    policy = ActorCritic((4,), DISCRETE)
    weights = policy.get_weights()
    before = weights["critic.0.weight"].copy()
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    np.testing.assert_array_equal(weights["critic.0.weight"], before)


def test_spec_rebuilds_the_same_architecture():
    for space in (DISCRETE, BOX):
        policy = ActorCritic((4,), space, hidden=(8, 8))
        clone = ActorCritic.from_spec(policy.spec())
        clone.set_weights(policy.get_weights())
        obs = np.ones((2, 4), np.float32)
        np.testing.assert_array_equal(policy.value(obs), clone.value(obs))


def test_bad_inputs_raise_policy_error():
    policy = ActorCritic((4,), DISCRETE)
    with pytest.raises(PolicyError, match=r"observations must be \[B, 4\]"):
        policy.act(np.zeros((2, 5), np.float32))
    weights = policy.get_weights()
    weights["critic.0.weight"] = np.zeros((1, 1), np.float32)
    with pytest.raises(PolicyError, match=r"'critic\.0\.weight' has shape"):
        policy.set_weights(weights)
    with pytest.raises(PolicyError, match="missing"):
        policy.set_weights({})
    with pytest.raises(PolicyError, match="Discrete or 1-D Box"):
        ActorCritic((4,), spaces.MultiBinary(3))
    with pytest.raises(PolicyError, match="obs_shape"):
        ActorCritic((), DISCRETE)
    with pytest.raises(PolicyError, match="malformed policy spec"):
        ActorCritic.from_spec({"obs_shape": [4]})


def test_sampled_actions_follow_the_policy_probabilities():
    torch.manual_seed(0)
    policy = ActorCritic((4,), DISCRETE)
    target = torch.tensor([0.2, 0.5, 0.3])
    with torch.no_grad():
        head = policy.actor[-1]
        head.weight.zero_()
        head.bias.copy_(target.log())
    actions, logp, _ = policy.act(np.zeros((40_000, 4), np.float32))
    freq = np.bincount(actions, minlength=3) / actions.size
    np.testing.assert_allclose(freq, target.numpy(), atol=0.015)
    np.testing.assert_allclose(logp, np.log(target.numpy())[actions], rtol=1e-5)
