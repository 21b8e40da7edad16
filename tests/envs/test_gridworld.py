"""GridWorld: generated layouts are solvable, the planner's plans are shortest and work in the
batched environment, the Train and HeldOut families are disjoint, bad parameters are refused."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.envs import EnvError, make, make_vector
from shoal.envs.gridworld import (
    GridState,
    LayoutConfig,
    NoPath,
    layout_family,
    shortest_path_actions,
)
from shoal.envs.gridworld_layout import DOOR_BASE, EMPTY, GOAL, KEY_BASE, WALL, generate
from shoal.errors import ConfigError

configs = st.builds(
    LayoutConfig,
    size=st.integers(7, 12),
    num_keys=st.integers(0, 1),
    wall_density=st.floats(0.0, 0.3),
    first_seed=st.integers(0, 10**6),
    num_layouts=st.just(1),
)


@settings(max_examples=40, deadline=None)
@given(config=configs)
def test_plan_reaches_the_goal_in_the_batched_env(config):
    vector = make_vector(
        "GridWorld-v1",
        1,
        seed=0,
        size=config.size,
        num_keys=config.num_keys,
        wall_density=config.wall_density,
        first_seed=config.first_seed,
    )
    vector.reset()
    plan = shortest_path_actions(vector.dynamics.state_of(0))
    assert plan
    for n, action in enumerate(plan, start=1):
        step = vector.step(np.array([action]))
        assert bool(step.done[0]) == (n == len(plan))
    assert step.reward[0] == 1.0
    assert not step.truncated[0]
    assert step.episode_length[0] == len(plan)


@settings(max_examples=30, deadline=None)
@given(size=st.integers(5, 16), seed=st.integers(0, 10**6))
def test_plans_in_open_rooms_are_manhattan_shortest(size, seed):
    layout = generate(LayoutConfig(size, 0, 0.0, seed, 1), seed)
    goal = tuple(int(v) for v in np.argwhere(layout.cells == GOAL)[0])
    plan = shortest_path_actions(GridState(layout.cells, layout.start, ()))
    assert len(plan) == abs(goal[0] - layout.start[0]) + abs(goal[1] - layout.start[1])


@settings(max_examples=30, deadline=None)
@given(config=configs)
def test_plans_are_never_shorter_than_the_manhattan_distance(config):
    layout = generate(config, config.first_seed)
    goal = np.argwhere(layout.cells == GOAL)[0]
    plan = shortest_path_actions(GridState(layout.cells, layout.start, (False,) * config.num_keys))
    assert len(plan) >= abs(goal[0] - layout.start[0]) + abs(goal[1] - layout.start[1])


def test_a_closed_door_blocks_until_its_key_is_held():
    cells = np.full((5, 7), WALL, dtype=np.int8)
    cells[2, 1:6] = [EMPTY, EMPTY, DOOR_BASE, EMPTY, GOAL]
    cells[1, 1] = KEY_BASE
    cells[1, 2] = EMPTY
    without_key = GridState(cells, (2, 2), (False,))
    plan = shortest_path_actions(without_key)
    assert len(plan) == 7
    assert plan[:2] == [0, 3], "fetch the key first, then go through the door"
    with pytest.raises(NoPath, match=r"the goal cannot be reached from \(2, 2\)"):
        shortest_path_actions(
            GridState(np.where(cells == KEY_BASE, EMPTY, cells), (2, 2), (False,))
        )
    assert shortest_path_actions(GridState(cells, (2, 2), (True,))) == [1, 1, 1]


def test_expert_actions_solve_every_copy():
    vector = make_vector("GridWorld-Train-v1", 32, seed=5)
    vector.reset()
    solved = np.zeros(32, dtype=bool)
    for _ in range(60):
        step = vector.step(vector.dynamics.expert_actions())
        solved |= step.done & ~step.truncated
        assert (step.reward[step.done] == 1.0).all()
        if solved.all():
            break
    assert solved.all()


def test_train_and_held_out_layouts_are_disjoint():
    train = make_vector("GridWorld-Train-v1", 1).dynamics.config
    held_out = make_vector("GridWorld-HeldOut-v1", 1).dynamics.config
    seen = {layout.cells.tobytes() + bytes(layout.start) for layout in layout_family(train)}
    assert len(seen) > 150, "the training family should hold many distinct layouts"
    for layout in layout_family(held_out):
        assert layout.cells.tobytes() + bytes(layout.start) not in seen


def test_observation_planes():
    env = make("GridWorld-Empty-v1")
    env.seed(3)
    obs, _ = env.reset()
    assert env.observation_space.contains(obs)
    planes = obs.reshape(5, 8, 8)
    state = env.unwrapped.dynamics.state_of(0)
    assert planes[1, state.agent[0], state.agent[1]] == 1.0
    assert planes[1].sum() == 1.0
    np.testing.assert_array_equal(planes[0], state.cells == WALL)
    np.testing.assert_array_equal(planes[2], state.cells == GOAL)


def test_moving_into_a_wall_stays_put():
    env = make("GridWorld-Empty-v1")
    env.reset()
    dynamics = env.unwrapped.dynamics
    dynamics.pos[0] = (1, 1)
    dynamics.cells[0][dynamics.cells[0] == GOAL] = EMPTY
    dynamics.cells[0, 6, 6] = GOAL
    env.step(0)
    assert dynamics.state_of(0).agent == (1, 1)
    env.step(3)
    assert dynamics.state_of(0).agent == (1, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"size": 4}, r"size=4: expected an integer in \[5, 64\]"),
        ({"num_keys": 9}, r"num_keys=9: expected an integer in \[0, 4\]"),
        (
            {"num_keys": 2, "size": 8},
            "num_keys=2 does not fit size=8: each of the 3 rooms needs 2 columns, so size must be at least 10",
        ),
        ({"wall_density": 0.9}, r"wall_density=0.9: expected a number in \[0, 0.5\]"),
        ({"step_cost": -1}, "step_cost=-1: expected a number >= 0"),
    ],
)
def test_bad_parameters_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        make("GridWorld-v1", **kwargs)


def test_state_of_refuses_a_missing_copy():
    vector = make_vector("GridWorld-v1", 2)
    with pytest.raises(EnvError, match=r"no copy 2: this batch has copies 0..1"):
        vector.dynamics.state_of(2)
