"""The `atari` set run by the Arcade Learning Environment's own C++ vector (`AtariVectorEnv`).

The per-copy path (envs/atari.py around each Gymnasium copy, stepped one after another by
`VectorRunner`) spends most of its time in Python: four emulator calls, a max-pool, a resize
and a frame stack per copy per step. ale-py ships the same preprocessing in C++, stepping the
copies on its own threads, so `make_vector` uses it for an ALE game whose job applies the
`atari` set alone (any other wrapper or normalisation keeps the per-copy path, which composes).

Two parts stay here, in numpy, because the learner and the reports need them as the per-copy
path gives them: a lost life ends the learner's episode (`done`) while `episode_end`,
`episode_return` and `episode_length` describe whole games with the game's unclipped score, so
the emulator runs without its own episodic life and reward clipping and both are applied to
its output. Frames differ from the per-copy path's (OpenCV's area resize of the emulator's grey
palette, FIRE once before the no-ops and never after a lost life), so the environment hash
records the backend (`backend_manifest`).
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium import spaces

from shoal.envs.atari import AtariOptions, ale_make_kwargs, is_ale
from shoal.envs.errors import EnvError
from shoal.envs.vector import SplitStepVector, VectorStep, check_actions, check_num_envs

if TYPE_CHECKING:
    from ale_py.vector_env import AtariVectorEnv

    from shoal.envs.wrappers import EnvConfig

BACKEND = "ale_py.AtariVectorEnv"
"""What the environment hash records as the backend of the native path."""

SEED_MODULUS = 2**31
"""The emulator takes a non-negative C int seed: copy i is seeded with (seed + i) mod 2**31."""

MAX_FRAMES = 2**31 - 1
_MAPPED = {
    "game",
    "frameskip",
    "obs_type",
    "repeat_action_probability",
    "full_action_space",
    "max_num_frames_per_episode",
    "max_episode_steps",
}
"""Gymnasium ALE keyword arguments the C++ vector has an equivalent for; with any other (mode,
difficulty, continuous, render_mode...) the per-copy path runs instead."""


class AleVectorError(EnvError):
    """A keyword argument cannot be given to the native Atari vector as it is."""


def native_atari(env_id: str, kwargs: Mapping[str, Any], cfg: EnvConfig | None) -> str | None:
    """The Gymnasium id to run with `AleVector` when `env_id` is an ALE game, the job's `[env]`
    is the `atari` set alone and every keyword argument maps onto the C++ vector; else None."""
    if cfg is None or cfg.normalize_observation or cfg.normalize_reward:
        return None
    if len(cfg.specs) != 1 or cfg.specs[0].name != "atari":
        return None
    gym_id = _gym_id(env_id)
    if gym_id is None or not is_ale(gym_id):
        return None
    game = _game_kwargs(gym_id, kwargs)
    if not set(game) <= _MAPPED or game.get("obs_type") not in ("grayscale", "rgb"):
        return None
    return gym_id if importlib.util.find_spec("ale_py.vector_env") else None


def make_native_atari(
    env_id: str, num_envs: int, seed: int | None, cfg: EnvConfig, kwargs: Mapping[str, Any]
) -> AleVector | None:
    """`AleVector` for `env_id` where `native_atari` chooses it, else None."""
    gym_id = native_atari(env_id, kwargs, cfg)
    if gym_id is None:
        return None
    return AleVector(gym_id, num_envs, AtariOptions(**cfg.specs[0].kwargs), kwargs, seed)


def backend_manifest(env_id: str, kwargs: Mapping[str, Any], cfg: EnvConfig) -> dict[str, Any]:
    """What the environment hash adds for the backend: frames differ between the two paths."""
    return {"backend": BACKEND} if native_atari(env_id, kwargs, cfg) else {}


def _gym_id(env_id: str) -> str | None:
    from shoal.envs.gym_adapter import make_gym
    from shoal.envs.registry import default_registry

    spec = default_registry.spec(env_id)
    return str(spec.kwargs["gym_id"]) if spec.entry_point is make_gym else None


def _game_kwargs(gym_id: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Gymnasium's registered kwargs for the game (its time limit too) with the job's on top;
    a frameskip other than 1 refused as the per-copy path refuses it."""
    import gymnasium

    spec = gymnasium.spec(gym_id)
    registered = dict(spec.kwargs)
    if spec.max_episode_steps is not None:
        registered["max_episode_steps"] = spec.max_episode_steps
    return {**registered, **ale_make_kwargs(gym_id, dict(kwargs))}


