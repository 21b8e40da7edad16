"""The rollout collector (fragments from a vector of environments), pacing, and the spec."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.envs.vector import make_vector
from shoal.learner.errors import LearnerError
from shoal.learner.models import ModelConfig, build_model
from shoal.learner.rollout import Collector, Pacer
from shoal.learner.rollout_main import spec_from_json


def _collector(num_envs: int = 4, horizon: int = 8, **env_kwargs: object) -> Collector:
    env = make_vector("CartPole-v1", num_envs, seed=1, **env_kwargs)
    policy = build_model(ModelConfig(), env.single_observation_space, env.single_action_space)
    return Collector("actor-a", env, policy, horizon, "hash", seed=1)


def test_fragments_have_the_contract_shapes_and_count_up() -> None:
    collector = _collector()
    first, second = collector.collect(), collector.collect()
    assert (first.seq, second.seq) == (0, 1)
    assert first.obs.shape == (8, 4, 4)
    assert first.actions.dtype == np.int64
    assert first.num_steps == 32
    assert collector.env_steps == 64
    assert first.actor_id == "actor-a"
    assert first.env_hash == "hash"
    # the observation after the last step of one fragment starts the next
    assert not np.array_equal(first.obs[0], second.obs[0])


def test_time_limits_are_truncations_with_a_bootstrap_value() -> None:
    collector = _collector(num_envs=3, horizon=12, max_episode_steps=5)
    fragment = collector.collect()
    truncated = fragment.truncated
    assert truncated.any()
    assert fragment.dones[truncated].all()
    assert (fragment.final_values[truncated] != 0).all()
    assert (fragment.final_values[~truncated] == 0).all()
    ended = int(fragment.dones.sum())
    assert fragment.episode_returns.shape == (ended,)
    assert (fragment.episode_lengths <= 5).all()


def test_new_weights_change_the_policy_and_the_version() -> None:
    collector = _collector()
    env = collector.env
    other = build_model(ModelConfig(), env.single_observation_space, env.single_action_space)
    collector.set_weights(7, other.state_dict())
    assert collector.policy_version == 7
    assert collector.collect().policy_version == 7
    for name, value in other.get_weights().items():
        np.testing.assert_array_equal(collector.policy.get_weights()[name], value)


def test_unpaced_actor_is_always_allowed() -> None:
    pacer = Pacer(0.0)
    pacer.produced = 10**6
    assert pacer.allowed(0)


@given(
    st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0]),
    st.integers(0, 50),
    st.lists(st.integers(0, 3), min_size=1, max_size=40),
)
def test_a_paced_actor_stays_one_fragment_ahead_of_consumption(
    per_version: float, start: int, steps: list[int]
) -> None:
    pacer = Pacer(per_version)
    pacer.reset(start)
    version = start
    for step in steps:
        version += step
        while pacer.allowed(version):
            pacer.produced += 1
        consumed = (version - start + 1) * per_version
        assert pacer.produced <= consumed + 1
        assert pacer.produced >= consumed  # never starves its learner
        assert pacer.allowance(version) >= pacer.allowance(version - step)


@pytest.mark.parametrize("per_version", [1.0, 0.5])
def test_reset_on_registration_restarts_the_count(per_version: float) -> None:
    pacer = Pacer(per_version)
    pacer.produced = 5
    pacer.reset(40)
    assert pacer.produced == 0
    assert pacer.allowed(40)


def test_fragments_carry_observations_in_the_model_obs_dtype() -> None:
    env = make_vector("TokenRecall-v1", 2, seed=1)
    cfg = ModelConfig(
        family="causal-lm", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
        intermediate_size=64, max_positions=64,
    )  # fmt: skip
    policy = build_model(cfg, env.single_observation_space, env.single_action_space)
    fragment = Collector("lm", env, policy, 4, "hash", seed=1).collect()
    assert fragment.obs.dtype == np.int64
    assert fragment.obs.shape == (4, 2, *env.single_observation_space.shape)


def test_a_rollout_spec_whose_pipeline_is_not_a_bool_is_malformed() -> None:
    entry = {"name": "r", "env_id": "CartPole-v1", "num_envs": 2, "horizon": 8, "seed": 0}
    assert spec_from_json(entry).pipeline is False
    with pytest.raises(LearnerError, match="pipeline must be true or false, got 'yes'"):
        spec_from_json({**entry, "pipeline": "yes"})
