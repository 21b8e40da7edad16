"""The `atari` wrapper set: the Arcade Learning Environment preprocessing of DQN and CleanRL's PPO.

From the game outwards (shoal/envs/wrappers.py has recorded the true game's return and length
innermost (`TrueEpisode`), so reported returns are whole games,
unclipped): a random number of no-op actions starts each game, every action is repeated for `frame_skip`
frames with the last two frames max-pooled (`MaxAndSkipObservation`; the game is made with
`frameskip=1` so frames are not skipped twice), a lost life ends the learner's episode while
the game goes on, FIRE is pressed after a reset in games that wait for it, rewards are clipped
to their sign, frames become grey `screen_size`² images (area-averaged) and the last
`frame_stack` of them are stacked: uint8 observations of shape [frame_stack, 84, 84].

Everything here is numpy (no OpenCV): the resize gathers and weights a few rows, then columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, SupportsFloat

import gymnasium
import numpy as np
from gymnasium import spaces
from gymnasium.wrappers import (
    ClipReward,
    FrameStackObservation,
    MaxAndSkipObservation,
)

from shoal.envs.errors import EnvError

ALE_ENTRY_POINT = "ale_py.env:AtariEnv"
"""Where Gymnasium's registry points every Arcade Learning Environment id (v5, v4, NoFrameskip)."""

_NOOP, _FIRE = 0, 1
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


