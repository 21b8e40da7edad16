"""`MLPPolicy`: two separate tanh MLPs (policy and value) over flattened observations.

Orthogonally initialised as in CleanRL: small gains on the output layers start the policy near
uniform and the value near zero, which is what lets PPO solve CartPole-class tasks in a few
updates. Parameter names (`actor.*`, `critic.*`, `log_std`), their order and the initialisation's
use of the random generator are those of the former `ActorCritic`, so its checkpoints load and
a seeded run gives the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from shoal.learner.errors import PolicyError
from shoal.learner.models.base import PolicyModel, check_widths
from shoal.learner.models.spaces import space_from_json


def _layer(n_in: int, n_out: int, gain: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.constant_(layer.bias, 0.0)
    return layer


def mlp(n_in: int, hidden: tuple[int, ...], n_out: int, out_gain: float) -> nn.Sequential:
    """Linear+tanh per hidden width, then a linear output layer with gain `out_gain`."""
    layers: list[nn.Module] = []
    width = n_in
    for size in hidden:
        layers += [_layer(width, size, math.sqrt(2.0)), nn.Tanh()]
        width = size
    layers.append(_layer(width, n_out, out_gain))
    return nn.Sequential(*layers)


class MLPPolicy(PolicyModel):
    """The MLP family: any Box observation (flattened, as float32), Discrete or 1-D Box actions."""

    family = "mlp"
    spec_keys = ("hidden",)

    def __init__(
        self,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
        hidden: tuple[int, ...] = (64, 64),
    ) -> None:
        super().__init__(observation_space, action_space, np.float32)
        self.hidden = hidden = check_widths("mlp", "hidden", hidden)
        self.obs_dim = math.prod(self.obs_shape)
        self.actor = mlp(self.obs_dim, hidden, self.action_dim, 0.01)
        if not self.discrete:
            self.log_std = nn.Parameter(torch.zeros(self.action_dim))
        self.critic = mlp(self.obs_dim, hidden, 1, 1.0)

    def accepts_obs_shape(self, obs_shape: tuple[int, ...]) -> bool:
        return obs_shape in (self.obs_shape, (self.obs_dim,))

    def prepare(self, obs: torch.Tensor) -> torch.Tensor:
        return obs.to(self.compute_dtype).reshape(obs.shape[0], self.obs_dim)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor(x), self.critic(x).squeeze(-1)

    def values_of(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x).squeeze(-1)

    def shard_units(self) -> list[nn.Module]:
        return [self.actor, self.critic]


def legacy_spec_spaces(spec: Mapping[str, Any]) -> tuple[spaces.Space[Any], spaces.Space[Any]]:
    """The spaces of a spec written by the former `ActorCritic` (`obs_shape`, `action_space`
    with `kind`), whose checkpoints are still loadable: observations unbounded float32."""
    obs_shape = spec.get("obs_shape")
    space = spec.get("action_space")
    if (
        not isinstance(obs_shape, list)
        or not 1 <= len(obs_shape) <= 8
        or not all(
            isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= 1 << 26 for d in obs_shape
        )
        or not isinstance(space, Mapping)
    ):
        raise PolicyError(f"malformed policy spec: obs_shape {obs_shape!r:.80}")
    observation = spaces.Box(-np.inf, np.inf, shape=tuple(obs_shape), dtype=np.float32)
    if space.get("kind") == "discrete":
        return observation, space_from_json({"type": "discrete", "n": space.get("n"), "start": 0})
    if space.get("kind") == "box":
        low, high = _legacy_bounds(space.get("low")), _legacy_bounds(space.get("high"))
        size = len(low) if isinstance(low, list) else 0
        box = {"type": "box", "shape": [size], "dtype": "float32", "low": low, "high": high}
        return observation, space_from_json(box)
    raise PolicyError(
        f"malformed policy spec: action_space kind {space.get('kind')!r:.40}; valid: 'discrete', 'box'"
    )


def _legacy_bounds(values: object) -> object:
    """Old specs stored unbounded limits as float infinities, which JSON specs spell "inf"."""
    if not isinstance(values, list):
        return values
    return [
        ("inf" if v > 0 else "-inf") if isinstance(v, float) and math.isinf(v) else v
        for v in values
    ]
