"""PPOLearner: the correction reduces to plain PPO on-policy, losses fall, hooks and checks."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gymnasium import spaces
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import ConfigError
from shoal.learner.errors import BadFragment
from shoal.learner.fragment import Fragment
from shoal.learner.models.mlp import MLPPolicy
from shoal.learner.ppo import PPOConfig, PPOLearner, build_batch, lag_stats

DISCRETE = spaces.Discrete(2)


def mlp_policy(obs_shape: tuple[int, ...], action_space: spaces.Space) -> MLPPolicy:
    """The MLP family on an unbounded Box of `obs_shape`."""
    return MLPPolicy(spaces.Box(-np.inf, np.inf, obs_shape, np.float32), action_space)


def rollout(
    policy: MLPPolicy, version: int = 0, t: int = 16, n: int = 8, seed: int = 0
) -> Fragment:
    """A fragment whose actions, log-probs and values really come from `policy`."""
    rng = np.random.default_rng(seed)
    obs = rng.normal(size=(t, n, 4)).astype(np.float32)
    acts, logps, vals = zip(*(policy.act(o) for o in obs))
    actions = np.stack(acts)
    # reward action 1 in states whose first feature is positive: something to learn
    rewards = ((actions == 1) == (obs[..., 0] > 0)).astype(np.float32)
    dones = rng.random((t, n)) < 0.1
    return Fragment(
        actor_id="a", seq=0, policy_version=version, env_hash="h", obs=obs, actions=actions,
        logprobs=np.stack(logps), values=np.stack(vals), rewards=rewards, dones=dones,
        truncated=np.zeros((t, n), bool), bootstrap_value=np.zeros(n, np.float32),
        final_values=np.zeros((t, n), np.float32), episode_returns=np.zeros(0, np.float32),
        episode_lengths=np.zeros(0, np.int32),
    )  # fmt: skip


def plain_ppo_loss(model: MLPPolicy, frag: Fragment, cfg: PPOConfig) -> float:
    """CleanRL's PPO loss on the whole batch, ratio taken against the behaviour log-probs."""
    b = build_batch([frag], cfg, torch.device("cpu"))
    with torch.no_grad():
        new_logp, entropy, new_v = model(b.obs, b.actions)
    ratio = (new_logp - b.behaviour_logp).exp()
    adv = (b.advantages - b.advantages.mean()) / (b.advantages.std() + 1e-8)
    pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)).mean()
    v_clip = b.values + (new_v - b.values).clamp(-cfg.clip_coef, cfg.clip_coef)
    v_loss = 0.5 * torch.max((new_v - b.returns) ** 2, (v_clip - b.returns) ** 2).mean()
    return (pg - cfg.ent_coef * entropy.mean() + cfg.vf_coef * v_loss).item()


def test_on_policy_the_correction_is_plain_ppo():
    torch.manual_seed(0)
    model = mlp_policy((4,), DISCRETE)
    frag = rollout(model, version=5)
    cfg = PPOConfig(update_epochs=1, num_minibatches=1)
    expected = plain_ppo_loss(model, frag, cfg)
    metrics = PPOLearner(model, cfg).update([frag], current_version=5)
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["is_weight_capped_frac"] == 0.0
    assert metrics["policy_lag_median"] == 0.0