@dataclass(frozen=True)
class AtariOptions:
    """The `atari` set's keyword arguments (`[[env.wrappers]] name = "atari"`, `kwargs = {...}`)."""

    noop_max: int = 30
    """At most this many no-op actions start each game (at least one)."""
    frame_skip: int = 4
    """Frames each action is repeated for; the last two are max-pooled."""
    screen_size: int = 84
    """Side of the square grey frame."""
    frame_stack: int = 4
    """Frames stacked into one observation (the first axis)."""
    episodic_life: bool = True
    """A lost life ends the learner's episode (the game goes on)."""
    clip_rewards: bool = True
    """Rewards become -1, 0 or 1 (returns reported stay the game's own)."""

    def __post_init__(self) -> None:
        for key, low, high in (
            ("noop_max", 0, 1000),
            ("frame_skip", 1, 64),
            ("screen_size", 8, 512),
            ("frame_stack", 1, 64),
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise EnvError(f"atari: {key} = {value!r} is invalid: use an integer {low}..{high}")
        for key in ("episodic_life", "clip_rewards"):
            if not isinstance(getattr(self, key), bool):
                raise EnvError(
                    f"atari: {key} = {getattr(self, key)!r} is invalid: use true or false"
                )


def is_ale(gym_id: str) -> bool:
    """Whether a Gymnasium id is an Arcade Learning Environment game."""
    spec = gymnasium.envs.registry.get(gym_id)
    return spec is not None and spec.entry_point == ALE_ENTRY_POINT


def ale_make_kwargs(gym_id: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The kwargs to make an ALE game with for the `atari` set: one frame per step (the set
    skips frames itself) and grey frames from the emulator; a conflicting value is refused."""
    if not is_ale(gym_id):
        raise EnvError(
            f"the atari wrapper set needs an Arcade Learning Environment game, not {gym_id}: "
            "use gym:ALE/<Game>-v5 (e.g. gym:ALE/Pong-v5) or drop the atari wrapper"
        )
    made = {"frameskip": 1, "obs_type": "grayscale", **kwargs}
    if made["frameskip"] != 1:
        raise EnvError(
            f"env_kwargs frameskip = {made['frameskip']!r} would skip frames twice: the atari "
            "set repeats each action itself (its frame_skip kwarg); leave frameskip out"
        )
    return made


def apply_atari(env: gymnasium.Env[Any, Any], options: AtariOptions) -> gymnasium.Env[Any, Any]:
    """`env` (an ALE game made with `ale_make_kwargs`, its statistics recorded by
    `TrueEpisode` already) wrapped in the whole set, in order."""
    if options.noop_max > 0:
        env = NoopReset(env, options.noop_max)
    if options.frame_skip > 1:
        env = MaxAndSkipObservation(env, skip=options.frame_skip)
    if options.episodic_life:
        env = EpisodicLife(env)
    meanings = env.unwrapped.get_action_meanings()  # type: ignore[attr-defined]
    if len(meanings) >= 3 and meanings[_FIRE] == "FIRE":
        env = FireReset(env)
    if options.clip_rewards:
        env = ClipReward(env, -1.0, 1.0)
    env = GreyResize(env, options.screen_size)
    if options.frame_stack > 1:
        env = FrameStackObservation(env, options.frame_stack)
    return env


def _lives(env: gymnasium.Env[Any, Any]) -> int:
    return int(env.unwrapped.ale.lives())  # type: ignore[attr-defined]


class NoopReset(gymnasium.Wrapper[Any, Any, Any, Any]):
    """Starts each game with 1..noop_max no-op actions, drawn from the game's own seeded
    generator, so a policy cannot memorise one fixed opening."""

    def __init__(self, env: gymnasium.Env[Any, Any], noop_max: int) -> None:
        super().__init__(env)
        self.noop_max = noop_max

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed, options=options)
        for _ in range(int(self.env.unwrapped.np_random.integers(1, self.noop_max + 1))):
            obs, _, terminated, truncated, info = self.env.step(_NOOP)
            if terminated or truncated:
                obs, info = self.env.reset()
        return obs, info


class EpisodicLife(gymnasium.Wrapper[Any, Any, Any, Any]):
    """A lost life ends the learner's episode, but the game resets only once it is over: the
    value of a state is learnt per life, while the next life starts where the last one ended."""

    def __init__(self, env: gymnasium.Env[Any, Any]) -> None:
        super().__init__(env)
        self._lives = 0
        self._game_over = True

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._game_over = bool(terminated or truncated)
        lives = _lives(self.env)
        if 0 < lives < self._lives:
            terminated = True
        self._lives = lives
        return obs, reward, terminated, truncated, info

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        if self._game_over:
            obs, info = self.env.reset(seed=seed, options=options)
        else:
            obs, _, terminated, truncated, info = self.env.step(_NOOP)
            if terminated or truncated:
                obs, info = self.env.reset(seed=seed, options=options)
        self._game_over = False
        self._lives = _lives(self.env)
        return obs, info


class FireReset(gymnasium.Wrapper[Any, Any, Any, Any]):
    """Presses FIRE (then UP, as DQN did) after every reset: games like Breakout wait for it,
    and an agent that has not yet found the button would see one frozen frame for ever."""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed, options=options)
        for action in (_FIRE, 2):
            obs, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                obs, info = self.env.reset()
        return obs, info


def area_taps(size_in: int, size_out: int) -> tuple[np.ndarray, np.ndarray]:
    """For each output pixel, the input pixels its span covers and their weights (what OpenCV's
    INTER_AREA averages when shrinking): ([size_out, k] indices, [size_out, k] weights summing
    to 1), k the most pixels one span touches. Gathering k rows is several times faster than a
    dense matrix product and needs no BLAS threads."""
    edges = np.arange(size_out + 1, dtype=np.float64) * (size_in / size_out)
    starts, ends = edges[:-1, None], edges[1:, None]
    pixels = np.arange(size_in, dtype=np.float64)[None, :]
    overlap = np.clip(np.minimum(ends, pixels + 1) - np.maximum(starts, pixels), 0.0, None)
    weights = overlap / overlap.sum(axis=1, keepdims=True)
    taps = int((weights > 0).sum(axis=1).max())
    first = np.argmax(weights > 0, axis=1)
    indices = np.minimum(first[:, None] + np.arange(taps)[None, :], size_in - 1)
    gathered = np.take_along_axis(weights, indices, axis=1)
    gathered[indices != first[:, None] + np.arange(taps)[None, :]] = 0.0
    return indices, gathered.astype(np.float32)


class GreyResize(gymnasium.ObservationWrapper[Any, Any, Any]):
    """Grey (luma of RGB, or the emulator's own grey frame) resized to a size² uint8 square."""

    def __init__(self, env: gymnasium.Env[Any, Any], size: int) -> None:
        super().__init__(env)
        shape = env.observation_space.shape
        if shape is None or len(shape) not in (2, 3) or (len(shape) == 3 and shape[2] != 3):
            raise EnvError(f"grey resize needs [H, W] or [H, W, 3] frames, got {shape}")
        self._rows, self._row_weights = area_taps(shape[0], size)
        self._cols, self._col_weights = area_taps(shape[1], size)
        self.observation_space = spaces.Box(0, 255, (size, size), np.uint8)

    def observation(self, observation: Any) -> np.ndarray:
        frame = np.asarray(observation, dtype=np.float32)
        if frame.ndim == 3:
            frame = frame @ _LUMA
        rows = np.einsum("okw,ok->ow", frame[self._rows], self._row_weights)
        resized = np.einsum("hok,ok->ho", rows[:, self._cols], self._col_weights)
        return np.clip(np.rint(resized), 0, 255).astype(np.uint8)


class BoolFrames(gymnasium.ObservationWrapper[Any, Any, Any]):
    """Boolean frames (MinAtar's [10, 10, C] channels) as uint8 images of 0 and 255: what the
    cnn family takes, and scaled by 1/255 back to exactly 0 and 1."""

    def __init__(self, env: gymnasium.Env[Any, Any]) -> None:
        super().__init__(env)
        self.observation_space = spaces.Box(0, 255, env.observation_space.shape or (), np.uint8)

    def observation(self, observation: Any) -> np.ndarray:
        return np.asarray(observation, dtype=np.uint8) * np.uint8(255)
