"""Acrobot side by side with Gymnasium's Acrobot-v1: same state, same actions, same results."""

import gymnasium
import numpy as np
import pytest

from shoal.envs import make, make_vector


def _action(state: np.ndarray, rng: np.random.Generator, pump: bool) -> int:
    """Pumping energy (torque along the second joint's velocity) swings up; random rarely does."""
    if pump:
        return 2 if state[3] > 0 else 0
    return int(rng.integers(3))


@pytest.mark.timeout(120)
def test_batched_acrobot_matches_gymnasium_step_for_step():
    n = 4
    rng = np.random.default_rng(11)
    gym_envs = [gymnasium.make("Acrobot-v1") for _ in range(n)]
    vector = make_vector("Acrobot-v1", n, seed=2)
    vector.reset()
    for i, env in enumerate(gym_envs):
        env.reset(seed=200 + i)
        vector.dynamics.state[:, i] = env.unwrapped.state
    ended = {"terminated": 0, "truncated": 0}
    episodes = [0] * n
    for _ in range(1100):
        state = vector.dynamics.state
        actions = np.array([_action(state[:, i], rng, pump=i % 2 == 0) for i in range(n)])
        step = vector.step(actions)
        for i, env in enumerate(gym_envs):
            obs, reward, terminated, truncated, _ = env.step(int(actions[i]))
            np.testing.assert_allclose(step.final_obs[i], obs, rtol=1e-5, atol=1e-5)
            assert step.reward[i] == reward
            assert bool(step.done[i]) == (terminated or truncated)
            assert bool(step.truncated[i]) == (truncated and not terminated)
            if terminated or truncated:
                ended["terminated" if terminated else "truncated"] += 1
                episodes[i] += 1
                env.reset(seed=1000 * episodes[i] + i)
            vector.dynamics.state[:, i] = env.unwrapped.state
    assert ended["terminated"] > 0
    assert ended["truncated"] > 0


def test_single_acrobot_observation_lies_in_its_space():
    env = make("acrobot")
    env.seed(0)
    obs, _ = env.reset()
    for _ in range(50):
        assert env.observation_space.contains(obs)
        obs, reward, done, _ = env.step(2)
        assert reward in (-1.0, 0.0)
        if done:
            break
