"""TokenRecall-v1: registered and hashed like every built-in, int64 token observations, reward 1
exactly when the action is the token after the marker, fixed-length episodes, the single and the
batched form agree, Gymnasium's checker passes, bad kwargs are refused."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.envs import make, make_vector
from shoal.envs.gym_adapter import to_gymnasium
from shoal.envs.hashing import env_hash
from shoal.errors import ConfigError


def answers(obs: np.ndarray, marker: int) -> np.ndarray:
    """The right action for each row: the token right after the marker."""
    where = np.argmax(obs == marker, axis=1)
    return obs[np.arange(len(obs)), where + 1]


@settings(max_examples=25, deadline=None)
@given(
    length=st.integers(2, 32),
    num_tokens=st.integers(2, 50),
    episode_steps=st.integers(1, 6),
    seed=st.integers(0, 2**31),
)
def test_reward_is_one_exactly_for_the_token_after_the_marker(
    length, num_tokens, episode_steps, seed
):
    env = make_vector("TokenRecall-v1", 8, seed=seed, length=length, num_tokens=num_tokens,
                      episode_steps=episode_steps)  # fmt: skip
    obs = env.reset()
    space = env.single_observation_space
    assert obs.dtype == np.int64
    assert obs.shape == (8, length)
    assert space.contains(obs[0])
    assert ((obs == num_tokens).sum(axis=1) == 1).all()
    assert (obs[:, -1] != num_tokens).all()
    rng = np.random.default_rng(seed)
    for step in range(1, 2 * episode_steps + 1):
        right = answers(obs, num_tokens)
        wrong = (right + 1) % num_tokens
        pick = rng.random(8) < 0.5
        result = env.step(np.where(pick, right, wrong))
        np.testing.assert_array_equal(result.reward, pick.astype(np.float32))
        assert result.done.all() == (step % episode_steps == 0)
        assert not result.truncated.any()
        obs = result.obs


def test_registered_hashed_and_the_single_form_agrees():
    assert env_hash("TokenRecall-v1", {}, 0) != env_hash("TokenRecall-v1", {"length": 16}, 0)
    env = make("TokenRecall-v1", episode_steps=2)
    env.seed(3)
    obs, _ = env.reset()
    assert obs.dtype == np.int64
    assert obs.shape == (8,)
    _, reward, done, _ = env.step(int(answers(obs[None], 4)[0]))
    assert reward == 1.0
    assert not done
    _, reward, done, _ = env.step(int((answers(env.dynamics.observe(), 4)[0] + 1) % 4))
    assert reward == 0.0
    assert done


def test_gymnasium_checker_passes():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(to_gymnasium("TokenRecall-v1"), skip_render_check=True)
    assert [str(w.message) for w in caught] == []


def test_a_seed_repeats_the_questions():
    first = make_vector("TokenRecall-v1", 4, seed=9).reset()
    np.testing.assert_array_equal(first, make_vector("TokenRecall-v1", 4, seed=9).reset())


@pytest.mark.parametrize(
    "kwargs", [{"length": 1}, {"num_tokens": 1}, {"episode_steps": 0}, {"length": True}]
)
def test_bad_kwargs_are_refused(kwargs):
    with pytest.raises(ConfigError):
        make_vector("TokenRecall-v1", 2, **kwargs)
