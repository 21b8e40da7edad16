"""`BaseEnvironment`: the one interface every shoal environment implements.

The signature is the seed's: `step` returns `(obs, reward, done, info)` with one `done`, and
`info["truncated"]` tells a time limit (bootstrap from the value) from a terminal state (don't).
Spaces are Gymnasium's, so the adapters in both directions are thin.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import numpy as np
from gymnasium import spaces

Observation = TypeVar("Observation")
Action = TypeVar("Action")
Reward = float


class BaseEnvironment(Generic[Observation, Action]):
    """One environment instance; not thread-safe, owned by one actor or one worker."""

    observation_space: spaces.Space[Any]
    action_space: spaces.Space[Any]

    def reset(self) -> tuple[Observation, dict[str, Any]]:
        """Start a new episode; returns the first observation and an info dict."""
        raise NotImplementedError

    def step(self, action: Action) -> tuple[Observation, Reward, bool, dict[str, Any]]:
        """Advance one step. `done` ends the episode; `info["truncated"]` is True for a time limit."""
        raise NotImplementedError

    def render(self, mode: str = "human") -> np.ndarray | None:
        """An RGB frame for mode 'rgb_array'; None where the environment draws nothing."""
        return None

    def seed(self, seed: int | None) -> None:
        """Seed the environment's random generator; the next `reset` starts from it."""

    def close(self) -> None:
        """Release what the environment holds (processes, files)."""