def test_stale_data_is_reweighted_and_the_trust_region_is_around_the_learner():
    torch.manual_seed(0)
    old = mlp_policy((4,), DISCRETE)
    model = copy.deepcopy(old)
    with torch.no_grad():
        for p in model.actor.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    frag = rollout(old, version=1)
    cfg = PPOConfig(update_epochs=1, num_minibatches=1, is_cap=1.5)
    metrics = PPOLearner(model, cfg).update([frag], current_version=3)
    # the first (only) minibatch starts at π_θ = π_prox: no ratio is clipped, KL is zero
    assert metrics["clipfrac"] == 0.0
    assert metrics["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["is_weight_mean"] != pytest.approx(1.0, abs=1e-3)
    assert metrics["is_weight_capped_frac"] > 0
    assert metrics["policy_lag_median"] == 2.0
    # plain PPO would have measured the ratio against the old behaviour policy and clipped
    b = build_batch([frag], cfg, torch.device("cpu"))
    with torch.no_grad():
        logp, _, _ = old(b.obs, b.actions)
        moved, _, _ = copy.deepcopy(model)(b.obs, b.actions)
    behaviour_ratio = (moved - logp).exp()
    assert ((behaviour_ratio - 1).abs() > cfg.clip_coef).any()


def test_repeated_updates_on_a_fixed_batch_lower_the_value_loss_and_learn_the_rewarded_action():
    torch.manual_seed(0)
    model = mlp_policy((4,), DISCRETE)
    frag = rollout(model, t=32, n=8)
    learner = PPOLearner(model, PPOConfig(lr=3e-3))
    obs = frag.obs.reshape(-1, 4)

    def p_rewarded() -> float:
        with torch.no_grad():
            rewarded = torch.from_numpy((obs[:, 0] > 0).astype(np.int64))
            logp, _, _ = model(torch.from_numpy(obs), rewarded)
            return float(logp.exp().mean())

    before = p_rewarded()
    first = learner.update([frag], current_version=0)
    for _ in range(15):
        last = learner.update([frag], current_version=0)
    assert last["value_loss"] < first["value_loss"]
    assert p_rewarded() > before + 0.1


def test_every_forward_goes_through_the_wrapper_that_reduces_gradients():
    """DDP and FSDP2 hook the wrapper's __call__; the policy itself only checks fragments."""
    torch.manual_seed(0)
    model = mlp_policy((4,), DISCRETE)
    frag = rollout(model)
    calls: list[bool] = []

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = model

        def forward(self, obs: torch.Tensor, actions: torch.Tensor):
            calls.append(torch.is_grad_enabled())
            return self.module(obs, actions)

    cfg = PPOConfig(update_epochs=3, num_minibatches=2)
    metrics = PPOLearner(Wrapper(), cfg, policy=model).update([frag], 0)
    assert calls == [False] * 2 + [True] * 6  # proximal log-probs, then 3 epochs × 2 minibatches
    assert metrics["epochs"] == 3.0


def test_target_kl_stops_early_and_asks_kl_sync_once_per_epoch():
    torch.manual_seed(0)
    model = mlp_policy((4,), DISCRETE)
    frag = rollout(model)
    cfg = PPOConfig(lr=1e-2, target_kl=1e-9, update_epochs=4)
    assert PPOLearner(model, cfg).update([frag], 0)["epochs"] == 1.0
    synced: list[float] = []

    def kl_sync(kl: torch.Tensor) -> torch.Tensor:
        synced.append(float(kl))
        return kl

    PPOLearner(model, cfg).update([frag], 0, kl_sync=kl_sync)
    assert len(synced) == 1


def test_continuous_actions_update():
    torch.manual_seed(0)
    box = spaces.Box(-1, 1, (2,), np.float32)
    model = mlp_policy((4,), box)
    rng = np.random.default_rng(0)
    t, n = 8, 4
    obs = rng.normal(size=(t, n, 4)).astype(np.float32)
    acts, logps, vals = zip(*(model.act(o) for o in obs))
    frag = Fragment(
        actor_id="c", seq=0, policy_version=0, env_hash="h", obs=obs, actions=np.stack(acts),
        logprobs=np.stack(logps), values=np.stack(vals), rewards=np.ones((t, n), np.float32),
        dones=np.zeros((t, n), bool), truncated=np.zeros((t, n), bool),
        bootstrap_value=np.zeros(n, np.float32), final_values=np.zeros((t, n), np.float32),
        episode_returns=np.zeros(0, np.float32), episode_lengths=np.zeros(0, np.int32),
    )  # fmt: skip
    metrics = PPOLearner(model, PPOConfig()).update([frag], 0)
    assert np.isfinite(metrics["loss"])
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)


