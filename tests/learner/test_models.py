"""The MLP family and what every PolicyModel shares: shapes and dtypes of act/forward/value,
log-prob consistency, weights on the wire (numpy, torch, bfloat16), specs (also the former
ActorCritic's), the fragment check, and bit-identity with the former ActorCritic."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gymnasium import spaces
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shoal.learner.errors import BadFragment, PolicyError
from shoal.learner.fragment import Fragment
from shoal.learner.models import MLPPolicy, ModelConfig, build_model, model_from_spec

DISCRETE = spaces.Discrete(3)
BOX = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)


def obs_space(*shape: int) -> spaces.Box:
    return spaces.Box(-np.inf, np.inf, shape=shape, dtype=np.float32)


@given(batch=st.integers(1, 64), box=st.booleans(), deterministic=st.booleans())
@settings(max_examples=25, deadline=None)
def test_act_shapes_dtypes_and_logprobs_match_forward(batch, box, deterministic):
    torch.manual_seed(0)
    policy = MLPPolicy(obs_space(4), BOX if box else DISCRETE)
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
    logp2, entropy, values2 = policy(torch.from_numpy(obs), torch.from_numpy(actions))
    np.testing.assert_allclose(logp2.detach().numpy(), logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(values2.detach().numpy(), values, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(policy.value(obs), values, rtol=1e-5, atol=1e-5)
    assert entropy.shape == (batch,)
    assert (entropy.detach() > 0).all()
    assert logp2.requires_grad
    assert values2.requires_grad


def _former_init(n_in: int, n_out: int, hidden: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """The former ActorCritic's initialisation, step by step (same layers, same order, same
    draws from torch's generator): the policy MLP, then the value MLP."""
    weights: dict[str, torch.Tensor] = {}
    for net, last, gain in (("actor", n_out, 0.01), ("critic", 1, 1.0)):
        width = n_in
        for i, size in enumerate((*hidden, last)):
            layer = nn.Linear(width, size)
            nn.init.orthogonal_(layer.weight, math.sqrt(2.0) if i < len(hidden) else gain)
            nn.init.constant_(layer.bias, 0.0)
            weights[f"{net}.{2 * i}.weight"], weights[f"{net}.{2 * i}.bias"] = (
                layer.weight,
                layer.bias,
            )
            width = size
    return weights


def _former_net(weights: dict[str, torch.Tensor], net: str, x: torch.Tensor) -> torch.Tensor:
    layers = sorted({int(k.split(".")[1]) for k in weights if k.startswith(net)})
    for i in layers:
        x = F.linear(x, weights[f"{net}.{i}.weight"], weights[f"{net}.{i}.bias"])
        x = torch.tanh(x) if i != layers[-1] else x
    return x


@pytest.mark.parametrize("kind", ["discrete", "box"])
def test_mlp_is_bit_identical_to_the_former_actor_critic(kind):
    space = DISCRETE if kind == "discrete" else BOX
    torch.manual_seed(7)
    expected = _former_init(4, 3 if kind == "discrete" else 2, (64, 64))
    torch.manual_seed(7)
    policy = build_model(ModelConfig(), obs_space(4), space)
    assert isinstance(policy, MLPPolicy)
    names = [*expected] if kind == "discrete" else ["log_std", *expected]
    assert list(policy.state_dict()) == names
    for name, tensor in expected.items():
        assert torch.equal(policy.state_dict()[name], tensor), name
    obs = np.linspace(-1, 1, 20, dtype=np.float32).reshape(5, 4)
    x = torch.from_numpy(obs)
    torch.manual_seed(3)
    actions, logp, values = policy.act(obs)
    torch.manual_seed(3)
    out = _former_net(expected, "actor", x)
    np.testing.assert_array_equal(values, _former_net(expected, "critic", x).squeeze(-1).detach())
    if kind == "discrete":
        log_probs = torch.log_softmax(out, dim=-1)
        u = torch.rand(5, 1)
        taken = (log_probs.exp().cumsum(-1) < u).sum(-1).clamp_(max=2)
        np.testing.assert_array_equal(actions, taken)
        np.testing.assert_array_equal(logp, log_probs.gather(-1, taken[:, None])[:, 0].detach())
    else:
        sampled = out + torch.randn_like(out)  # log_std starts at 0: std 1
        np.testing.assert_array_equal(actions, sampled.detach())
        z = sampled - out
        np.testing.assert_array_equal(
            logp, (-0.5 * z.pow(2) - 0.5 * math.log(2 * math.pi)).sum(-1).detach()
        )


