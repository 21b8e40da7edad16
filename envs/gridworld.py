"""GridWorld: reach the goal through rooms whose doors open with the matching key, batched.

Each copy plays one layout drawn (at every reset) from its family; see `gridworld_layout`
for how families are generated and for the planner. The observation is five flattened
planes (wall, agent, goal, key, closed door) followed by one flag per key held, float32.
Reward is 1 on reaching the goal and `-step_cost` on every other step.
"""

from __future__ import annotations

import functools

import numpy as np
from gymnasium import spaces

from shoal.envs.batched import BatchedDynamics, NativeVector, SingleEnv
from shoal.envs.errors import EnvError
from shoal.envs.gridworld_layout import (
    DOOR_BASE,
    EMPTY,
    GOAL,
    KEY_BASE,
    MAX_KEYS,
    MOVES,
    WALL,
    GridState,
    Layout,
    LayoutConfig,
    NoPath,
    generate,
    shortest_path_actions,
)
from shoal.errors import ConfigError

__all__ = [
    "GridState",
    "GridWorldDynamics",
    "LayoutConfig",
    "NoPath",
    "layout_family",
    "make_batched",
    "make_single",
    "shortest_path_actions",
]

PLANES = 5


@functools.lru_cache(maxsize=64)
def layout_family(config: LayoutConfig) -> tuple[Layout, ...]:
    """Every layout of the family, generated once per process (making many copies is cheap)."""
    return tuple(generate(config, config.first_seed + i) for i in range(config.num_layouts))


class GridWorldDynamics(BatchedDynamics):
    """N copies, each on its own layout of one family."""

    def __init__(self, num_envs: int, config: LayoutConfig, step_cost: float = 0.01) -> None:
        if isinstance(step_cost, bool) or not isinstance(step_cost, int | float) or step_cost < 0:
            raise ConfigError(f"step_cost={step_cost!r}: expected a number >= 0")
        layouts = layout_family(config)
        self.config = config
        self.step_cost = float(step_cost)
        self.num_envs = num_envs
        size = config.size
        self._templates = np.stack([layout.cells for layout in layouts])
        self._starts = np.array([layout.start for layout in layouts], dtype=np.int64)
        self._rows = np.arange(num_envs)
        self.cells = np.zeros((num_envs, size, size), dtype=np.int8)
        self.pos = np.zeros((num_envs, 2), dtype=np.int64)
        self.held = np.zeros((num_envs, MAX_KEYS), dtype=bool)
        self.layout_index = np.zeros(num_envs, dtype=np.int64)
        obs_size = PLANES * size * size + config.num_keys
        self.observation_space = spaces.Box(0.0, 1.0, shape=(obs_size,), dtype=np.float32)
        self.action_space = spaces.Discrete(len(MOVES))

    def reset_rows(self, rows: np.ndarray, rng: np.random.Generator) -> None:
        chosen = rng.integers(len(self._templates), size=len(rows))
        self.layout_index[rows] = chosen
        self.cells[rows] = self._templates[chosen]
        self.pos[rows] = self._starts[chosen]
        self.held[rows] = False

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = self._rows
        new = self.pos + MOVES[actions]
        target = self.cells[rows, new[:, 0], new[:, 1]]
        is_door = (target >= DOOR_BASE) & (target < DOOR_BASE + MAX_KEYS)
        door = np.where(is_door, target - DOOR_BASE, 0)
        moves = (target != WALL) & ~(is_door & ~self.held[rows, door])
        self.pos[moves] = new[moves]
        is_key = moves & (target >= KEY_BASE) & (target < KEY_BASE + MAX_KEYS)
        picked = np.flatnonzero(is_key)
        self.held[picked, target[picked] - KEY_BASE] = True
        cleared = np.flatnonzero(is_key | (moves & is_door))
        self.cells[cleared, new[cleared, 0], new[cleared, 1]] = EMPTY
        terminated = moves & (target == GOAL)
        reward = np.where(terminated, np.float32(1.0), np.float32(-self.step_cost))
        return reward.astype(np.float32), terminated

    def observe(self) -> np.ndarray:
        n, size = self.num_envs, self.config.size
        cells = self.cells
        planes = np.zeros((n, PLANES, size, size), dtype=np.float32)
        planes[:, 0] = cells == WALL
        planes[self._rows, 1, self.pos[:, 0], self.pos[:, 1]] = 1.0
        planes[:, 2] = cells == GOAL
        planes[:, 3] = (cells >= KEY_BASE) & (cells < KEY_BASE + MAX_KEYS)
        planes[:, 4] = (cells >= DOOR_BASE) & (cells < DOOR_BASE + MAX_KEYS)
        held = self.held[:, : self.config.num_keys].astype(np.float32)
        return np.concatenate((planes.reshape(n, -1), held), axis=1)

    def state_of(self, index: int) -> GridState:
        """Copy `index`'s situation, for the planner (a snapshot: later steps don't change it)."""
        if not 0 <= index < self.num_envs:
            raise EnvError(f"no copy {index}: this batch has copies 0..{self.num_envs - 1}")
        held = tuple(bool(h) for h in self.held[index, : self.config.num_keys])
        agent = (int(self.pos[index, 0]), int(self.pos[index, 1]))
        return GridState(self.cells[index].copy(), agent, held)

    def expert_actions(self) -> np.ndarray:
        """The first action of a shortest plan for every copy: a demonstrator for the batch."""
        return np.array(
            [shortest_path_actions(self.state_of(i))[0] for i in range(self.num_envs)],
            dtype=np.int64,
        )


def make_single(
    size: int = 8,
    num_keys: int = 1,
    wall_density: float = 0.1,
    first_seed: int = 0,
    num_layouts: int = 1,
    step_cost: float = 0.01,
) -> SingleEnv:
    """One GridWorld copy; `env.unwrapped.dynamics.state_of(0)` feeds the planner."""
    config = LayoutConfig(size, num_keys, wall_density, first_seed, num_layouts)
    return SingleEnv(GridWorldDynamics(1, config, step_cost))


def make_batched(
    num_envs: int,
    seed: int | None = None,
    max_episode_steps: int | None = 256,
    size: int = 8,
    num_keys: int = 1,
    wall_density: float = 0.1,
    first_seed: int = 0,
    num_layouts: int = 1,
    step_cost: float = 0.01,
) -> NativeVector:
    """N GridWorld copies stepped with whole-array operations."""
    config = LayoutConfig(size, num_keys, wall_density, first_seed, num_layouts)
    return NativeVector(GridWorldDynamics(num_envs, config, step_cost), max_episode_steps, seed)
