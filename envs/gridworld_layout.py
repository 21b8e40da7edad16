"""GridWorld layouts (walls, keys, doors, goal) and the shortest-path planner over them.

Pure logic, no environment: a `Layout` is generated from a seed, so a family of layouts is a
range of seeds, and two families with disjoint ranges never share a layout (the held-out
set for generalisation tests). Key k opens door k; a door stays passable once its key is held.
The planner searches (position, keys held) breadth-first, so its plans are shortest.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from shoal.config import check_int
from shoal.envs.errors import EnvError
from shoal.errors import ConfigError

EMPTY, WALL, GOAL = 0, 1, 2
KEY_BASE = 10  # key k is KEY_BASE + k
DOOR_BASE = 20  # door k is DOOR_BASE + k
MAX_KEYS = 4

# action -> (row delta, column delta): up, right, down, left
MOVES = np.array([[-1, 0], [0, 1], [1, 0], [0, -1]], dtype=np.int64)

# a planner node: (agent position, keys held)
Node = tuple[tuple[int, int], tuple[bool, ...]]


class NoPath(EnvError):
    """The goal cannot be reached from this state (a layout generator bug, or a hand-made state)."""


@dataclass(frozen=True)
class LayoutConfig:
    """How a family of layouts is generated.

    size: side of the square grid, border walls included. num_keys: key/door pairs; the grid is
    split into num_keys + 1 rooms by walls with one door each, the goal in the last room.
    wall_density: fraction of the remaining free cells turned into walls (solvability is kept).
    first_seed, num_layouts: the family is the layouts of seeds first_seed .. first_seed+num_layouts-1.
    """

    size: int = 8
    num_keys: int = 1
    wall_density: float = 0.1
    first_seed: int = 0
    num_layouts: int = 1

    def __post_init__(self) -> None:
        _check_int("size", self.size, 5, 64)
        _check_int("num_keys", self.num_keys, 0, MAX_KEYS)
        _check_int("first_seed", self.first_seed, 0, 2**63 - 1)
        _check_int("num_layouts", self.num_layouts, 1, 100_000)
        if isinstance(self.wall_density, bool) or not isinstance(self.wall_density, int | float):
            raise ConfigError(f"wall_density={self.wall_density!r}: expected a number in [0, 0.5]")
        if not 0.0 <= self.wall_density <= 0.5:
            raise ConfigError(f"wall_density={self.wall_density!r}: expected a number in [0, 0.5]")
        rooms = self.num_keys + 1
        if self.size - 2 - self.num_keys < 2 * rooms:
            raise ConfigError(
                f"num_keys={self.num_keys} does not fit size={self.size}: each of the "
                f"{rooms} rooms needs 2 columns, so size must be at least {3 * rooms + 1}"
            )


def _check_int(key: str, value: object, low: int, high: int) -> None:
    """shoal.config.check_int in the words of the environment's other parameter errors."""
    try:
        check_int(key, value, low, high)
    except ConfigError:
        raise ConfigError(f"{key}={value!r}: expected an integer in [{low}, {high}]") from None


@dataclass(frozen=True)
class Layout:
    """A grid of cell codes (walls, keys, doors, goal) and where the agent starts."""

    cells: np.ndarray
    start: tuple[int, int]


@dataclass(frozen=True)
class GridState:
    """One copy's situation: the current cells (keys picked and doors opened are EMPTY), the
    agent's position and which keys it holds."""

    cells: np.ndarray
    agent: tuple[int, int]
    held: tuple[bool, ...]


def generate(config: LayoutConfig, seed: int) -> Layout:
    """The layout of `seed`: rooms, doors, keys, goal, then random walls that keep it solvable."""
    rng = np.random.default_rng(seed)
    for _ in range(100):
        layout = _attempt(config, rng)
        state = GridState(layout.cells, layout.start, (False,) * config.num_keys)
        try:
            shortest_path_actions(state)
        except NoPath:
            continue
        return layout
    raise EnvError(f"no solvable layout for {config} with seed {seed}; lower wall_density")