def test_lag_stats_histogram_and_future_versions():
    model = mlp_policy((4,), DISCRETE)
    frags = [rollout(model, version=v, t=2, n=2) for v in (10, 9, 9, 7, 3, 0)]
    stats = lag_stats(frags, 10)
    assert stats["policy_lag_median"] == 2.0
    assert stats["policy_lag_max"] == 10.0
    assert [stats[f"policy_lag_hist_{k}"] for k in ("0", "1", "2", "3_4", "5_8", "9+")] == [
        1.0, 2.0, 0.0, 1.0, 1.0, 1.0,
    ]  # fmt: skip
    with pytest.raises(BadFragment, match="newer than the learner's 5"):
        lag_stats(frags, 5)


def test_update_refuses_empty_mixed_and_tiny_batches():
    model = mlp_policy((4,), DISCRETE)
    learner = PPOLearner(model, PPOConfig())
    with pytest.raises(BadFragment, match="at least one fragment"):
        learner.update([], 0)
    other = rollout(model, t=2, n=2)
    other.obs = np.zeros((2, 2, 3), np.float32)
    with pytest.raises(BadFragment, match="must come from one env"):
        learner.update([rollout(model), other], 0)
    with pytest.raises(BadFragment, match=r"fewer than ppo\.num_minibatches"):
        learner.update([rollout(model, t=1, n=2)], 0)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("lr", 0.0, "ppo.lr = 0.0 is invalid: use a number > 0"),
        ("lr", float("nan"), "ppo.lr = nan is invalid: use a finite number"),
        ("gamma", 1.5, "ppo.gamma = 1.5 is invalid: use a number in [0, 1]"),
        ("gae_lambda", -0.1, "ppo.gae_lambda = -0.1 is invalid"),
        ("update_epochs", 0, "ppo.update_epochs = 0 is invalid: use an integer >= 1"),
        ("num_minibatches", 2.5, "ppo.num_minibatches = 2.5 is invalid"),
        ("ent_coef", -1.0, "ppo.ent_coef = -1.0 is invalid: use a number >= 0"),
        ("target_kl", 0.0, "ppo.target_kl = 0.0 is invalid"),
        ("is_cap", 0.5, "ppo.is_cap = 0.5 is invalid: use a finite number >= 1"),
        ("clip_coef", True, "ppo.clip_coef = True is invalid"),
    ],
)
def test_config_rejects_bad_values_naming_the_key(key, value, message):
    with pytest.raises(ConfigError) as info:
        PPOConfig(**{key: value})
    assert message in str(info.value)


def test_fragments_from_another_environment_are_refused():
    model = mlp_policy((4,), DISCRETE)
    other = mlp_policy((3,), DISCRETE)
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(4, 2, 3)).astype(np.float32)
    acts, logps, vals = zip(*(other.act(o) for o in obs))
    frag = Fragment(
        actor_id="x", seq=0, policy_version=0, env_hash="h", obs=obs, actions=np.stack(acts),
        logprobs=np.stack(logps), values=np.stack(vals), rewards=np.ones((4, 2), np.float32),
        dones=np.zeros((4, 2), bool), truncated=np.zeros((4, 2), bool),
        bootstrap_value=np.zeros(2, np.float32), final_values=np.zeros((4, 2), np.float32),
        episode_returns=np.zeros(0, np.float32), episode_lengths=np.zeros(0, np.int32),
    )  # fmt: skip
    with pytest.raises(BadFragment, match="does not fit the mlp policy"):
        PPOLearner(model, PPOConfig()).update([frag], 0)
    box_model = mlp_policy((3,), spaces.Box(-1, 1, (2,), np.float32))
    with pytest.raises(BadFragment, match="continuous actions of size 2"):
        PPOLearner(box_model, PPOConfig()).update([frag], 0)


@given(lags=st.lists(st.integers(0, 40), min_size=1, max_size=12))
@settings(max_examples=40, deadline=None)
def test_lag_histogram_counts_every_fragment_once(lags):
    model = mlp_policy((4,), DISCRETE)
    current = 50
    frags = [rollout(model, version=current - lag, t=1, n=1) for lag in lags]
    stats = lag_stats(frags, current)
    hist = [v for k, v in stats.items() if k.startswith("policy_lag_hist_")]
    assert sum(hist) == len(lags)
    assert min(lags) <= stats["policy_lag_median"] <= max(lags)
    assert stats["policy_lag_max"] == max(lags)
