"""`MultiPolicy`: one encoder per part of a packed structured observation (MiniGrid, BabyAI).

The observation is a `PackedBox` (shoal.envs.packed_obs); its layout says where each part
lives. Each part gets the encoder its kind calls for, the features are concatenated, and two
tanh MLPs (`hidden`) make the policy and the value, initialised as CleanRL does:

- image, both sides at least 36: the Nature-CNN convolutions (uint8 scaled by 1/255), then a
  dense ReLU layer of 512;
- image, smaller (a symbolic grid such as MiniGrid's 7x7x3 view): integer cells are codes, not
  intensities, so each channel's value (0..255) gets a learned embedding, summed over channels
  (BabyAI's bag-of-words encoding), then 2x2 convolutions of 16, 32 and 64 channels with a 2x2
  max-pool after the first (the MiniGrid RL starter's torso); float grids skip the embedding;
- vector: flattened as float32; one-hot: each Discrete element as a one-hot of its categories;
- text: byte ids through an embedding and a GRU, whose output at the last byte is the feature.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from shoal.envs.packed_obs import Layout, PackedBox, Part
from shoal.learner.errors import PolicyError
from shoal.learner.models.base import PolicyModel, check_widths
from shoal.learner.models.mlp import mlp

LARGE_IMAGE = 36
"""Smallest side for the Nature-CNN (three convolutions of 8/4, 4/2, 3/1)."""
GRID_EMBED = 8
GRID_CHANNELS = (16, 32, 64)
TEXT_EMBED = 32
TEXT_HIDDEN = 64
MAX_ONE_HOT = 1 << 16
"""Most one-hot features of one part; a wider Discrete is better observed as a Box."""


def _init(layer: nn.Conv2d | nn.Linear) -> nn.Conv2d | nn.Linear:
    nn.init.orthogonal_(layer.weight, math.sqrt(2.0))
    assert layer.bias is not None
    nn.init.constant_(layer.bias, 0.0)
    return layer


class MultiPolicy(PolicyModel):
    """The multi family: a `PackedBox` observation, Discrete or 1-D Box actions."""

    family = "multi"
    spec_keys = ("hidden",)

    def __init__(
        self,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
        hidden: tuple[int, ...] = (64, 64),
    ) -> None:
        if not isinstance(observation_space, PackedBox):
            raise PolicyError(
                f"the multi family needs a packed structured observation (a PackedBox from "
                f"shoal.envs.packed_obs.PackObservation), got {observation_space}; use family "
                "'mlp' for vectors or 'cnn' for images"
            )
        lay: Layout = observation_space.layout
        super().__init__(observation_space, action_space, np.dtype(lay.dtype).type)
        self.hidden = hidden = check_widths("multi", "hidden", hidden)
        self.parts = lay.parts
        encoders = [_encoder(part) for part in lay.parts]
        width = sum(encoder.out_features for encoder in encoders)
        self.encoders = nn.ModuleList(encoders)
        self.actor = mlp(width, hidden, self.action_dim, 0.01)
        if not self.discrete:
            self.log_std = nn.Parameter(torch.zeros(self.action_dim))
        self.critic = mlp(width, hidden, 1, 1.0)

    def prepare(self, obs: torch.Tensor) -> torch.Tensor:
        """The packed array as it came; each encoder converts its own slice."""
        return obs

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Every part's encoding, concatenated: [B, sum of the encoders' out_features]."""
        return torch.cat(
            [
                encoder(x[:, part.offset : part.offset + part.size])
                for part, encoder in zip(self.parts, self.encoders, strict=True)
            ],
            dim=-1,
        )

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.features(x)
        return self.actor(features), self.critic(features).squeeze(-1)

    def shard_units(self) -> list[nn.Module]:
        with_weights = [e for e in self.encoders if any(True for _ in e.parameters())]
        return [*with_weights, self.actor, self.critic]


class PartEncoder(nn.Module):
    """Encodes one part's slice [B, part.size] of the packed array into [B, out_features]."""

    out_features: int
    compute_dtype: torch.dtype = torch.float32
    """The dtype of the encoding (PolicyModel.run_in sets it with the weights')."""


def _encoder(part: Part) -> PartEncoder:
    if part.kind == "image":
        return ImageEncoder(part)
    if part.kind == "one-hot":
        return OneHotEncoder(part)
    if part.kind == "text":
        return TextEncoder()
    return VectorEncoder(part)


class VectorEncoder(PartEncoder):
    """A Box or MultiBinary part as its values, in the compute dtype (float32 to train)."""

    def __init__(self, part: Part) -> None:
        super().__init__()
        self.out_features = part.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.compute_dtype)