def default_threads(num_envs: int, groups: int = 1) -> int:
    """Emulator threads for one group of `num_envs` copies: the cores this process may run on,
    shared among the `groups`, never more than its copies, at least one. The policy runs while
    the threads wait (or, pipelined, while the other group's run), so a rollout worker's copies
    use the cores between forwards; split among two halves on 2 cores, one thread each measured
    faster than two (docs/benchmarks.md, Pong). No pinning (other workers share the cores)."""
    return max(1, min(num_envs, len(os.sched_getaffinity(0)) // groups))


def default_groups(num_envs: int) -> int:
    """Two halves from two copies on, so a collector can compute one half's actions while the
    other half's emulators run (learner/collector.py); one group for a single copy."""
    return 2 if num_envs >= 2 else 1


def group_slices(num_envs: int, groups: int) -> tuple[slice, ...]:
    """`groups` contiguous slices of `num_envs` copies, sizes as equal as possible (the first
    ones one larger), or AleVectorError when a group would be empty."""
    if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= num_envs:
        raise AleVectorError(
            f"groups = {groups!r} is invalid for {num_envs} environments: use 1..{num_envs}"
        )
    size, extra = divmod(num_envs, groups)
    bounds = [g * size + min(g, extra) for g in range(groups + 1)]
    return tuple(slice(lo, hi) for lo, hi in itertools.pairwise(bounds))


class AleVector(SplitStepVector):
    """N copies of one ALE game with the `atari` set, stepped by ale-py's C++ vector.

    Auto-reset is the same step's (`final_obs` is the frame before the reset); sticky actions
    take the id's own probability (0.25 for v5) as the per-copy path does; the time limit
    (`max_episode_steps`, or the game's `max_num_frames_per_episode`) counts emulator frames as
    the per-copy path's does (it makes the game with `frameskip=1`).

    The copies form `groups` (two halves by default, `default_groups`), each its own C++ vector
    with its own threads, so one half can step while a collector computes the other's actions
    (`SplitStepVector`). Copy i is seeded with `seed + i` whatever the grouping, and a copy's
    emulator, sticky actions included, depends on its seed and actions alone: the same seed and
    actions give the same frames grouped or not (tests/envs/test_ale_vector.py checks it).
    """

    def __init__(
        self,
        gym_id: str,
        num_envs: int,
        options: AtariOptions,
        kwargs: Mapping[str, Any],
        seed: int | None = None,
        num_threads: int | None = None,
        groups: int | None = None,
    ) -> None:
        import ale_py  # noqa: F401  (registers the ALE/ ids that _game_kwargs looks up)

        check_num_envs(num_envs)
        game = _game_kwargs(gym_id, kwargs)
        self.num_envs = num_envs
        self.groups = group_slices(num_envs, default_groups(num_envs) if groups is None else groups)
        self._options = options
        self._vecs: list[AtariVectorEnv] | None = _make_groups(
            game, options, self.groups, num_threads
        )
        self._in_flight = [False] * len(self.groups)
        self.single_observation_space = spaces.Box(
            0, 255, (options.frame_stack, options.screen_size, options.screen_size), np.uint8
        )
        self.single_action_space = self._vecs[0].single_action_space
        self._seed = seed
        self._lives = np.zeros(num_envs, dtype=np.int32)
        self._returns = np.zeros(num_envs, dtype=np.float64)
        self._lengths = np.zeros(num_envs, dtype=np.int32)

    def reset(self, seed: int | None = None) -> np.ndarray:
        vecs = self._open()
        self._settle()
        if seed is not None:
            self._seed = seed
        seeds = None
        if self._seed is not None:
            seeds = ((self._seed + np.arange(self.num_envs)) % SEED_MODULUS).astype(np.int64)
            self._seed = None
        parts = []
        for vec, rows in zip(vecs, self.groups, strict=True):
            obs, info = vec.reset(seed=None if seeds is None else seeds[rows])
            self._lives[rows] = info["lives"]
            parts.append(obs)
        self._returns[:] = 0.0
        self._lengths[:] = 0
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def step(self, actions: np.ndarray) -> VectorStep:
        actions = check_actions(actions, self.num_envs, self.single_action_space)
        for g, rows in enumerate(self.groups):
            self.step_async(g, actions[rows])
        steps = [self.step_wait(g) for g in range(len(self.groups))]
        return steps[0] if len(steps) == 1 else _concatenate(steps)

    def step_async(self, group: int, actions: np.ndarray) -> None:
        vec = self._open()[group]
        rows = self.groups[group]
        actions = check_actions(actions, rows.stop - rows.start, self.single_action_space)
        if self._in_flight[group]:
            raise AleVectorError(
                f"group {group} is already stepping: call step_wait({group}) before its next "
                "step_async"
            )
        vec.send(actions.astype(np.int64))
        self._in_flight[group] = True

    def step_wait(self, group: int) -> VectorStep:
        vec = self._open()[group]
        if not self._in_flight[group]:
            raise AleVectorError(f"group {group} is not stepping: call step_async({group}) first")
        try:
            obs, raw, terminated, truncated, info = vec.recv()
        finally:
            self._in_flight[group] = False
        return self._bookkeep(self.groups[group], obs, raw, terminated, truncated, info)

    def _bookkeep(
        self,
        rows: slice,
        obs: np.ndarray,
        raw: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        info: Mapping[str, Any],
    ) -> VectorStep:
        """One group's step as the learner sees it: lives end its episodes, whole games are
        reported with their unclipped score, the frame before an auto-reset kept."""
        game_end = terminated | truncated
        lives = info["lives"]
        done = game_end.copy()
        if self._options.episodic_life:
            done |= (lives < self._lives[rows]) & (lives > 0)
        self._lives[rows] = lives
        final_obs = obs
        if game_end.any():
            final_obs = obs.copy()
            final_obs[game_end] = info["final_obs"][game_end]
        returns, lengths = self._returns[rows], self._lengths[rows]  # views: updated in place
        returns += raw
        lengths += 1
        episode_return = np.where(game_end, returns, 0.0).astype(np.float32)
        episode_length = np.where(game_end, lengths, 0).astype(np.int32)
        returns[game_end] = 0.0
        lengths[game_end] = 0
        reward = np.sign(raw) if self._options.clip_rewards else raw
        return VectorStep(
            obs=obs,
            reward=reward.astype(np.float32),
            done=done,
            truncated=np.asarray(truncated, dtype=bool),
            final_obs=final_obs,
            episode_return=episode_return,
            episode_length=episode_length,
            episode_end=game_end,
        )

    def close(self) -> None:
        """End any step in flight and join the emulator threads: ale-py's own close leaves them
        running until the C++ vector is freed, so the only references to them are dropped."""
        if self._vecs is None:
            return
        try:
            self._settle()
        finally:
            vecs, self._vecs = self._vecs, None
            for vec in vecs:
                vec.close()

    def _settle(self) -> None:
        """Receive (and drop) the steps still in flight, as after an abandoned fragment."""
        for group, vec in enumerate(self._open()):
            if self._in_flight[group]:
                self._in_flight[group] = False
                vec.recv()

    def _open(self) -> list[AtariVectorEnv]:
        if self._vecs is None:
            raise EnvError("this Atari vector is closed; make a new one with make_vector")
        return self._vecs


def _make_groups(
    game: Mapping[str, Any],
    options: AtariOptions,
    groups: tuple[slice, ...],
    num_threads: int | None,
) -> list[AtariVectorEnv]:
    """One C++ vector per group (each with `num_threads`, or one per core up to its copies);
    those already made are closed when a later one fails."""
    from ale_py.vector_env import AtariVectorEnv

    settings: dict[str, Any] = {
        "autoreset_mode": "SameStep",
        "max_num_frames_per_episode": _frame_limit(game),
        "repeat_action_probability": check_probability(game.get("repeat_action_probability", 0.0)),
        "full_action_space": _flag(game, "full_action_space"),
        "img_height": options.screen_size,
        "img_width": options.screen_size,
        "stack_num": options.frame_stack,
        "frameskip": options.frame_skip,
        "maxpool": options.frame_skip > 1,
        "noop_max": options.noop_max,
        "episodic_life": False,
        "life_loss_info": False,
        "reward_clipping": False,
        "use_fire_reset": True,
    }
    rom = check_game(game.get("game"))
    vecs: list[AtariVectorEnv] = []
    try:
        for rows in groups:
            size = rows.stop - rows.start
            threads = num_threads or default_threads(size, len(groups))
            vecs.append(AtariVectorEnv(rom, size, num_threads=threads, **settings))
    except BaseException:
        for vec in vecs:
            vec.close()
        raise
    return vecs


def _concatenate(steps: list[VectorStep]) -> VectorStep:
    """The groups' steps as one step of the whole vector, rows in copy order."""

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(step, name) for step in steps])

    return VectorStep(
        obs=cat("obs"),
        reward=cat("reward"),
        done=cat("done"),
        truncated=cat("truncated"),
        final_obs=cat("final_obs"),
        episode_return=cat("episode_return"),
        episode_length=cat("episode_length"),
        episode_end=cat("episode_end"),
    )