def test_initial_policy_is_near_uniform_and_value_near_zero():
    policy = MLPPolicy(obs_space(4), DISCRETE)
    obs = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
    _, logp, values = policy.act(obs)
    np.testing.assert_allclose(logp, np.log(1 / 3), atol=0.05)
    assert np.abs(values).mean() < 5.0


def test_multi_dimensional_observations_are_flattened():
    policy = MLPPolicy(obs_space(2, 3), DISCRETE)
    actions, _, _ = policy.act(np.zeros((5, 2, 3), np.float32))
    assert actions.shape == (5,)
    assert policy.act(np.zeros((5, 6), np.float64))[0].shape == (5,)


def test_weights_round_trip_into_a_fresh_policy():
    torch.manual_seed(1)
    source = MLPPolicy(obs_space(4), BOX)
    torch.manual_seed(2)
    target = MLPPolicy(obs_space(4), BOX)
    target.set_weights(source.get_weights())
    obs = np.ones((3, 4), np.float32)
    np.testing.assert_array_equal(source.value(obs), target.value(obs))
    np.testing.assert_array_equal(source.act(obs, True)[0], target.act(obs, True)[0])


def test_set_weights_takes_torch_tensors_and_bfloat16():
    source = MLPPolicy(obs_space(4), DISCRETE)
    target = MLPPolicy(obs_space(4), DISCRETE)
    target.set_weights(dict(source.state_dict()))
    obs = np.ones((3, 4), np.float32)
    np.testing.assert_array_equal(source.value(obs), target.value(obs))
    target.set_weights({k: v.to(torch.bfloat16) for k, v in source.state_dict().items()})
    for name, tensor in target.state_dict().items():
        assert tensor.dtype == torch.float32
        expected = source.state_dict()[name].to(torch.bfloat16).float()
        assert torch.equal(tensor, expected)


def test_get_weights_is_a_copy():
    policy = MLPPolicy(obs_space(4), DISCRETE)
    weights = policy.get_weights()
    before = weights["critic.0.weight"].copy()
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    np.testing.assert_array_equal(weights["critic.0.weight"], before)


@pytest.mark.parametrize("space", [DISCRETE, BOX])
def test_spec_rebuilds_the_same_architecture(space):
    policy = MLPPolicy(spaces.Box(-2.0, 3.0, (4,), np.float32), space, hidden=(8, 8))
    clone = model_from_spec(policy.spec())
    assert isinstance(clone, MLPPolicy)
    assert clone.spec() == policy.spec()
    clone.set_weights(policy.get_weights())
    obs = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(policy.value(obs), clone.value(obs))
    np.testing.assert_array_equal(policy.act(obs, True)[1], clone.act(obs, True)[1])


def test_specs_of_the_former_actor_critic_still_load():
    box = {"kind": "box", "low": [-1.0, float("-inf")], "high": [1.0, float("inf")]}
    for legacy in (
        {"obs_shape": [4], "action_space": {"kind": "discrete", "n": 2}, "hidden": [64, 64]},
        {"obs_shape": [3], "action_space": box, "hidden": [16]},
    ):
        policy = model_from_spec(legacy)
        assert isinstance(policy, MLPPolicy)
        assert policy.obs_shape == tuple(legacy["obs_shape"])
        assert policy.hidden == tuple(legacy["hidden"])
    with pytest.raises(PolicyError, match="malformed policy spec"):
        model_from_spec({"obs_shape": [4]})
    with pytest.raises(PolicyError, match="kind"):
        model_from_spec({"obs_shape": [4], "action_space": {"kind": "tuple"}, "hidden": [4]})


