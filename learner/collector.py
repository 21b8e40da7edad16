"""`Collector`: steps a vector of environments with a CPU policy copy and cuts Fragments.

The work of a rollout actor without the actor (no event loop, no transport, no learner), so it
can be tested and benchmarked on its own and reused by the 4-stage pipeline. Arrays are
allocated fresh per fragment because a finished fragment is handed to the transport, which
sends its memory without copying while the next one is written. Given the transport's frame
limit, the collector shortens its horizon so each fragment fits in one frame
(learner/fragment_size.py), before the environments are even reset.

Over a vector that steps groups of copies split-phase (`SplitStepVector`, e.g. the Atari C++
vector's two halves) the collector pipelines them, as Sample Factory's double-buffered sampling
does: while one half's emulators run on their own threads, the policy computes the other half's
actions on the calling thread, so the emulator and the forward overlap on two cores instead of
taking turns. Row t is still every copy's t-th step: with the same seeds and a deterministic
policy the fragments are the sequential path's, bit for bit (tests/learner/
test_collector_pipelined.py); a sampling policy draws its random numbers per group instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shoal.envs.vector import SplitStepVector, VectorEnvironment, VectorStep
from shoal.learner.fragment import Fragment
from shoal.learner.fragment_size import StepLayout, fitted_horizon
from shoal.learner.models import PolicyModel


class Collector:
    """Owns a vector environment and a policy copy; one caller at a time (the rollout actor).

    With `max_frame_bytes`, `horizon` is the longest up to the one asked for (`wanted_horizon`)
    whose fragment fits in a frame of that size; FragmentTooLarge when not even one step does.

    `pipeline` (the job's `rollout.pipeline`) pipelines the groups of a `SplitStepVector` with
    two or more groups; without it, or for any other vector, the collector steps all copies
    then computes all actions, in turn.
    Pipelined, the first group's next row is acted on and sent within `step(buf, t)` (for every
    row but the buffer's last), so it is in flight between calls; nothing is in flight between
    fragments. `pipelined` says which path runs.
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
        pipeline: bool = False,
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
        self._split = (
            env if pipeline and isinstance(env, SplitStepVector) and len(env.groups) >= 2 else None
        )
        self._ahead: _Acted | None = None
        """The first group's row `_ahead.row`: acted on and stepping (pipelined path only)."""
        obs = env.reset(seed)
        # Pipelined, each group's new observations are written into this array (its own copy).
        self._obs = np.array(obs) if self._split is not None else obs

    @property
    def pipelined(self) -> bool:
        """Whether steps pipeline the vector's groups (see the class docstring)."""
        return self._split is not None

    def set_weights(
        self, version: int, weights: Mapping[str, torch.Tensor], source: str = ""
    ) -> None:
        """Adopt a complete policy version of learner incarnation `source`; takes effect from
        the next step. Pipelined, the first group's next row was already acted on by the
        version before (it is stepping), so that group's rows change version one row later:
        each group's row is always acted on by one version, and every row of a fragment by the
        version it started with or a newer one, so `policy_version` (the version at the
        fragment's start, the oldest) stays what the intake's staleness bound needs."""
        self.policy.set_weights(weights)
        self.policy_version = version
        self.policy_source = source

    def step(self, buf: _Buffers, t: int) -> None:
        """Act and step once, writing row `t` of the fragment being built."""
        if self._split is not None:
            self._step_pipelined(self._split, buf, t)
            return
        obs = self._obs
        actions, logp, values = self.policy.act(obs)
        result = self.env.step(actions)
        buf.obs[t] = obs
        buf.actions[t] = actions
        buf.logprobs[t] = logp
        buf.values[t] = values
        self._write_outcome(buf, t, slice(0, self.env.num_envs), result)
        self._obs = result.obs

    def _step_pipelined(self, env: SplitStepVector, buf: _Buffers, t: int) -> None:
        """Row `t` with the groups overlapped: each group is acted on while the one before it
        steps, and sent as soon as it has actions; the first group's row t+1 is acted on while
        the last group steps, unless row t is the buffer's last."""
        ahead = self._ahead
        self._ahead = None
        if ahead is not None and ahead.row != t:  # an abandoned fragment's row: drop it
            self._landed(env, 0)
            ahead = None
        acted = [ahead or self._launch(env, 0, t)]
        last = len(env.groups) - 1
        for g in range(1, last + 1):
            acted.append(self._launch(env, g, t))
            self._land(env, buf, acted[g - 1])
        if t + 1 < len(buf.rewards):
            self._ahead = self._launch(env, 0, t + 1)
        self._land(env, buf, acted[last])

    def _launch(self, env: SplitStepVector, group: int, row: int) -> _Acted:
        """Act on group's current observations and start its step."""
        actions, logp, values = self.policy.act(self._obs[env.groups[group]])
        env.step_async(group, actions)
        return _Acted(group, row, actions, logp, values)

    def _landed(self, env: SplitStepVector, group: int) -> VectorStep:
        """Wait for group's step; its new observations become the group's current ones."""
        result = env.step_wait(group)
        self._obs[env.groups[group]] = result.obs
        return result

    def _land(self, env: SplitStepVector, buf: _Buffers, acted: _Acted) -> None:
        """Wait for a group's step and write its part of row `acted.row`."""
        rows = env.groups[acted.group]
        t = acted.row
        buf.obs[t, rows] = self._obs[rows]
        result = self._landed(env, acted.group)
        buf.actions[t, rows] = acted.actions
        buf.logprobs[t, rows] = acted.logp
        buf.values[t, rows] = acted.values
        self._write_outcome(buf, t, rows, result)

    def _write_outcome(self, buf: _Buffers, t: int, rows: slice, result: VectorStep) -> None:
        """Rewards, ends, time-limit values and finished episodes of copies `rows` at row `t`."""
        buf.rewards[t, rows] = result.reward
        buf.dones[t, rows] = result.done
        buf.truncated[t, rows] = result.truncated
        if result.truncated.any():
            cut = np.flatnonzero(result.truncated)
            buf.final_values[t, rows.start + cut] = self.policy.value(result.final_obs[cut])
        if result.ended.any():  # a whole episode (an Atari game, not a life) ended there
            ended = np.flatnonzero(result.ended)
            buf.episode_returns.extend(result.episode_return[ended].tolist())
            buf.episode_lengths.extend(result.episode_length[ended].tolist())

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


@dataclass
class _Acted:
    """One group's actions for one row, sent to its copies and not yet written."""

    group: int
    row: int
    actions: np.ndarray
    logp: np.ndarray
    values: np.ndarray


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