def _frame_limit(game: Mapping[str, Any]) -> int:
    """Frames per game before truncation: the smaller of the id's `max_num_frames_per_episode`
    and its time limit (`max_episode_steps`, which the per-copy path counts in frames)."""
    limits = [
        check_frames(key, game[key])
        for key in ("max_num_frames_per_episode", "max_episode_steps")
        if game.get(key) is not None
    ]
    return min(limits, default=MAX_FRAMES)


def check_frames(key: str, value: object) -> int:
    """`value` as a frame count for `key`, or AleVectorError (the C++ vector takes a C int)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_FRAMES:
        raise AleVectorError(
            f"env_kwargs {key} = {value!r} is invalid: use a whole number of frames, "
            f"1..{MAX_FRAMES}"
        )
    return value


def check_game(value: object) -> str:
    """`value` as one of the ROMs ale-py ships (snake_case, as Gymnasium's ids name them), or
    AleVectorError: ale-py itself would fail an assertion on an unknown name."""
    from ale_py import roms

    if not isinstance(value, str) or value not in roms.get_all_rom_ids():
        raise AleVectorError(
            f"env_kwargs game = {str(value)[:60]!r} is not a ROM ale-py ships: leave game out "
            "(the id names the game, e.g. gym:ALE/Pong-v5)"
        )
    return value


def check_probability(value: object) -> float:
    """`value` as the sticky-action probability, or AleVectorError."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0.0 <= value <= 1.0
    ):
        raise AleVectorError(
            f"env_kwargs repeat_action_probability = {value!r} is invalid: use a number in "
            "[0, 1] (0.25 is v5's sticky actions)"
        )
    return float(value)


def _flag(game: Mapping[str, Any], key: str) -> bool:
    value = game.get(key, False)
    if not isinstance(value, bool):
        raise AleVectorError(f"env_kwargs {key} = {value!r} is invalid: use true or false")
    return value
