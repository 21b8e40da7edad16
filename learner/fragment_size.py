"""How many steps of a fragment fit in one transport frame.

A fragment travels to its learner as one frame (runtime/wire.py), and the sender refuses a
frame over its transport's `max_frame_bytes` before writing a byte: an actor whose fragments
are too big would never deliver one. A fragment's size is known before the first step, from
the observation's shape and dtype, the action's, and the number of environments, so the actor
collects the longest horizon, up to the job's, that fits, and a configuration where not even
one step fits is refused at start, naming the sizes and what to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces

from shoal.learner.errors import LearnerError

MIB = 1 << 20
ENVELOPE_BYTES = 64 * 1024
"""Bytes of a fragment's frame that do not grow with its steps: the prefix, the msgpack header
(the ask's target and method, the field names, the scalars, each array's dtype and shape), the
buffer table and each array's padding to a 64-byte boundary. A few KiB in practice."""
ENV_STEP_BYTES = 4 + 4 + 4 + 1 + 1 + 4 + 4 + 4
"""Per environment and step besides the observation and the action: logprobs, values, rewards
(float32), dones, truncated (bool), final_values (float32), and at most one ended episode's
return (float32) and length (int32)."""
BOOTSTRAP_BYTES = 4
"""Per environment, once per fragment: the float32 bootstrap value."""


class FragmentTooLarge(LearnerError):
    """Not even a one-step fragment fits in a transport frame: a configuration error (too many
    environments per actor for the observation's size); the message says what to change."""


@dataclass(frozen=True)
class StepLayout:
    """What one step of a fragment holds: `num_envs` observations and actions."""

    num_envs: int
    obs_shape: tuple[int, ...]
    obs_dtype: np.dtype[Any]
    action_shape: tuple[int, ...]
    action_dtype: np.dtype[Any]

    @property
    def env_step_bytes(self) -> int:
        """The bytes one environment adds to a fragment per step."""
        obs = math.prod(self.obs_shape) * self.obs_dtype.itemsize
        action = math.prod(self.action_shape) * self.action_dtype.itemsize
        return obs + action + ENV_STEP_BYTES

    @property
    def step_bytes(self) -> int:
        """The bytes one step of all `num_envs` environments adds to a fragment."""
        return self.num_envs * self.env_step_bytes

    @property
    def fixed_bytes(self) -> int:
        """The bytes of a fragment's frame whatever its horizon."""
        return ENVELOPE_BYTES + self.num_envs * BOOTSTRAP_BYTES

    def frame_bytes(self, horizon: int) -> int:
        """An upper bound on the frame of a fragment of `horizon` steps."""
        return self.fixed_bytes + horizon * self.step_bytes


def step_layout(
    num_envs: int,
    obs_shape: tuple[int, ...],
    obs_dtype: np.dtype[Any],
    action_space: spaces.Space[Any],
) -> StepLayout:
    """The layout of a fragment of `num_envs` observations as the policy takes them
    (`obs_shape`, `obs_dtype`) and actions of `action_space` as the collector stores them:
    int64 for Discrete, float32 x A for a Box."""
    action_shape = tuple(getattr(action_space, "shape", None) or ())
    action_dtype = np.dtype(np.float32 if action_shape else np.int64)
    return StepLayout(num_envs, tuple(obs_shape), np.dtype(obs_dtype), action_shape, action_dtype)


def fit_horizon(wanted: int, step_bytes: int, fixed_bytes: int, max_frame_bytes: int) -> int:
    """The largest horizon up to `wanted` whose frame (`fixed_bytes` + horizon ×
    `step_bytes`) is at most `max_frame_bytes`; 0 when not even one step fits."""
    if wanted < 1 or step_bytes < 1 or fixed_bytes < 0:
        raise ValueError(
            f"fit_horizon needs wanted >= 1, step_bytes >= 1 and fixed_bytes >= 0, got "
            f"{wanted}, {step_bytes}, {fixed_bytes}"
        )
    room = max_frame_bytes - fixed_bytes
    return 0 if room < step_bytes else min(wanted, room // step_bytes)


def fitted_horizon(wanted: int, layout: StepLayout, max_frame_bytes: int) -> int:
    """`fit_horizon` for `layout`; FragmentTooLarge when not even one step fits."""
    horizon = fit_horizon(wanted, layout.step_bytes, layout.fixed_bytes, max_frame_bytes)
    if horizon < 1:
        raise FragmentTooLarge(too_large(layout, max_frame_bytes))
    return horizon


def too_large(layout: StepLayout, max_frame_bytes: int) -> str:
    """Why a one-step fragment of `layout` cannot be sent, and what to change."""
    dtype, shape = layout.obs_dtype, list(layout.obs_shape)
    what = (
        f"one step of {layout.num_envs} environment(s) with {dtype} observations of shape "
        f"{shape} is {layout.frame_bytes(1) / MIB:.1f} MiB, over the transport's frame limit of "
        f"{max_frame_bytes / MIB:.1f} MiB (max_frame_bytes)"
    )
    room = max_frame_bytes - ENVELOPE_BYTES
    envs = room // (layout.env_step_bytes + BOOTSTRAP_BYTES) if room > 0 else 0
    shrink = (
        "a wrapper that shrinks the observation (--wrapper atari for Atari frames, or a resize)"
    )
    if envs < 1:
        return f"{what}; even one environment's observation is too big: use {shrink}"
    return (
        f"{what}: use at most {envs} environments per actor (--envs, rollout.num_envs) or {shrink}"
    )


def shortened(wanted: int, horizon: int, layout: StepLayout, max_frame_bytes: int) -> str:
    """Why fragments are `horizon` steps rather than the `wanted` ones, with both sizes."""
    return (
        f"a fragment of {describe(wanted, layout)} would exceed the transport's frame limit of "
        f"{max_frame_bytes / MIB:.1f} MiB; collecting fragments of {describe(horizon, layout)}"
    )


def describe(horizon: int, layout: StepLayout) -> str:
    """A fragment's steps and its frame's size bound, for the log."""
    return f"{horizon} steps x {layout.num_envs} envs ({layout.frame_bytes(horizon) / MIB:.1f} MiB)"
