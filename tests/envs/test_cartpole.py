"""CartPole side by side with Gymnasium's CartPole-v1: same state, same actions, same results."""

import gymnasium
import numpy as np
import pytest

from shoal.envs import make, make_vector


def _balancing_action(state: np.ndarray, rng: np.random.Generator, noise: float) -> int:
    """A stabilising controller: with little noise episodes reach the 500-step limit."""
    x, x_dot, theta, theta_dot = state
    if rng.random() < noise:
        return int(rng.integers(2))
    return int(theta + 0.5 * theta_dot + 0.01 * x + 0.1 * x_dot > 0)


@pytest.mark.timeout(120)
def test_batched_cartpole_matches_gymnasium_step_for_step():
    n = 6
    rng = np.random.default_rng(7)
    gym_envs = [gymnasium.make("CartPole-v1") for _ in range(n)]
    vector = make_vector("CartPole-v1", n, seed=3)
    vector.reset()
    state = vector.dynamics.state
    for i, env in enumerate(gym_envs):
        env.reset(seed=100 + i)
        state[:, i] = env.unwrapped.state
    seen_truncated = seen_terminated = 0
    episodes = [0] * n
    for _ in range(1600):
        actions = np.array(
            [_balancing_action(state[:, i], rng, 0.02 + 0.5 * (i % 2)) for i in range(n)]
        )
        step = vector.step(actions)
        for i, env in enumerate(gym_envs):
            obs, reward, terminated, truncated, _ = env.step(int(actions[i]))
            np.testing.assert_allclose(step.final_obs[i], obs, rtol=1e-6, atol=1e-6)
            assert step.reward[i] == reward
            assert bool(step.done[i]) == (terminated or truncated)
            assert bool(step.truncated[i]) == (truncated and not terminated)
            if terminated or truncated:
                seen_truncated += truncated and not terminated
                seen_terminated += terminated
                episodes[i] += 1
                env.reset(seed=1000 * episodes[i] + i)
            state[:, i] = env.unwrapped.state
    assert seen_truncated > 0, "the controller should reach the 500-step limit"
    assert seen_terminated > 0


def test_single_cartpole_matches_gymnasium_until_termination():
    env = make("CartPole-v1")
    gym_env = gymnasium.make("CartPole-v1")
    gym_env.reset(seed=5)
    env.reset()
    env.unwrapped.dynamics.state[:, 0] = gym_env.unwrapped.state
    rng = np.random.default_rng(0)
    for _ in range(500):
        action = int(rng.integers(2))
        obs, reward, done, info = env.step(action)
        gym_obs, gym_reward, terminated, truncated, _ = gym_env.step(action)
        np.testing.assert_allclose(obs, gym_obs, rtol=1e-6, atol=1e-6)
        assert (reward, done) == (gym_reward, terminated or truncated)
        if done:
            assert info["truncated"] == (truncated and not terminated)
            break
    else:
        pytest.fail("random actions should end a CartPole episode within 500 steps")


def test_sutton_barto_reward_is_zero_until_failure():
    vector = make_vector("CartPole-v1", 64, seed=1, sutton_barto_reward=True)
    vector.reset()
    for _ in range(100):
        step = vector.step(np.ones(64, dtype=np.int64))
        np.testing.assert_array_equal(step.reward, np.where(step.done, -1.0, 0.0))


def test_time_limit_can_be_overridden():
    vector = make_vector("CartPole-v1", 4, seed=0, max_episode_steps=3)
    vector.reset()
    for _ in range(2):
        assert not vector.step(np.zeros(4, dtype=np.int64)).done.any()
    step = vector.step(np.zeros(4, dtype=np.int64))
    assert step.done.all()
    assert step.truncated.all()
    np.testing.assert_array_equal(step.episode_length, [3, 3, 3, 3])
