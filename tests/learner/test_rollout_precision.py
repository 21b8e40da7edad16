"""`rollout.precision = "bfloat16"`: every built-in family samples in bfloat16 on a rollout
worker while the learner's copy stays float32. Actions, log-probs and values leave `act` as the
float32 arrays a fragment stores, close to the float32 policy's; float32 weights from the learner
load into the bfloat16 copy; the setting travels from the job to the rollout spec; an unknown
precision and a custom family that ignores `compute_dtype` are refused with a PolicyError."""

from __future__ import annotations

from typing import Any

import gymnasium
import minigrid  # noqa: F401  (registers the ids)
import numpy as np
import pytest
import torch
from gymnasium import spaces
from torch import nn

from shoal.config import load
from shoal.envs.packed_obs import PackObservation
from shoal.errors import ConfigError
from shoal.learner.collector import Collector
from shoal.learner.config import RolloutConfig
from shoal.learner.errors import LearnerError, PolicyError
from shoal.learner.models import ModelConfig, build_model
from shoal.learner.models.base import PolicyModel
from shoal.learner.rollout import _collector as rollout_collector
from shoal.learner.rollout_main import spec_from_json


def _pair(obs_space: spaces.Space[Any], action_space: spaces.Space[Any]) -> tuple[Any, Any]:
    """A float32 policy and a bfloat16 copy carrying the same (float32) weights."""
    torch.manual_seed(0)
    full = build_model(ModelConfig(), obs_space, action_space)
    half = build_model(ModelConfig(), obs_space, action_space).run_in("bfloat16")
    half.set_weights(full.get_weights())
    return full, half


def _families() -> list[tuple[str, spaces.Space[Any], spaces.Space[Any], np.ndarray]]:
    rng = np.random.default_rng(0)
    pixels = spaces.Box(0, 255, (4, 84, 84), np.uint8)
    vector = spaces.Box(-5, 5, (17,), np.float32)
    grid = PackObservation(gymnasium.make("BabyAI-GoToRedBall-v0"))
    grid_obs = np.stack([grid.reset(seed=i)[0] for i in range(4)])
    packed = grid.observation_space
    grid.close()
    return [
        ("cnn", pixels, spaces.Discrete(6), rng.integers(0, 256, (4, 4, 84, 84), np.uint8)),
        ("mlp", vector, spaces.Box(-1, 1, (6,), np.float32), rng.normal(size=(4, 17)).astype(np.float32)),
        ("multi", packed, spaces.Discrete(7), grid_obs),
    ]  # fmt: skip


@pytest.mark.parametrize("case", _families(), ids=lambda c: c[0])
def test_a_bfloat16_copy_samples_float32_outputs_close_to_the_float32_policy(case: Any) -> None:
    family, obs_space, action_space, obs = case
    full, half = _pair(obs_space, action_space)
    assert half.family == family
    assert half.compute_dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    assert all(p.dtype == torch.float32 for p in full.parameters())
    actions, logp, values = half.act(obs, deterministic=True)
    assert logp.dtype == np.float32
    assert values.dtype == np.float32
    assert actions.dtype == (np.int64 if half.discrete else np.float32)
    assert np.isfinite(logp).all()
    assert np.isfinite(values).all()
    # The learner's float32 view of the same actions: what π_prox/μ compares.
    with torch.no_grad():
        full_logp, _, full_values = full(torch.from_numpy(obs), torch.from_numpy(actions))
    np.testing.assert_allclose(logp, full_logp.numpy(), atol=0.05)
    np.testing.assert_allclose(values, full_values.numpy(), atol=0.05)
    np.testing.assert_allclose(half.value(obs), values, atol=1e-6)


