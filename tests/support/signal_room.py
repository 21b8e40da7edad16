"""A shoal plugin environment with a Dict observation (an image-like grid, a float vector and a
text mission), registered as `SignalRoom-v1` when imported: the tests load it through
SHOAL_ENV_MODULES to show that a plugin's structured observation trains with no change to the
plugin (the vector packs it, envs/vector.py `packed_space`)."""

from __future__ import annotations

import string
from typing import Any

import numpy as np
from gymnasium import spaces

from shoal.envs import register
from shoal.envs.base import BaseEnvironment
from shoal.envs.registry import default_registry

SIGNAL_ROOM = "SignalRoom-v1"
LAMPS = 3
EPISODE_STEPS = 16
MISSIONS = ("go to the lit lamp", "find the light")


class SignalRoom(BaseEnvironment[dict[str, Any], int]):
    """Each step one of three lamps is lit in a 5x5 grid (row 2, column 0, 2 or 4); acting with
    the lit lamp's index scores 1. Sixteen steps make an episode, so random actions score
    about 16/3 and a policy that reads the grid scores 16. The vector holds the episode's
    progress and noise; the mission is one of two phrasings of the same task."""

    observation_space = spaces.Dict(
        {
            "grid": spaces.Box(0, 255, (5, 5, 3), np.uint8),
            "vector": spaces.Box(-1.0, 1.0, (3,), np.float32),
            "mission": spaces.Text(24, charset=string.ascii_lowercase + " "),
        }
    )
    action_space = spaces.Discrete(LAMPS)

    def __init__(self) -> None:
        self._rng = np.random.default_rng()
        self._lamp = 0
        self._t = 0
        self._mission = MISSIONS[0]

    def seed(self, seed: int | None) -> None:
        self._rng = np.random.default_rng(seed)

    def reset(self) -> tuple[dict[str, Any], dict[str, Any]]:
        self._t = 0
        self._mission = MISSIONS[int(self._rng.integers(len(MISSIONS)))]
        self._lamp = int(self._rng.integers(LAMPS))
        return self.observe(), {}

    def step(self, action: int) -> tuple[dict[str, Any], float, bool, dict[str, Any]]:
        reward = 1.0 if int(action) == self._lamp else 0.0
        self._t += 1
        self._lamp = int(self._rng.integers(LAMPS))
        return self.observe(), reward, self._t >= EPISODE_STEPS, {}

    def observe(self) -> dict[str, Any]:
        """The current observation (a method so the hostile variants in the tests can break it)."""
        grid = np.zeros((5, 5, 3), dtype=np.uint8)
        grid[2, 2 * self._lamp] = (255, 255, 0)
        progress = 2.0 * self._t / EPISODE_STEPS - 1.0
        noise = self._rng.uniform(-1.0, 1.0, 2)
        vector = np.array([progress, *noise], dtype=np.float32)
        return {"grid": grid, "vector": vector, "mission": self._mission}


class NaNSignalRoom(SignalRoom):
    """SignalRoom's hostile twin: its vector reads NaN, which no packed observation takes."""

    def observe(self) -> dict[str, Any]:
        return {**super().observe(), "vector": np.array([np.nan, 0.0, 0.0], np.float32)}


class LateNaNSignalRoom(SignalRoom):
    """SignalRoom whose vector turns NaN from an episode's fourth step: the pre-flight's reset
    passes, and the rollout workers meet the bad observation only once training runs."""

    def observe(self) -> dict[str, Any]:
        observation = super().observe()
        if self._t >= 3:
            observation["vector"] = np.array([np.nan, 0.0, 0.0], np.float32)
        return observation


NAN_SIGNAL_ROOM = "SignalRoomNaN-v1"
LATE_NAN_SIGNAL_ROOM = "SignalRoomLateNaN-v1"
for env_id, entry in (
    (SIGNAL_ROOM, "SignalRoom"),
    (NAN_SIGNAL_ROOM, "NaNSignalRoom"),
    (LATE_NAN_SIGNAL_ROOM, "LateNaNSignalRoom"),
):
    if env_id not in default_registry.list(include_gym=False):
        register(
            env_id,
            f"tests.support.signal_room:{entry}",
            requirements=("numpy",),
            description="a plugin with a Dict observation: light grid, vector, mission",
        )