class OneHotEncoder(PartEncoder):
    """Each Discrete element as a one-hot of its own number of categories, side by side."""

    offsets: torch.Tensor
    highest: torch.Tensor

    def __init__(self, part: Part) -> None:
        super().__init__()
        self.out_features = sum(part.categories)
        if self.out_features > MAX_ONE_HOT:
            raise PolicyError(
                f"observation part {'/'.join(map(str, part.path))} one-hots into "
                f"{self.out_features} features (at most {MAX_ONE_HOT}): observe it as a Box"
            )
        starts = np.concatenate([[0], np.cumsum(part.categories)[:-1]])
        self.register_buffer(
            "offsets", torch.as_tensor(starts, dtype=torch.int64), persistent=False
        )
        self.register_buffer(
            "highest", torch.as_tensor(part.categories, dtype=torch.int64) - 1, persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = torch.minimum(x.long().clamp(min=0), self.highest) + self.offsets
        out = torch.zeros(x.shape[0], self.out_features, device=x.device, dtype=self.compute_dtype)
        return out.scatter_(1, index, 1.0)


class ImageEncoder(PartEncoder):
    """A 3-D image part: the Nature-CNN when large, else embedded codes and 2x2 convolutions."""

    code_offsets: torch.Tensor

    def __init__(self, part: Part) -> None:
        super().__init__()
        h, w, c = part.shape
        self.shape = part.shape
        self.channels_last = c < h and c < w
        channels, height, width = (c, h, w) if self.channels_last else part.shape
        self.large = min(height, width) >= LARGE_IMAGE
        self.integer = np.dtype(part.dtype).kind in "biu"
        self.scale = 1.0 / 255.0 if self.large and part.dtype == "uint8" else 1.0
        self.embed: nn.Embedding | None = (
            nn.Embedding(256 * channels, GRID_EMBED) if self.integer and not self.large else None
        )
        self.register_buffer(
            "code_offsets", torch.arange(channels, dtype=torch.int64) * 256, persistent=False
        )
        in_channels = GRID_EMBED if self.embed is not None else channels
        layers, size = (
            _nature(in_channels, height, width) if self.large else _grid(in_channels, height, width)
        )
        self.torso = nn.Sequential(*layers) if self.large else nn.Sequential(*layers, nn.Flatten())
        self.out_features = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        image = x.reshape(x.shape[0], *self.shape)
        if self.channels_last:
            image = image.permute(0, 3, 1, 2)
        if self.embed is not None:
            codes = image.long().clamp(0, 255) + self.code_offsets.view(1, -1, 1, 1)
            image = self.embed(codes).sum(1).permute(0, 3, 1, 2)
        else:
            image = image.to(self.compute_dtype) * self.scale
        return self.torso(image)


def _nature(channels: int, height: int, width: int) -> tuple[list[nn.Module], int]:
    layers: list[nn.Module] = []
    for out, kernel, stride in ((32, 8, 4), (64, 4, 2), (64, 3, 1)):
        layers += [_init(nn.Conv2d(channels, out, kernel, stride)), nn.ReLU()]
        height, width = (height - kernel) // stride + 1, (width - kernel) // stride + 1
        channels = out
    layers += [nn.Flatten(), _init(nn.Linear(channels * height * width, 512)), nn.ReLU()]
    return layers, 512


def _grid(channels: int, height: int, width: int) -> tuple[list[nn.Module], int]:
    layers: list[nn.Module] = []
    for i, out in enumerate(GRID_CHANNELS):
        if min(height, width) < 2:
            break
        layers += [_init(nn.Conv2d(channels, out, 2)), nn.ReLU()]
        height, width, channels = height - 1, width - 1, out
        if i == 0 and min(height, width) >= 4:
            layers.append(nn.MaxPool2d(2))
            height, width = height // 2, width // 2
    return layers, channels * height * width


class TextEncoder(PartEncoder):
    """Byte ids (0 = padding, trailing) through an embedding and a GRU; the output at the last
    byte of each text. A batch repeats few texts (one mission per episode), so the GRU runs once
    per distinct text, over the bytes up to the longest one."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, TEXT_EMBED, padding_idx=0)
        self.gru = nn.GRU(TEXT_EMBED, TEXT_HIDDEN, batch_first=True)
        self.out_features = TEXT_HIDDEN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.zeros(0, TEXT_HIDDEN, device=x.device, dtype=self.compute_dtype)
        texts, which = torch.unique(x.long().clamp(0, 255), dim=0, return_inverse=True)
        lengths = (texts != 0).sum(1)
        outputs, _ = self.gru(self.embed(texts[:, : max(int(lengths.max()), 1)]))
        last = (lengths - 1).clamp(min=0).view(-1, 1, 1).expand(-1, 1, outputs.shape[-1])
        encoded = outputs.gather(1, last).squeeze(1) * (lengths > 0).unsqueeze(-1)
        return encoded[which]