def test_float32_weights_from_the_learner_replace_a_bfloat16_copy() -> None:
    obs_space, action_space = spaces.Box(0, 255, (4, 84, 84), np.uint8), spaces.Discrete(6)
    _, half = _pair(obs_space, action_space)
    torch.manual_seed(1)
    newer = build_model(ModelConfig(), obs_space, action_space)
    half.set_weights(newer.get_weights())
    for name, tensor in half.state_dict().items():
        assert tensor.dtype == torch.bfloat16
        expected = torch.from_numpy(newer.get_weights()[name]).to(torch.bfloat16)
        assert torch.equal(tensor, expected), name


def test_float32_is_a_no_op_and_an_unknown_precision_is_refused() -> None:
    policy = build_model(ModelConfig(), spaces.Box(-1, 1, (4,), np.float32), spaces.Discrete(2))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    assert policy.run_in("float32") is policy
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())
    with pytest.raises(PolicyError, match="unknown precision 'float16'"):
        policy.run_in("float16")


class _Float32Only(PolicyModel):
    """A custom family that casts its inputs to float32 whatever its weights are."""

    def __init__(self, obs_space: spaces.Space[Any], action_space: spaces.Space[Any]) -> None:
        super().__init__(obs_space, action_space, np.float32)
        self.net = nn.Linear(self.obs_shape[0], self.action_dim + 1)

    def prepare(self, obs: torch.Tensor) -> torch.Tensor:
        return obs.to(torch.float32)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(x)
        return out[:, :-1], out[:, -1]

    def shard_units(self) -> list[nn.Module]:
        return [self.net]


def test_a_family_that_ignores_compute_dtype_fails_on_the_probe_not_in_a_fragment() -> None:
    policy = _Float32Only(spaces.Box(-1, 1, (4,), np.float32), spaces.Discrete(2))
    with pytest.raises(PolicyError, match=r'rollout\.precision = "float32"'):
        policy.run_in("bfloat16")


def test_the_setting_travels_from_the_job_toml_to_the_rollout_spec() -> None:
    cfg = load(RolloutConfig, {"precision": "bfloat16"}, source="job.toml", environ={})
    assert cfg.precision == "bfloat16"
    with pytest.raises(ConfigError, match="precision = 'fp8' is invalid"):
        load(RolloutConfig, {"precision": "fp8"}, source="job.toml", environ={})
    base = {"name": "r", "env_id": "CartPole-v1", "num_envs": 2, "horizon": 4, "seed": 0}
    assert spec_from_json(base).precision == "float32"
    assert spec_from_json({**base, "precision": "bfloat16"}).precision == "bfloat16"
    for bad in ("fp8", 16, ["bfloat16"]):
        with pytest.raises(LearnerError, match="precision must be one of float32, bfloat16"):
            spec_from_json({**base, "precision": bad})


@pytest.mark.parametrize(
    ("env_id", "model"),
    [
        ("CartPole-v1", {}),
        ("TokenRecall-v1", {
            "family": "causal-lm", "hidden_size": 32, "num_layers": 1, "num_heads": 2,
            "num_kv_heads": 1, "intermediate_size": 64, "max_positions": 64,
        }),
    ],
)  # fmt: skip
def test_a_rollout_actors_collector_samples_in_the_specs_precision(
    env_id: str, model: dict[str, Any]
) -> None:
    spec = spec_from_json(
        {"name": "r", "env_id": env_id, "num_envs": 3, "horizon": 4, "seed": 0,
         "model": model, "precision": "bfloat16"}
    )  # fmt: skip
    collector = rollout_collector(spec, "r", ModelConfig(**model), 1 << 24)
    assert isinstance(collector, Collector)
    try:
        assert next(collector.policy.parameters()).dtype == torch.bfloat16
        fragment = collector.collect()
        assert fragment.logprobs.dtype == np.float32
        assert fragment.values.dtype == np.float32
        assert np.isfinite(fragment.logprobs).all()
        assert (fragment.logprobs <= 0).all()
        assert np.isfinite(fragment.values).all()
    finally:
        collector.env.close()
