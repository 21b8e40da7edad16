"""`TimeLimit`: ends an episode after a fixed number of steps and marks it truncated."""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.envs.base import BaseEnvironment


class TimeLimit(BaseEnvironment[Any, Any]):
    """Wraps one environment; `info["truncated"]` is True only when the limit, not the task, ended it.

    An episode that terminates on the very step the limit is reached counts as terminated, so a
    learner never bootstraps from a terminal state.
    """

    def __init__(self, env: BaseEnvironment[Any, Any], max_episode_steps: int) -> None:
        self.env = env
        self.max_episode_steps = max_episode_steps
        self.observation_space = env.observation_space
        self.action_space = env.action_space
        self.elapsed_steps = 0

    @property
    def unwrapped(self) -> BaseEnvironment[Any, Any]:
        env = self.env
        return env.unwrapped if isinstance(env, TimeLimit) else env

    def reset(self) -> tuple[Any, dict[str, Any]]:
        self.elapsed_steps = 0
        return self.env.reset()

    def step(self, action: Any) -> tuple[Any, float, bool, dict[str, Any]]:
        obs, reward, done, info = self.env.step(action)
        self.elapsed_steps += 1
        if self.elapsed_steps >= self.max_episode_steps and not done:
            info = {**info, "truncated": True}
            done = True
        return obs, reward, done, info

    def render(self, mode: str = "human") -> np.ndarray | None:
        return self.env.render(mode)

    def seed(self, seed: int | None) -> None:
        self.env.seed(seed)

    def close(self) -> None:
        self.env.close()

    def __repr__(self) -> str:
        return f"<TimeLimit max_episode_steps={self.max_episode_steps} {self.env!r}>"
