"""The vector contract: auto-reset bookkeeping holds for the native and the generic vector."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.envs import EnvError, InvalidAction, VectorRunner, make, make_vector


def _native(n, limit, seed):
    return make_vector("CartPole-v1", n, seed=seed, max_episode_steps=limit)


def _runner(n, limit, seed):
    return VectorRunner(lambda: make("CartPole-v1", max_episode_steps=limit), n, seed)


def _gridworld(n, limit, seed):
    return make_vector("GridWorld-Empty-v1", n, seed=seed, max_episode_steps=limit, size=5)


def _acrobot(n, limit, seed):
    return make_vector("Acrobot-v1", n, seed=seed, max_episode_steps=limit)


def _check_invariants(vector, limit, seed, steps):
    n = vector.num_envs
    rng = np.random.default_rng(seed)
    obs = vector.reset()
    assert obs.shape == (n, *vector.single_observation_space.shape)
    assert obs.dtype == np.float32
    actions = vector.single_action_space.n
    returns = np.zeros(n)
    lengths = np.zeros(n, dtype=int)
    for _ in range(steps):
        step = vector.step(rng.integers(0, actions, size=n))
        assert step.reward.dtype == np.float32
        assert step.reward.shape == (n,)
        assert step.done.dtype == bool
        assert step.truncated.dtype == bool
        assert step.episode_return.dtype == np.float32
        assert step.episode_length.dtype == np.int32
        returns += step.reward
        lengths += 1
        assert not (step.truncated & ~step.done).any()
        np.testing.assert_array_equal(step.obs[~step.done], step.final_obs[~step.done])
        np.testing.assert_array_equal(step.episode_length, np.where(step.done, lengths, 0))
        np.testing.assert_allclose(
            step.episode_return, np.where(step.done, returns, 0.0), rtol=1e-6
        )
        assert (lengths <= limit).all()
        assert (lengths[step.truncated] == limit).all()
        for row in np.flatnonzero(step.done):
            assert vector.single_observation_space.contains(step.obs[row])
        returns[step.done] = 0.0
        lengths[step.done] = 0


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 12),
    limit=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
    make_fn=st.sampled_from([_native, _runner, _gridworld, _acrobot]),
)
def test_auto_reset_bookkeeping(n, limit, seed, make_fn):
    vector = make_fn(n, limit, seed)
    try:
        _check_invariants(vector, limit, seed, steps=60)
    finally:
        vector.close()


@pytest.mark.parametrize("make_fn", [_native, _runner])
def test_same_seed_same_episodes(make_fn):
    actions = np.random.default_rng(1).integers(0, 2, size=(50, 5))
    runs = []
    for _ in range(2):
        vector = make_fn(5, 500, 42)
        obs = [vector.reset()]
        obs += [vector.step(a).obs for a in actions]
        runs.append(np.stack(obs))
    np.testing.assert_array_equal(runs[0], runs[1])


@pytest.mark.parametrize("make_fn", [_native, _runner])
def test_reset_seed_reseeds(make_fn):
    vector = make_fn(3, 500, None)
    np.testing.assert_array_equal(vector.reset(seed=9), vector.reset(seed=9))


@pytest.mark.parametrize("make_fn", [_native, _runner])
@pytest.mark.parametrize(
    ("actions", "message"),
    [
        (
            np.zeros(4, dtype=np.int64),
            r"expected actions of shape \(3,\) \(one per environment\), got shape \(4,\)",
        ),
        (
            np.zeros(3, dtype=np.float32),
            r"expected integer actions for Discrete\(2\), got dtype float32",
        ),
        (np.array([0, 1, 2]), r"actions must lie in \[0, 1\] for Discrete\(2\)"),
    ],
)
def test_bad_actions_are_refused(make_fn, actions, message):
    vector = make_fn(3, 500, 0)
    vector.reset()
    with pytest.raises(InvalidAction, match=message):
        vector.step(actions)


def test_step_before_reset_is_refused():
    with pytest.raises(EnvError, match=r"call reset\(\) before step\(\)"):
        make_vector("CartPole-v1", 2).step(np.zeros(2, dtype=np.int64))


@pytest.mark.parametrize("num_envs", [0, -1, 2.5, True])
def test_bad_num_envs_is_refused(num_envs):
    with pytest.raises(EnvError, match="num_envs must be a positive integer"):
        make_vector("CartPole-v1", num_envs)
    with pytest.raises(EnvError, match="num_envs must be a positive integer"):
        VectorRunner(lambda: make("CartPole-v1"), num_envs)


def test_generic_runner_is_used_without_a_native_form():
    vector = make_vector("gym:MountainCar-v0", 2, seed=0)
    try:
        assert isinstance(vector, VectorRunner)
        assert vector.reset().shape == (2, 2)
        step = vector.step(np.array([0, 2]))
        assert step.obs.dtype == np.float32
    finally:
        vector.close()
