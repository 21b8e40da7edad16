"""Batched numpy dynamics and the two shells around them: `NativeVector` and `SingleEnv`.

A built-in environment is written once, as `BatchedDynamics` over arrays of N states. The
vector shell adds what every environment shares (time limit, episode statistics, auto-reset)
with whole-array operations; the single shell runs the same dynamics with N = 1, so the
single and the batched form of a built-in cannot drift apart.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces

from shoal.envs.base import BaseEnvironment
from shoal.envs.errors import EnvError, InvalidAction
from shoal.envs.vector import VectorEnvironment, VectorStep, check_actions, check_num_envs


class BatchedDynamics:
    """The state of N copies and how it moves; subclasses hold their state in numpy arrays."""

    num_envs: int
    observation_space: spaces.Space[Any]
    action_space: spaces.Space[Any]

    def reset_rows(self, rows: np.ndarray, rng: np.random.Generator) -> None:
        """Draw a fresh initial state for the copies whose indices are in `rows`."""
        raise NotImplementedError

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Advance all copies; return (reward float32 [N], terminated bool [N])."""
        raise NotImplementedError

    def observe(self) -> np.ndarray:
        """A new array of every copy's observation, float32 [N, *obs_shape]."""
        raise NotImplementedError


def check_max_episode_steps(value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise EnvError(f"max_episode_steps must be a positive integer or None, got {value!r}")


class NativeVector(VectorEnvironment):
    """A `VectorEnvironment` over one `BatchedDynamics`: all N copies move in one array step."""

    def __init__(
        self,
        dynamics: BatchedDynamics,
        max_episode_steps: int | None = None,
        seed: int | None = None,
    ) -> None:
        check_num_envs(dynamics.num_envs)
        check_max_episode_steps(max_episode_steps)
        self.dynamics = dynamics
        self.num_envs = dynamics.num_envs
        self.single_observation_space = dynamics.observation_space
        self.single_action_space = dynamics.action_space
        self.max_episode_steps = max_episode_steps
        self._rng = np.random.default_rng(seed)
        self._all_rows = np.arange(self.num_envs)
        self._returns = np.zeros(self.num_envs, dtype=np.float64)
        self._lengths = np.zeros(self.num_envs, dtype=np.int32)
        self._started = False

    def reset(self, seed: int | None = None) -> np.ndarray:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self.dynamics.reset_rows(self._all_rows, self._rng)
        self._returns.fill(0.0)
        self._lengths.fill(0)
        self._started = True
        return self.dynamics.observe()

    def step(self, actions: np.ndarray) -> VectorStep:
        if not self._started:
            raise EnvError("call reset() before step() on a vector environment")
        actions = check_actions(actions, self.num_envs, self.single_action_space)
        reward, terminated = self.dynamics.step(actions)
        self._returns += reward
        self._lengths += 1
        if self.max_episode_steps is None:
            truncated = np.zeros(self.num_envs, dtype=bool)
            done = terminated
        else:
            at_limit = self._lengths >= self.max_episode_steps
            truncated = at_limit & ~terminated
            done = terminated | at_limit
        final_obs = self.dynamics.observe()
        rows = np.flatnonzero(done)
        episode_return = np.zeros(self.num_envs, dtype=np.float32)
        episode_length = np.zeros(self.num_envs, dtype=np.int32)
        if rows.size == 0:
            obs = final_obs.copy()
        else:
            episode_return[rows] = self._returns[rows]
            episode_length[rows] = self._lengths[rows]
            self._returns[rows] = 0.0
            self._lengths[rows] = 0
            self.dynamics.reset_rows(rows, self._rng)
            obs = final_obs.copy()
            obs[rows] = self.dynamics.observe()[rows]
        return VectorStep(
            obs=obs,
            reward=reward,
            done=done,
            truncated=truncated,
            final_obs=final_obs,
            episode_return=episode_return,
            episode_length=episode_length,
        )


class SingleEnv(BaseEnvironment[np.ndarray, Any]):
    """One copy of a `BatchedDynamics` (N = 1) behind the seed's `BaseEnvironment` interface.

    The time limit is not applied here: the registry wraps it in `TimeLimit`, as Gymnasium does.
    """

    def __init__(self, dynamics: BatchedDynamics) -> None:
        if dynamics.num_envs != 1:
            raise EnvError(f"SingleEnv needs dynamics for one copy, got {dynamics.num_envs}")
        self.dynamics = dynamics
        self.observation_space = dynamics.observation_space
        self.action_space = dynamics.action_space
        self._rng = np.random.default_rng()
        self._rows = np.zeros(1, dtype=np.intp)
        self._started = False

    def seed(self, seed: int | None) -> None:
        self._rng = np.random.default_rng(seed)

    def reset(self) -> tuple[np.ndarray, dict[str, Any]]:
        self.dynamics.reset_rows(self._rows, self._rng)
        self._started = True
        return self.dynamics.observe()[0], {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, dict[str, Any]]:
        if not self._started:
            raise EnvError("call reset() before step()")
        if not self.action_space.contains(action):
            raise InvalidAction(f"action {action!r} is not in {self.action_space}")
        reward, terminated = self.dynamics.step(np.asarray([action]))
        done = bool(terminated[0])
        self._started = not done
        return self.dynamics.observe()[0], float(reward[0]), done, {"truncated": False}
