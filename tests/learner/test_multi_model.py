"""The multi family on packed structured observations: MiniGrid's and BabyAI's observations go
forward and backward, `auto` picks it, a checkpoint spec (through JSON) rebuilds the same
network, and hostile packed specs are refused before anything is built."""

from __future__ import annotations

import json
from typing import Any

import gymnasium
import minigrid  # noqa: F401  (registers the ids)
import numpy as np
import pytest
import torch
from gymnasium import spaces

from shoal.envs.packed_obs import MAX_NESTING, MAX_PARTS, PackedBox, PackObservation, pack
from shoal.learner.errors import PolicyError
from shoal.learner.models import ModelConfig, build_model, model_from_spec, space_from_json
from shoal.learner.models.multi import MultiPolicy


def _observations(env_id: str, n: int) -> tuple[PackObservation, np.ndarray]:
    env = PackObservation(gymnasium.make(env_id))
    obs = np.stack([env.reset(seed=i)[0] for i in range(n)])
    return env, obs


@pytest.mark.parametrize("env_id", ["MiniGrid-DoorKey-5x5-v0", "BabyAI-GoToRedBall-v0"])
def test_minigrid_observations_go_forward_and_backward(env_id: str) -> None:
    torch.manual_seed(0)
    env, obs = _observations(env_id, 6)
    policy = build_model(ModelConfig(), env.observation_space, env.action_space)
    assert isinstance(policy, MultiPolicy)
    assert policy.obs_dtype == np.uint8
    actions, logp, values = policy.act(obs)
    assert actions.shape == (6,)
    assert ((actions >= 0) & (actions < 7)).all()
    assert np.isfinite(logp).all()
    assert np.isfinite(values).all()
    logp_t, entropy, values_t = policy(torch.from_numpy(obs), torch.from_numpy(actions))
    (logp_t.sum() + entropy.sum() + values_t.sum()).backward()
    grads = {name: p.grad for name, p in policy.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    # Every part's encoder with weights learns from the loss: the grid's and the text's.
    assert grads["encoders.1.embed.weight"].abs().sum() > 0
    assert grads["encoders.2.gru.weight_ih_l0"].abs().sum() > 0
    env.close()


def test_a_checkpoint_spec_rebuilds_the_same_network_through_json() -> None:
    env, obs = _observations("MiniGrid-DoorKey-5x5-v0", 4)
    policy = build_model(ModelConfig(hidden=(32,)), env.observation_space, env.action_space)
    spec = json.loads(json.dumps(policy.spec()))
    assert spec["family"] == "multi"
    assert spec["observation_space"]["type"] == "packed"
    rebuilt = model_from_spec(spec)
    rebuilt.set_weights(policy.get_weights())
    assert rebuilt.observation_space == policy.observation_space
    np.testing.assert_allclose(rebuilt.value(obs), policy.value(obs), rtol=1e-6)
    env.close()


def test_texts_of_different_lengths_in_one_batch_are_each_read_to_their_last_byte() -> None:
    structure = spaces.Dict({"say": spaces.Text(max_length=16)})
    space = PackedBox(structure)
    policy = MultiPolicy(space, spaces.Discrete(2), (8,))
    texts = ["go", "go left", "", "go"]
    batch = np.stack([pack(space.layout, {"say": t}) for t in texts])
    one_by_one = np.concatenate([policy.value(row[None]) for row in batch])
    np.testing.assert_allclose(policy.value(batch), one_by_one, rtol=1e-5, atol=1e-6)
    assert policy.value(batch)[0] == policy.value(batch)[3]


def test_float_parts_large_images_and_box_actions_fit_one_policy() -> None:
    structure = spaces.Tuple(
        (
            spaces.Box(0, 255, (3, 40, 40), np.uint8),
            spaces.Box(-1.0, 1.0, (5,), np.float32),
            spaces.MultiDiscrete([3, 300]),
        )
    )
    space = PackedBox(structure)
    assert space.dtype == np.float32
    policy = build_model(ModelConfig(hidden=(16,)), space, spaces.Box(-1, 1, (2,)))
    image = policy.encoders[0]
    assert image.large
    assert image.out_features == 512
    assert policy.encoders[2].out_features == 303
    obs = np.stack([space.sample() for _ in range(3)])
    actions, _, _ = policy.act(obs)
    assert actions.shape == (3, 2)
    logp, _, _ = policy(torch.from_numpy(obs), torch.from_numpy(actions))
    logp.sum().backward()


def test_the_multi_family_refuses_an_unpacked_space() -> None:
    with pytest.raises(PolicyError, match="needs a packed structured observation"):
        build_model(ModelConfig(family="multi"), spaces.Box(0, 1, (4,)), spaces.Discrete(2))


def _packed(structure: Any) -> dict[str, Any]:
    return {"type": "packed", "structure": structure}


_DISCRETE = {"type": "discrete", "n": 2, "start": 0}


def _nested(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = _DISCRETE
    for _ in range(levels):
        node = {"type": "tuple", "spaces": [node]}
    return node


@pytest.mark.parametrize(
    ("structure", "message"),
    [
        ({"type": "tuple", "spaces": [_DISCRETE] * (MAX_PARTS + 1)}, "a list of 1 to 64 spaces"),
        (_nested(MAX_NESTING + 1), "nested at most 4 deep"),
        ({"type": "dict", "spaces": [["k", _DISCRETE, "extra"]]}, "must be \\[key, space\\]"),
        ({"type": "dict", "spaces": [["x" * 201, _DISCRETE]]}, "a key of 1 to 200 characters"),
        ({"type": "text", "length": 10_000}, "space.length = 10000 is invalid"),
        ({"type": "packed", "structure": _DISCRETE}, "space of type 'packed'"),
        ({"type": "discrete", "n": 1 << 20, "start": 0}, "more than 65536 categories"),
        ("not an object", "not an object"),
        (
            {
                "type": "tuple",
                "spaces": [
                    {"type": "box", "shape": [4096, 4096], "dtype": "uint8", "low": 0, "high": 255}
                ]
                * 2,
            },
            "more than 16777216 elements",
        ),
    ],
)
def test_hostile_packed_specs_are_refused_before_anything_is_built(
    structure: Any, message: str
) -> None:
    with pytest.raises(PolicyError, match=message):
        space_from_json(_packed(structure))