def _attempt(config: LayoutConfig, rng: np.random.Generator) -> Layout:
    size, keys = config.size, config.num_keys
    cells = np.full((size, size), WALL, dtype=np.int8)
    cells[1:-1, 1:-1] = EMPTY
    interior = size - 2
    room_width = (interior - keys) // (keys + 1)
    rooms: list[tuple[int, int]] = []
    left = 1
    for k in range(keys + 1):
        right = left + room_width if k < keys else size - 1
        rooms.append((left, right))
        if k < keys:
            door_row = int(rng.integers(1, size - 1))
            cells[1:-1, right] = WALL
            cells[door_row, right] = DOOR_BASE + k
        left = right + 1
    fixed: list[tuple[int, int]] = []
    start = _free_cell(cells, rooms[0], rng, fixed)
    for k in range(keys):
        cells[_free_cell(cells, rooms[k], rng, fixed)] = KEY_BASE + k
    cells[_free_cell(cells, rooms[-1], rng, fixed)] = GOAL
    free = [
        (r, c)
        for r in range(1, size - 1)
        for c in range(1, size - 1)
        if cells[r, c] == EMPTY and (r, c) not in fixed
    ]
    count = round(config.wall_density * len(free))
    for index in rng.choice(len(free), size=count, replace=False) if count else ():
        cells[free[int(index)]] = WALL
    return Layout(cells, start)


def _free_cell(
    cells: np.ndarray, room: tuple[int, int], rng: np.random.Generator, taken: list[tuple[int, int]]
) -> tuple[int, int]:
    """A random empty cell inside the columns of `room`, not already taken; records it."""
    left, right = room
    candidates = [
        (r, c)
        for r in range(1, cells.shape[0] - 1)
        for c in range(left, right)
        if cells[r, c] == EMPTY and (r, c) not in taken
    ]
    cell = candidates[int(rng.integers(len(candidates)))]
    taken.append(cell)
    return cell


def transition(
    cells: np.ndarray, agent: tuple[int, int], held: tuple[bool, ...], action: int
) -> tuple[tuple[int, int], tuple[bool, ...]]:
    """Where one action leads (position, keys held); the batched step follows the same rules."""
    row, col = agent[0] + int(MOVES[action, 0]), agent[1] + int(MOVES[action, 1])
    cell = int(cells[row, col])
    if cell == WALL or (DOOR_BASE <= cell < DOOR_BASE + MAX_KEYS and not held[cell - DOOR_BASE]):
        return agent, held
    if KEY_BASE <= cell < KEY_BASE + MAX_KEYS:
        held = tuple(h or k == cell - KEY_BASE for k, h in enumerate(held))
    return (row, col), held


def shortest_path_actions(state: GridState) -> list[int]:
    """A shortest list of actions that takes the agent from `state` to the goal.

    Raises `NoPath` when the goal is unreachable. Cells of keys already held are treated as
    empty, so a plan made mid-episode is valid from where the agent stands.
    """
    cells = state.cells
    start: Node = (state.agent, tuple(state.held))
    if cells[state.agent] == GOAL:
        return []
    parents: dict[Node, tuple[Node | None, int]] = {start: (None, -1)}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for action in range(len(MOVES)):
            nxt = transition(cells, node[0], node[1], action)
            if nxt in parents:
                continue
            parents[nxt] = (node, action)
            if cells[nxt[0]] == GOAL:
                return _unwind(parents, nxt)
            queue.append(nxt)
    raise NoPath(f"the goal cannot be reached from {state.agent} holding keys {state.held}")


def _unwind(parents: dict[Node, tuple[Node | None, int]], node: Node) -> list[int]:
    actions: list[int] = []
    parent, action = parents[node]
    while parent is not None:
        actions.append(action)
        parent, action = parents[parent]
    return actions[::-1]