def test_bad_inputs_raise_policy_error():
    policy = MLPPolicy(obs_space(4), DISCRETE)
    with pytest.raises(PolicyError, match=r"observations must be \[B, 4\]"):
        policy.act(np.zeros((2, 5), np.float32))
    weights = policy.get_weights()
    weights["critic.0.weight"] = np.zeros((1, 1), np.float32)
    with pytest.raises(PolicyError, match=r"'critic\.0\.weight' has shape"):
        policy.set_weights(weights)
    weights["critic.0.weight"] = np.array([["x"]])
    with pytest.raises(PolicyError, match=r"'critic\.0\.weight' has dtype"):
        policy.set_weights(weights)
    with pytest.raises(PolicyError, match="missing"):
        policy.set_weights({})
    with pytest.raises(PolicyError, match="Discrete or 1-D Box"):
        MLPPolicy(obs_space(4), spaces.MultiBinary(3))
    with pytest.raises(PolicyError, match="non-empty shape"):
        MLPPolicy(spaces.Discrete(4), DISCRETE)
    with pytest.raises(PolicyError, match="hidden"):
        MLPPolicy(obs_space(4), DISCRETE, hidden=())


def test_sampled_actions_follow_the_policy_probabilities():
    torch.manual_seed(0)
    policy = MLPPolicy(obs_space(4), DISCRETE)
    target = torch.tensor([0.2, 0.5, 0.3])
    with torch.no_grad():
        head = policy.actor[-1]
        head.weight.zero_()
        head.bias.copy_(target.log())
    actions, logp, _ = policy.act(np.zeros((40_000, 4), np.float32))
    freq = np.bincount(actions, minlength=3) / actions.size
    np.testing.assert_allclose(freq, target.numpy(), atol=0.015)
    np.testing.assert_allclose(logp, np.log(target.numpy())[actions], rtol=1e-5)


def test_check_fragment_refuses_another_environments_data():
    policy = MLPPolicy(obs_space(4), DISCRETE)
    good = np.zeros((2, 3), np.int64)
    policy.check_fragment((4,), good)
    policy.check_fragment((4,), good, np.dtype(np.float32))
    for obs_shape, actions, dtype in (
        ((5,), good, None),
        ((4,), np.zeros((2, 3, 2), np.float32), None),
        ((4,), np.full((2, 3), 3, np.int64), None),
        ((4,), np.full((2, 3), -1, np.int64), None),
        ((4,), good, np.dtype(np.uint8)),
    ):
        with pytest.raises(BadFragment, match="does not fit the mlp policy"):
            policy.check_fragment(obs_shape, actions, dtype)
    continuous = MLPPolicy(obs_space(4), BOX)
    continuous.check_fragment((4,), np.zeros((2, 3, 2), np.float32))
    with pytest.raises(BadFragment, match="continuous actions of size 2"):
        continuous.check_fragment((4,), np.zeros((2, 3, 3), np.float32))


def test_activation_checkpointing_keeps_names_and_gradients():
    torch.manual_seed(0)
    plain = MLPPolicy(obs_space(4), DISCRETE)
    checkpointed = MLPPolicy(obs_space(4), DISCRETE)
    checkpointed.set_weights(plain.get_weights())
    checkpointed.enable_activation_checkpointing()
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    assert [u for u in checkpointed.shard_units()] == [checkpointed.actor, checkpointed.critic]
    obs = torch.randn(6, 4)
    actions = torch.tensor([0, 1, 2, 0, 1, 2])
    for model in (plain, checkpointed):
        logp, entropy, values = model(obs, actions)
        (logp.sum() + entropy.sum() + values.sum()).backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    np.testing.assert_array_equal(plain.value(obs.numpy()), checkpointed.value(obs.numpy()))


def _fragment(obs: np.ndarray) -> Fragment:
    t, n = obs.shape[:2]
    f32 = np.zeros((t, n), np.float32)
    return Fragment(
        actor_id="a", seq=0, policy_version=0, env_hash="h", obs=obs,
        actions=np.zeros((t, n), np.int64), logprobs=f32, values=f32, rewards=f32,
        dones=np.zeros((t, n), bool), truncated=np.zeros((t, n), bool),
        bootstrap_value=np.zeros(n, np.float32), final_values=f32,
        episode_returns=np.zeros(0, np.float32), episode_lengths=np.zeros(0, np.int32),
    )  # fmt: skip


def test_fragments_carry_float32_uint8_and_int64_observations_only():
    for dtype in (np.float32, np.uint8, np.int64):
        frag = Fragment.from_wire(_fragment(np.zeros((2, 3, 4), dtype)).to_wire())
        assert frag.obs.dtype == dtype
    for dtype in (np.float64, np.int32, np.bool_, np.float16):
        with pytest.raises(BadFragment, match="float32, uint8 or int64"):
            _fragment(np.zeros((2, 3, 4), dtype))
