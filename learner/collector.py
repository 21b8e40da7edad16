"""`Collector`: steps a vector of environments with a CPU policy copy and cuts Fragments.

The work of a rollout actor without the actor (no event loop, no transport, no learner), so it
can be tested and benchmarked on its own and reused by the 4-stage pipeline. Arrays are
allocated fresh per fragment because a finished fragment is handed to the transport, which
sends its memory without copying while the next one is written. Given the transport's frame
limit, the collector shortens its horizon so each fragment fits in one frame
(learner/fragment_size.py), before the environments are even reset.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from shoal.envs.vector import VectorEnvironment
from shoal.learner.fragment import Fragment
from shoal.learner.fragment_size import StepLayout, fitted_horizon
from shoal.learner.models import PolicyModel


class Collector:
    """Owns a vector environment and a policy copy; one caller at a time (the rollout actor).

    With `max_frame_bytes`, `horizon` is the longest up to the one asked for (`wanted_horizon`)
    whose fragment fits in a frame of that size; FragmentTooLarge when not even one step does.
    """

    def __init__(
        self,
        actor_id: str,
        env: VectorEnvironment,
        policy: PolicyModel,
        horizon: int,
        env_hash: str,
        seed: int | None = None,
        max_frame_bytes: int | None = None,
    ) -> None:
        self.actor_id = actor_id
        self.env = env
        self.policy = policy
        self.env_hash = env_hash
        self.policy_version = 0
        self.policy_source = ""
        self.seq = 0
        self.env_steps = 0
        space = env.single_action_space
        self._action_shape: tuple[int, ...] = tuple(getattr(space, "shape", None) or ())
        self._action_dtype = np.float32 if self._action_shape else np.int64
        self.layout = StepLayout(
            env.num_envs, policy.obs_shape, policy.obs_dtype,
            self._action_shape, np.dtype(self._action_dtype),
        )  # fmt: skip
        self.wanted_horizon = horizon
        self.horizon = (
            horizon
            if max_frame_bytes is None
            else fitted_horizon(horizon, self.layout, max_frame_bytes)
        )
        self._obs = env.reset(seed)

    def set_weights(
        self, version: int, weights: Mapping[str, torch.Tensor], source: str = ""
    ) -> None:
        """Adopt a complete policy version of learner incarnation `source`; takes effect from
        the next step."""
        self.policy.set_weights(weights)
        self.policy_version = version
        self.policy_source = source

    def step(self, buf: _Buffers, t: int) -> None:
        """Act and step once, writing row `t` of the fragment being built."""
        obs = self._obs
        actions, logp, values = self.policy.act(obs)
        result = self.env.step(actions)
        buf.obs[t] = obs
        buf.actions[t] = actions
        buf.logprobs[t] = logp
        buf.values[t] = values
        buf.rewards[t] = result.reward
        buf.dones[t] = result.done
        buf.truncated[t] = result.truncated
        if result.truncated.any():
            rows = np.flatnonzero(result.truncated)
            buf.final_values[t, rows] = self.policy.value(result.final_obs[rows])
        if result.ended.any():  # a whole episode (an Atari game, not a life) ended there
            rows = np.flatnonzero(result.ended)
            buf.episode_returns.extend(result.episode_return[rows].tolist())
            buf.episode_lengths.extend(result.episode_length[rows].tolist())
        self._obs = result.obs

    def new_buffers(self) -> _Buffers:
        return _Buffers(
            self.horizon, self.env.num_envs, self._obs.shape[1:], self.policy.obs_dtype,
            self._action_shape, self._action_dtype,
        )  # fmt: skip

    def finish(self, buf: _Buffers, version: int) -> Fragment:
        """Close the fragment: bootstrap value of the current observations, next sequence number."""
        fragment = Fragment(
            actor_id=self.actor_id,
            seq=self.seq,
            policy_version=version,
            policy_source=self.policy_source,
            env_hash=self.env_hash,
            obs=buf.obs,
            actions=buf.actions,
            logprobs=buf.logprobs,
            values=buf.values,
            rewards=buf.rewards,
            dones=buf.dones,
            truncated=buf.truncated,
            bootstrap_value=np.asarray(self.policy.value(self._obs), dtype=np.float32),
            final_values=buf.final_values,
            episode_returns=np.asarray(buf.episode_returns, dtype=np.float32),
            episode_lengths=np.asarray(buf.episode_lengths, dtype=np.int32),
        )
        self.seq += 1
        self.env_steps += fragment.num_steps
        return fragment

    def collect(self) -> Fragment:
        """One whole fragment with the current policy (the synchronous form, for tests and benches)."""
        buf = self.new_buffers()
        version = self.policy_version
        for t in range(self.horizon):
            self.step(buf, t)
        return self.finish(buf, version)


class _Buffers:
    """The arrays of one fragment under construction."""

    def __init__(
        self,
        horizon: int,
        num_envs: int,
        obs_shape: tuple[int, ...],
        obs_dtype: np.dtype[Any],
        action_shape: tuple[int, ...],
        action_dtype: type[np.generic],
    ) -> None:
        tn = (horizon, num_envs)
        self.obs = np.empty((*tn, *obs_shape), dtype=obs_dtype)
        self.actions = np.empty((*tn, *action_shape), dtype=action_dtype)
        self.logprobs = np.empty(tn, dtype=np.float32)
        self.values = np.empty(tn, dtype=np.float32)
        self.rewards = np.empty(tn, dtype=np.float32)
        self.dones = np.empty(tn, dtype=bool)
        self.truncated = np.empty(tn, dtype=bool)
        self.final_values = np.zeros(tn, dtype=np.float32)
        self.episode_returns: list[float] = []
        self.episode_lengths: list[int] = []
