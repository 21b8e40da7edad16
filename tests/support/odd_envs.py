"""Gymnasium environments with spaces shoal's policies cannot train on, for the pre-flight and
catalog tests: imported in every process of a run through SHOAL_ENV_MODULES."""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces


class SwitchBoard(gymnasium.Env[np.ndarray, np.ndarray]):
    """Four readings in, three switches (MultiBinary) out: a real environment whose action
    space no built-in policy outputs."""

    observation_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = spaces.MultiBinary(3)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return self.observation_space.sample(), float(np.sum(action)), False, False, {}


SWITCHBOARD = "ShoalOdd/SwitchBoard-v0"
if SWITCHBOARD not in gymnasium.registry:
    gymnasium.register(SWITCHBOARD, entry_point=SwitchBoard, max_episode_steps=20)
