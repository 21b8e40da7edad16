"""The cnn family: uint8 images in either layout, scaled on the device; shapes, spec round
trip, auto selection, too-small images and non-image spaces refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium import spaces

from shoal.learner.errors import PolicyError
from shoal.learner.models import CNNPolicy, ModelConfig, build_model, model_from_spec


def image(*shape: int) -> spaces.Box:
    return spaces.Box(0, 255, shape=shape, dtype=np.uint8)


@pytest.mark.parametrize("shape", [(40, 44, 3), (4, 40, 44)])
def test_cnn_acts_on_uint8_images_in_either_layout(shape):
    torch.manual_seed(0)
    policy = build_model(
        ModelConfig(channels=(8, 16, 16), hidden=(32,)), image(*shape), spaces.Discrete(5)
    )
    assert isinstance(policy, CNNPolicy)
    assert policy.obs_dtype == np.uint8
    assert policy.channels_last == (shape[-1] == 3)
    obs = np.random.default_rng(0).integers(0, 256, size=(6, *shape), dtype=np.uint8)
    actions, logp, values = policy.act(obs)
    assert actions.shape == (6,)
    assert actions.dtype == np.int64
    assert logp.shape == values.shape == (6,)
    assert logp.dtype == values.dtype == np.float32
    logp2, entropy, values2 = policy(torch.from_numpy(obs), torch.from_numpy(actions))
    np.testing.assert_allclose(logp2.detach().numpy(), logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(values2.detach().numpy(), policy.value(obs), rtol=1e-5, atol=1e-5)
    assert (entropy > 0).all()
    logp2.sum().backward()
    assert policy.torso[0].weight.grad is not None


def test_cnn_scales_by_255_on_the_device():
    policy = CNNPolicy(image(36, 36, 1), spaces.Discrete(2), channels=(4, 4, 4), hidden=(8,))
    white = np.full((1, 36, 36, 1), 255, np.uint8)
    x = policy.prepare(torch.from_numpy(white))
    assert x.dtype == torch.float32
    assert x.shape == (1, 1, 36, 36)
    assert float(x.max()) == 1.0


def test_cnn_continuous_actions_spec_round_trip_and_checkpointing():
    torch.manual_seed(1)
    action_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
    policy = CNNPolicy(image(36, 36, 3), action_space, channels=(4, 8, 8), hidden=(16,))
    clone = model_from_spec(policy.spec())
    assert isinstance(clone, CNNPolicy)
    assert clone.spec() == policy.spec()
    clone.set_weights(policy.get_weights())
    obs = np.random.default_rng(1).integers(0, 256, size=(3, 36, 36, 3), dtype=np.uint8)
    np.testing.assert_array_equal(policy.value(obs), clone.value(obs))
    np.testing.assert_array_equal(policy.act(obs, True)[0], clone.act(obs, True)[0])
    clone.enable_activation_checkpointing()
    logp, _, values = clone(torch.from_numpy(obs), torch.zeros(3, 3))
    (logp.sum() + values.sum()).backward()
    assert all(p.grad is not None for p in clone.parameters())


def test_auto_is_cnn_only_for_uint8_images():
    assert isinstance(build_model(ModelConfig(), image(36, 36, 3), spaces.Discrete(2)), CNNPolicy)
    vector = spaces.Box(0, 255, (36, 36, 3), np.float32)
    assert not isinstance(build_model(ModelConfig(), vector, spaces.Discrete(2)), CNNPolicy)


def test_cnn_refuses_tiny_images_and_vectors():
    small = CNNPolicy(image(10, 10, 4), spaces.Discrete(3), channels=(4, 8), hidden=(8,))
    assert small.act(np.zeros((2, 10, 10, 4), np.uint8))[0].shape == (2,)  # MinAtar: 3x3 kernels
    with pytest.raises(PolicyError, match="too small"):
        CNNPolicy(image(2, 2, 3), spaces.Discrete(2), channels=(4, 8, 8, 8))
    with pytest.raises(PolicyError, match="image observations"):
        CNNPolicy(spaces.Box(0, 1, (36, 36, 3), np.float32), spaces.Discrete(2))
    policy = CNNPolicy(image(36, 36, 3), spaces.Discrete(2), channels=(4,), hidden=(8,))
    with pytest.raises(PolicyError, match="integer observations"):
        policy.act(np.zeros((1, 36, 36, 3), np.float32))
