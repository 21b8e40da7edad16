"""Acrobot in batched numpy, with Gymnasium's Acrobot-v1 dynamics (Sutton 1996, "book" variant).

Two links hang from a pivot; only the joint between them is actuated (torque -1, 0 or +1).
The episode ends when the tip swings above the bar at height 1. The equations of motion are
integrated with one fourth-order Runge-Kutta step of 0.2 s, as in Gymnasium, over all copies
at once: the state is float64 with one contiguous row per variable.
"""

from __future__ import annotations

from math import pi

import numpy as np
from gymnasium import spaces

from shoal.envs.batched import BatchedDynamics, NativeVector, SingleEnv

DT = 0.2
LINK_LENGTH_1 = 1.0
LINK_MASS_1 = 1.0
LINK_MASS_2 = 1.0
LINK_COM_1 = 0.5
LINK_COM_2 = 0.5
LINK_MOI = 1.0
GRAVITY = 9.8
MAX_VEL_1 = 4 * pi
MAX_VEL_2 = 9 * pi
TORQUES = np.array([-1.0, 0.0, 1.0])
RESET_BOUND = 0.1

_HIGH = np.array([1.0, 1.0, 1.0, 1.0, MAX_VEL_1, MAX_VEL_2], dtype=np.float32)


def derivatives(s: np.ndarray, torque: np.ndarray) -> np.ndarray:
    """d(state)/dt for states [4, N] under `torque` [N] (the "book" equations)."""
    m1, m2, l1, lc1, lc2 = LINK_MASS_1, LINK_MASS_2, LINK_LENGTH_1, LINK_COM_1, LINK_COM_2
    i1 = i2 = LINK_MOI
    theta1, theta2, dtheta1, dtheta2 = s
    cos2 = np.cos(theta2)
    sin2 = np.sin(theta2)
    d1 = m1 * lc1**2 + m2 * (l1**2 + lc2**2 + 2 * l1 * lc2 * cos2) + i1 + i2
    d2 = m2 * (lc2**2 + l1 * lc2 * cos2) + i2
    phi2 = m2 * lc2 * GRAVITY * np.cos(theta1 + theta2 - pi / 2.0)
    phi1 = (
        -m2 * l1 * lc2 * dtheta2**2 * sin2
        - 2 * m2 * l1 * lc2 * dtheta2 * dtheta1 * sin2
        + (m1 * lc1 + m2 * l1) * GRAVITY * np.cos(theta1 - pi / 2)
        + phi2
    )
    ddtheta2 = (torque + d2 / d1 * phi1 - m2 * l1 * lc2 * dtheta1**2 * sin2 - phi2) / (
        m2 * lc2**2 + i2 - d2**2 / d1
    )
    ddtheta1 = -(d2 * ddtheta2 + phi1) / d1
    return np.stack((dtheta1, dtheta2, ddtheta1, ddtheta2))


def _wrap(x: np.ndarray, low: float, high: float) -> None:
    """Bring angles into [low, high] in place by whole turns, as Gymnasium's `wrap` does."""
    turn = high - low
    while (above := x > high).any():
        x[above] -= turn
    while (below := x < low).any():
        x[below] += turn


class AcrobotDynamics(BatchedDynamics):
    """N acrobots; reward -1 per step until the tip is above the bar (0 on that step)."""

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs
        self.observation_space = spaces.Box(-_HIGH, _HIGH, dtype=np.float32)
        self.action_space = spaces.Discrete(3)
        self.state = np.zeros((4, num_envs), dtype=np.float64)

    def reset_rows(self, rows: np.ndarray, rng: np.random.Generator) -> None:
        draw = rng.uniform(-RESET_BOUND, RESET_BOUND, size=(len(rows), 4)).astype(np.float32)
        self.state[:, rows] = draw.T

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        torque = TORQUES[actions]
        y0 = self.state
        half = DT / 2.0
        k1 = derivatives(y0, torque)
        k2 = derivatives(y0 + half * k1, torque)
        k3 = derivatives(y0 + half * k2, torque)
        k4 = derivatives(y0 + DT * k3, torque)
        state = y0 + DT / 6.0 * (k1 + 2 * k2 + 2 * k3 + k4)
        _wrap(state[0], -pi, pi)
        _wrap(state[1], -pi, pi)
        np.clip(state[2], -MAX_VEL_1, MAX_VEL_1, out=state[2])
        np.clip(state[3], -MAX_VEL_2, MAX_VEL_2, out=state[3])
        self.state = state
        terminated = -np.cos(state[0]) - np.cos(state[1] + state[0]) > 1.0
        return terminated.astype(np.float32) - 1.0, terminated

    def observe(self) -> np.ndarray:
        theta1, theta2, dtheta1, dtheta2 = self.state
        return np.stack(
            (np.cos(theta1), np.sin(theta1), np.cos(theta2), np.sin(theta2), dtheta1, dtheta2),
            axis=1,
        ).astype(np.float32)


def make_single() -> SingleEnv:
    """One Acrobot behind `BaseEnvironment` (the registry adds the 500-step time limit)."""
    return SingleEnv(AcrobotDynamics(1))


def make_batched(
    num_envs: int, seed: int | None = None, max_episode_steps: int | None = 500
) -> NativeVector:
    """N Acrobots integrated together, one Runge-Kutta step for the whole batch."""
    return NativeVector(AcrobotDynamics(num_envs), max_episode_steps, seed)
