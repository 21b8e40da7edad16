"""CartPole in batched numpy, with Gymnasium's CartPole-v1 dynamics (Barto, Sutton, Anderson 1983).

The state is kept in float64 as Gymnasium keeps it, one contiguous row per variable
(`state[0]` is every copy's cart position), so each physics line is one vector operation
over all copies. Observations are the state cast to float32, as in Gymnasium.
"""

from __future__ import annotations

import math

import numpy as np
from gymnasium import spaces

from shoal.envs.batched import BatchedDynamics, NativeVector, SingleEnv

GRAVITY = 9.8
MASS_CART = 1.0
MASS_POLE = 0.1
TOTAL_MASS = MASS_POLE + MASS_CART
HALF_LENGTH = 0.5
POLE_MASS_LENGTH = MASS_POLE * HALF_LENGTH
FORCE = 10.0
TAU = 0.02
THETA_LIMIT = 12 * 2 * math.pi / 360
X_LIMIT = 2.4
RESET_BOUND = 0.05

_HIGH = np.array([X_LIMIT * 2, np.inf, THETA_LIMIT * 2, np.inf], dtype=np.float32)


class CartPoleDynamics(BatchedDynamics):
    """N cart-poles; `sutton_barto_reward` gives 0 per step and -1 on failure instead of +1."""

    def __init__(self, num_envs: int, sutton_barto_reward: bool = False) -> None:
        self.num_envs = num_envs
        self.observation_space = spaces.Box(-_HIGH, _HIGH, dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self.sutton_barto_reward = sutton_barto_reward
        self.state = np.zeros((4, num_envs), dtype=np.float64)
        self._force = np.empty(num_envs, dtype=np.float64)
        self._reward = np.zeros(num_envs, dtype=np.float32) if sutton_barto_reward else None

    def reset_rows(self, rows: np.ndarray, rng: np.random.Generator) -> None:
        self.state[:, rows] = rng.uniform(-RESET_BOUND, RESET_BOUND, size=(len(rows), 4)).T

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x, x_dot, theta, theta_dot = self.state
        force = self._force
        np.multiply(actions, 2 * FORCE, out=force)
        force -= FORCE
        cos = np.cos(theta)
        sin = np.sin(theta)
        temp = (force + POLE_MASS_LENGTH * np.square(theta_dot) * sin) / TOTAL_MASS
        theta_acc = (GRAVITY * sin - cos * temp) / (
            HALF_LENGTH * (4.0 / 3.0 - MASS_POLE * np.square(cos) / TOTAL_MASS)
        )
        x_acc = temp - POLE_MASS_LENGTH * theta_acc * cos / TOTAL_MASS
        x += TAU * x_dot
        x_dot += TAU * x_acc
        theta += TAU * theta_dot
        theta_dot += TAU * theta_acc
        terminated = (np.abs(x) > X_LIMIT) | (np.abs(theta) > THETA_LIMIT)
        if self._reward is None:
            return np.ones(self.num_envs, dtype=np.float32), terminated
        return -terminated.astype(np.float32), terminated

    def observe(self) -> np.ndarray:
        return self.state.T.astype(np.float32)


def make_single(sutton_barto_reward: bool = False) -> SingleEnv:
    """One CartPole behind `BaseEnvironment` (the registry adds the 500-step time limit)."""
    return SingleEnv(CartPoleDynamics(1, sutton_barto_reward))


def make_batched(
    num_envs: int,
    seed: int | None = None,
    max_episode_steps: int | None = 500,
    sutton_barto_reward: bool = False,
) -> NativeVector:
    """N CartPoles stepped as one array operation each step."""
    return NativeVector(CartPoleDynamics(num_envs, sutton_barto_reward), max_episode_steps, seed)
