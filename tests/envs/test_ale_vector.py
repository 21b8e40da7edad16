"""ale-py's C++ vector behind the `atari` set (envs/ale_vector.py), on real games: what it is
chosen for, the frames it gives, the learner's episodes (lives) against the reported ones
(games, unclipped), seeding, the frame before a time-limit reset, refusals and cleanup, and its
halves' split-phase steps (the same frames as the whole vector's)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.envs.ale_vector import (
    MAX_FRAMES,
    AleVector,
    AleVectorError,
    check_frames,
    check_probability,
    group_slices,
)
from shoal.envs.atari import AtariOptions
from shoal.envs.errors import EnvError, InvalidAction
from shoal.envs.hashing import HashStore, env_hash
from shoal.envs.vector import VectorRunner, VectorStep, make_vector
from shoal.envs.wrappers import EnvConfig
from tests.support.train_cli import run_train

pytest.importorskip("ale_py.vector_env", reason="ale-py 0.10+ (the envs extra) is not installed")

ATARI = EnvConfig(wrappers=({"name": "atari", "kwargs": {}},))
UNCLIPPED = EnvConfig(wrappers=({"name": "atari", "kwargs": {"clip_rewards": False}},))


def _run(vec: AleVector | VectorRunner, steps: int, seed: int = 0) -> list[VectorStep]:
    rng = np.random.default_rng(seed)
    vec.reset()
    n = vec.single_action_space.n  # type: ignore[attr-defined]
    return [vec.step(rng.integers(0, n, vec.num_envs)) for _ in range(steps)]


def test_the_atari_set_alone_on_an_ale_game_runs_natively_anything_else_per_copy() -> None:
    with make_vector("gym:ALE/Pong-v5", 2, seed=0, env=ATARI) as vec:
        assert isinstance(vec, AleVector)
        assert vec.single_observation_space.shape == (4, 84, 84)
        assert vec.single_observation_space.dtype == np.uint8
        obs = vec.reset()
        assert obs.shape == (2, 4, 84, 84)
        assert obs.dtype == np.uint8
        step = vec.step(np.zeros(2, dtype=np.int64))
        assert step.obs.dtype == np.uint8
        assert step.obs[:, -1].max() > 0
        assert step.reward.dtype == np.float32
        assert step.done.dtype == bool
    with_clip = EnvConfig(
        wrappers=(
            *ATARI.wrappers,
            {"name": "ClipReward", "kwargs": {"min_reward": -1, "max_reward": 1}},
        )
    )
    for env, kwargs in ((with_clip, {}), (ATARI, {"mode": 0})):  # mode: no C++ equivalent
        with make_vector("gym:ALE/Pong-v5", 1, seed=0, env=env, **kwargs) as vec:
            assert isinstance(vec, VectorRunner)


def test_the_environment_hash_names_the_backend_whose_frames_it_gets(tmp_path: Path) -> None:
    store = HashStore(tmp_path)
    native = env_hash("gym:ALE/Pong-v5", {}, 0, store=store, wrappers=ATARI)
    per_copy = env_hash("gym:ALE/Pong-v5", {"mode": 0}, 0, store=store, wrappers=ATARI)
    _, manifest = store.load(native)
    assert manifest["env"]["backend"] == "ale_py.AtariVectorEnv"
    assert "backend" not in store.load(per_copy)[1]["env"]


def test_a_lost_life_ends_the_learners_episode_and_only_a_game_over_is_reported() -> None:
    with make_vector("gym:ALE/Breakout-v5", 2, seed=3, env=ATARI) as vec:
        steps = _run(vec, 1500)
    dones = sum(int(s.done.sum()) for s in steps)
    games = sum(int(s.ended.sum()) for s in steps)
    assert games >= 2
    # 5 lives: every game is at least 5 learner episodes, the last life ending both.
    assert dones >= 5 * games
    for s in steps:
        assert not (s.ended & ~s.done).any()
        assert (s.episode_length[s.ended] > 0).all()
        assert (s.episode_return[~s.ended] == 0).all()


def test_rewards_are_clipped_for_the_learner_but_games_report_their_own_score() -> None:
    # Space Invaders scores 5-30 points an alien: clipping shows. Same seed, same actions:
    # the two vectors play the same games, one reports what the other's learner is given.
    kwargs = {"max_episode_steps": 2000}
    with make_vector("gym:ALE/SpaceInvaders-v5", 2, seed=7, env=ATARI, **kwargs) as clipped:
        learner = _run(clipped, 600)
    with make_vector("gym:ALE/SpaceInvaders-v5", 2, seed=7, env=UNCLIPPED, **kwargs) as raw:
        game = _run(raw, 600)
    assert max(float(s.reward.max()) for s in game) > 1
    totals = np.zeros(2)
    ended = 0
    for c, r in zip(learner, game, strict=True):
        assert np.array_equal(c.reward, np.sign(r.reward))
        assert np.array_equal(c.episode_return, r.episode_return)
        totals += r.reward
        assert np.allclose(r.episode_return[r.ended], totals[r.ended])
        totals[r.ended] = 0.0
        ended += int(r.ended.sum())
    assert ended >= 2


def test_the_same_seed_plays_the_same_episodes_and_another_seed_does_not() -> None:
    def play(seed: int) -> list[VectorStep]:
        with make_vector("gym:ALE/Breakout-v5", 3, seed=seed, env=ATARI) as vec:
            return _run(vec, 200)

    first, again, other = play(11), play(11), play(12)
    for a, b in zip(first, again, strict=True):
        assert np.array_equal(a.obs, b.obs)
        assert np.array_equal(a.reward, b.reward)
        assert np.array_equal(a.done, b.done)
    assert any(not np.array_equal(a.obs, c.obs) for a, c in zip(first, other, strict=True))


def test_a_time_limit_truncates_and_final_obs_continues_the_last_frames() -> None:
    limit_frames = 80  # 20 steps of 4 frames: the per-copy path's limit is in frames too
    with make_vector(
        "gym:ALE/Pong-v5", 2, seed=0, env=ATARI, max_episode_steps=limit_frames
    ) as vec:
        steps = _run(vec, 45)
    cut = [t for t, s in enumerate(steps) if s.truncated.any()]
    assert cut == [19, 39]
    for t in cut:
        s, before = steps[t], steps[t - 1]
        assert s.truncated.all()
        assert s.done.all()
        assert s.ended.all()
        assert (s.episode_length == 20).all()
        # The frame before the reset is the stack one step on from the previous observation.
        assert np.array_equal(s.final_obs[:, :3], before.obs[:, 1:])
        assert not np.array_equal(s.final_obs, s.obs)
    assert all(np.array_equal(s.final_obs, s.obs) for s in steps if not s.done.any())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"repeat_action_probability": 1.5}, "repeat_action_probability"),
        ({"repeat_action_probability": "0.25"}, "repeat_action_probability"),
        ({"full_action_space": "yes"}, "full_action_space"),
        ({"max_episode_steps": 0}, "max_episode_steps"),
        ({"max_num_frames_per_episode": 2**40}, "max_num_frames_per_episode"),
        ({"frameskip": 4}, "frameskip"),
        ({"game": "../../etc/passwd"}, "game"),
    ],
)
def test_keyword_arguments_it_cannot_take_are_refused_by_name(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(EnvError, match=message):
        make_vector("gym:ALE/Pong-v5", 1, seed=0, env=ATARI, **kwargs)


@given(st.one_of(st.floats(allow_nan=True), st.integers(), st.booleans(), st.text(max_size=4)))
def test_only_a_number_in_0_1_is_a_sticky_action_probability(value: object) -> None:
    valid = (
        not isinstance(value, bool | str)
        and math.isfinite(value)  # type: ignore[arg-type]
        and 0 <= value <= 1  # type: ignore[operator]
    )
    if valid:
        assert check_probability(value) == float(value)  # type: ignore[arg-type]
    else:
        with pytest.raises(AleVectorError, match="repeat_action_probability"):
            check_probability(value)


@given(st.one_of(st.integers(), st.floats(), st.booleans(), st.none()))
def test_only_a_c_int_of_frames_is_a_time_limit(value: object) -> None:
    if type(value) is int and 1 <= value <= MAX_FRAMES:
        assert check_frames("max_episode_steps", value) == value
    else:
        with pytest.raises(AleVectorError, match="max_episode_steps"):
            check_frames("max_episode_steps", value)


def test_close_joins_the_emulator_threads_and_a_closed_vector_says_so() -> None:
    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    before = threads()
    vec = make_vector("gym:ALE/Pong-v5", 4, seed=0, env=ATARI)
    vec.reset()
    assert threads() > before
    vec.close()
    assert threads() == before
    vec.close()  # twice is harmless
    with pytest.raises(EnvError, match="closed"):
        vec.reset()


def test_groups_are_contiguous_near_equal_slices_and_a_bad_count_is_refused() -> None:
    assert group_slices(8, 2) == (slice(0, 4), slice(4, 8))
    assert group_slices(5, 3) == (slice(0, 2), slice(2, 4), slice(4, 5))
    assert group_slices(1, 1) == (slice(0, 1),)
    for bad in (0, 6, True, 2.0):
        with pytest.raises(AleVectorError, match="groups"):
            group_slices(5, bad)  # type: ignore[arg-type]
    with make_vector("gym:ALE/Pong-v5", 1, seed=0, env=ATARI) as one:
        assert isinstance(one, AleVector)
        assert one.groups == (slice(0, 1),)


def test_split_phase_steps_of_the_halves_are_the_whole_vectors_steps() -> None:
    # Sticky actions on (v5): each copy's emulator depends on its own seed and actions alone.
    whole = AleVector("ALE/Pong-v5", 4, AtariOptions(), {}, seed=3, groups=1)
    halves = AleVector("ALE/Pong-v5", 4, AtariOptions(), {}, seed=3, groups=2)
    try:
        assert np.array_equal(whole.reset(), halves.reset())
        rng = np.random.default_rng(0)
        for _ in range(40):
            actions = rng.integers(0, 6, 4)
            expected = whole.step(actions)
            halves.step_async(1, actions[2:])  # any order, both in flight at once
            halves.step_async(0, actions[:2])
            first, second = halves.step_wait(0), halves.step_wait(1)
            for name in ("obs", "reward", "done", "truncated", "final_obs", "episode_return"):
                got = np.concatenate([getattr(first, name), getattr(second, name)])
                assert np.array_equal(getattr(expected, name), got), name
    finally:
        whole.close()
        halves.close()


def test_split_phase_misuse_is_refused_and_reset_ends_a_step_in_flight() -> None:
    with AleVector("ALE/Pong-v5", 4, AtariOptions(), {}, seed=0) as vec:
        assert isinstance(vec, AleVector)
        vec.reset()
        with pytest.raises(AleVectorError, match="not stepping"):
            vec.step_wait(0)
        with pytest.raises(InvalidAction, match="shape"):
            vec.step_async(0, np.zeros(4, dtype=np.int64))  # a whole vector's actions
        vec.step_async(0, np.zeros(2, dtype=np.int64))
        with pytest.raises(AleVectorError, match="already stepping"):
            vec.step_async(0, np.zeros(2, dtype=np.int64))
        assert vec.reset().shape == (4, 4, 84, 84)  # the step in flight is received and dropped
        with pytest.raises(AleVectorError, match="not stepping"):
            vec.step_wait(0)
        assert vec.step(np.zeros(4, dtype=np.int64)).obs.shape == (4, 4, 84, 84)


@pytest.mark.timeout(300)
def test_shoal_train_steps_breakout_through_the_native_vector(tmp_path: Path) -> None:
    summary = run_train(
        "gym:ALE/Breakout-v5", "--wrapper", "atari", "--max-env-steps", "2048", "--seed", "1",
        "--no-eval", "--quiet", run_dir=tmp_path / "run", timeout=280,
        codes=(0, 1),  # 1: ran, target not reached
    )  # fmt: skip
    assert summary["env_steps"] >= 2048
    assert summary["intake"]["trained"] >= 2
    trainer = json.loads(Path(summary["checkpoint"], "trainer.json").read_text())
    assert trainer["policy_spec"]["family"] == "cnn"
