"""`CNNPolicy`: the Nature-CNN torso (Mnih et al. 2015) for pixel observations.

Observations travel as uint8 images, [H, W, C] (Gymnasium's layout) or [C, H, W] (stacked
frames), a quarter of the bytes of float32; the model scales them by 1/255 on its own device.
Convolutions use the Nature kernels (8 stride 4, 4 stride 2, 3 stride 1, then 3 stride 1 for
any further layer), then dense ReLU layers (`hidden`), then a policy and a value head sharing
that torso, initialised as CleanRL's Atari PPO is. Images below 36x36 (MinAtar's 10x10 grids,
which the Nature kernels would reduce to nothing) get 3x3 stride-1 kernels instead, as the
MinAtar paper's network has; the kernels follow from the image size, so a stored spec rebuilds
the same network.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from shoal.learner.errors import PolicyError
from shoal.learner.models.base import PolicyModel, check_widths

_KERNELS = ((8, 4), (4, 2), (3, 1))
_SMALL_KERNELS = ((3, 1),)
SMALL_IMAGE = 36
"""Images with a side below this get `_SMALL_KERNELS`: three Nature convolutions need 36x36."""
_MAX_CONVS = 8


def _init(layer: nn.Conv2d | nn.Linear, gain: float) -> nn.Conv2d | nn.Linear:
    nn.init.orthogonal_(layer.weight, gain)
    assert layer.bias is not None
    nn.init.constant_(layer.bias, 0.0)
    return layer


def is_image_space(space: spaces.Space[Any]) -> bool:
    """A 3-D uint8 Box: what `family = "auto"` gives to the CNN."""
    return isinstance(space, spaces.Box) and len(space.shape) == 3 and space.dtype == np.uint8


class CNNPolicy(PolicyModel):
    """The cnn family: a 3-D uint8 Box observation, Discrete or 1-D Box actions."""

    family = "cnn"
    spec_keys = ("channels", "hidden")
    cpu_autocast = True

    def __init__(
        self,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
        channels: tuple[int, ...] = (32, 64, 64),
        hidden: tuple[int, ...] = (512,),
    ) -> None:
        super().__init__(observation_space, action_space, np.uint8)
        if not is_image_space(observation_space):
            raise PolicyError(
                f"the cnn family needs image observations (a 3-D uint8 Box), got "
                f"{observation_space}; use family 'mlp' for vectors"
            )
        self.channels = check_widths("cnn", "channels", channels, _MAX_CONVS)
        self.hidden = check_widths("cnn", "hidden", hidden)
        h, w, c = self.obs_shape
        # [H, W, C] when the last axis is the smallest (RGB, grey): Gymnasium's image layout.
        self.channels_last = c < h and c < w
        in_channels, height, width = (c, h, w) if self.channels_last else self.obs_shape
        convs: list[nn.Module] = []
        kernels = _KERNELS if min(height, width) >= SMALL_IMAGE else _SMALL_KERNELS
        for i, out in enumerate(self.channels):
            kernel, stride = kernels[min(i, len(kernels) - 1)]
            height, width = (height - kernel) // stride + 1, (width - kernel) // stride + 1
            if height < 1 or width < 1:
                raise PolicyError(
                    f"images of {list(self.obs_shape)} are too small for {len(self.channels)} "
                    "convolutions: use fewer model.channels or larger images (three Nature "
                    "convolutions need 36x36; smaller images lose 2 pixels per 3x3 convolution)"
                )
            convs += [_init(nn.Conv2d(in_channels, out, kernel, stride), math.sqrt(2.0)), nn.ReLU()]
            in_channels = out
        dense: list[nn.Module] = [nn.Flatten()]
        size = in_channels * height * width
        for out in self.hidden:
            dense += [_init(nn.Linear(size, out), math.sqrt(2.0)), nn.ReLU()]
            size = out
        self.torso = nn.Sequential(*convs, *dense)
        self.actor = _init(nn.Linear(size, self.action_dim), 0.01)
        if not self.discrete:
            self.log_std = nn.Parameter(torch.zeros(self.action_dim))
        self.critic = _init(nn.Linear(size, 1), 1.0)

    def prepare(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs.to(self.compute_dtype) / 255.0
        return x.permute(0, 3, 1, 2) if self.channels_last else x

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.torso(x)
        return self.actor(features), self.critic(features).squeeze(-1)

    def shard_units(self) -> list[nn.Module]:
        return [self.torso]
