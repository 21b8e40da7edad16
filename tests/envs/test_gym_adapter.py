"""Both adapter directions: shoal built-ins pass Gymnasium's check_env; Gymnasium envs run as shoal ones."""

import warnings

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from shoal.envs import make, make_vector
from shoal.envs.gym_adapter import GymEnvironment, ShoalGymEnv, to_gymnasium

BUILTINS = [
    "CartPole-v1",
    "Acrobot-v1",
    "GridWorld-v1",
    "GridWorld-TwoKeys-v1",
    "GridWorld-HeldOut-v1",
]


@pytest.mark.parametrize("env_id", BUILTINS)
def test_builtins_pass_gymnasium_check_env(env_id):
    env = to_gymnasium(env_id)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env, skip_render_check=True)
    # Gymnasium's own CartPole-v1 draws the same warning about its unbounded velocities.
    complaints = [str(w.message) for w in caught if "infinity" not in str(w.message)]
    assert complaints == []


def test_gymnasium_wrappers_and_vectors_accept_a_shoal_env():
    env = gymnasium.wrappers.RecordEpisodeStatistics(
        to_gymnasium("CartPole-v1", max_episode_steps=5)
    )
    env.reset(seed=0)
    for _ in range(5):
        _, _, terminated, truncated, info = env.step(1)
        if terminated or truncated:
            break
    assert "episode" in info
    vector = gymnasium.vector.SyncVectorEnv([lambda: to_gymnasium("Acrobot-v1")] * 2)
    obs, _ = vector.reset(seed=1)
    assert obs.shape == (2, 6)
    vector.close()


def test_truncation_maps_to_gymnasium_truncated():
    env = ShoalGymEnv(make("GridWorld-Empty-v1", max_episode_steps=1))
    env.reset(seed=0)
    cells = env.env.unwrapped.dynamics.cells[0]
    goal = tuple(np.argwhere(cells == 2)[0])
    start = env.env.unwrapped.dynamics.state_of(0).agent
    action = 0 if goal != (start[0] - 1, start[1]) else 2
    _, _, terminated, truncated, _ = env.step(action)
    assert truncated
    assert not terminated


def test_gymnasium_env_as_shoal_env():
    env = make("gym:CartPole-v1")
    assert isinstance(env, GymEnvironment)
    env.seed(4)
    first, _ = env.reset()
    env.seed(4)
    again, _ = env.reset()
    np.testing.assert_array_equal(first, again)
    steps = 0
    while True:
        _, _, done, info = env.step(0)
        steps += 1
        if done:
            break
    assert info["truncated"] is False
    assert steps < 500


def test_gymnasium_time_limit_is_reported_as_truncated():
    env = make("gym:Pendulum-v1")
    env.reset()
    for _ in range(200):
        _, _, done, info = env.step(np.zeros(1, dtype=np.float32))
    assert done
    assert info["truncated"] is True


def test_gym_env_in_a_vector_runner():
    vector = make_vector("gym:Acrobot-v1", 3, seed=0)
    try:
        obs = vector.reset()
        assert obs.shape == (3, 6)
        step = vector.step(np.array([0, 1, 2]))
        assert step.obs.dtype == np.float32
        np.testing.assert_array_equal(step.reward, [-1.0, -1.0, -1.0])
    finally:
        vector.close()


def test_gymnasium_make_reaches_shoal_envs():
    from shoal.envs import default_registry
    from shoal.envs.gym_adapter import gymnasium_ids, register_in_gymnasium

    ids = register_in_gymnasium([spec.id for spec in default_registry.native_specs()])
    assert "shoal/GridWorld-HeldOut-v1" in ids
    env = gymnasium.make("shoal/CartPole-v1")
    obs, _ = env.reset(seed=0)
    assert obs.shape == (4,)
    assert not any(gym_id.startswith("shoal/") for gym_id in gymnasium_ids())


def test_atari_through_the_adapter():
    pytest.importorskip("ale_py", reason="ale-py (the envs extra) is not installed")
    vector = make_vector("gym:ALE/Pong-v5", 2, seed=0)
    try:
        assert vector.reset().shape == (2, 210, 160, 3)
        step = vector.step(np.array([0, 1]))
        assert step.obs.dtype == np.uint8
    finally:
        vector.close()


def test_minigrid_through_the_adapter_is_packed_into_one_array():
    pytest.importorskip("minigrid", reason="minigrid (the envs extra) is not installed")
    from shoal.envs.packed_obs import PackedBox

    env = make("gym:MiniGrid-Empty-5x5-v0")
    env.seed(0)
    obs, _ = env.reset()
    assert isinstance(env.observation_space, PackedBox)
    assert "image" in env.observation_space.structure.spaces
    assert obs.shape == env.observation_space.shape
    _, _, done, info = env.step(2)
    assert isinstance(done, bool)
    assert "truncated" in info


def test_vector_of_dict_observations_stacks_the_packed_arrays():
    pytest.importorskip("minigrid", reason="minigrid (the envs extra) is not installed")
    vector = make_vector("gym:MiniGrid-Empty-5x5-v0", 2, seed=0)
    try:
        assert vector.reset().shape == (2, *vector.single_observation_space.shape)
    finally:
        vector.close()
