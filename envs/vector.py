"""The batched interface the learner codes against, and `VectorRunner`, its generic form.

A `VectorEnvironment` steps N copies of one environment with one call and resets each copy the
moment its episode ends, so a rollout loop never branches per environment. Built-ins provide a
native numpy implementation (one array operation per step for all N); anything else is run by
`VectorRunner` over N single instances, which is correct for every environment but pays one
Python call per copy per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium import spaces

from shoal.envs.base import BaseEnvironment
from shoal.envs.errors import EnvError, InvalidAction
from shoal.envs.packed_obs import PackedBox, needs_packing, pack

if TYPE_CHECKING:
    from shoal.envs.wrappers import EnvConfig


@dataclass
class VectorStep:
    """What one `VectorEnvironment.step` returns; every array has the batch as its first axis.

    `done` is `terminated or truncated`. `truncated` is True only where the time limit ended an
    episode that did not also terminate, so a learner bootstraps from `final_obs` exactly there.
    """

    obs: np.ndarray
    reward: np.ndarray
    done: np.ndarray
    truncated: np.ndarray
    final_obs: np.ndarray
    episode_return: np.ndarray
    episode_length: np.ndarray
    episode_end: np.ndarray | None = None
    """Where a whole episode ended, when that differs from `done` (the `atari` set ends the
    learner's episode at each lost life, the game at its end); None: exactly where `done`."""

    @property
    def ended(self) -> np.ndarray:
        """Where an episode ended whose `episode_return`/`episode_length` are to be reported."""
        return self.done if self.episode_end is None else self.episode_end


class VectorEnvironment:
    """N copies of one environment stepped together; not thread-safe, owned by one actor."""

    num_envs: int
    single_observation_space: spaces.Space[Any]
    single_action_space: spaces.Space[Any]

    def reset(self, seed: int | None = None) -> np.ndarray:
        """Start a new episode in every copy; `seed` reseeds first. Returns obs [N, *obs_shape]."""
        raise NotImplementedError

    def step(self, actions: np.ndarray) -> VectorStep:
        """Advance every copy one step; copies whose episode ended are reset before returning."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the copies hold."""

    def __enter__(self) -> VectorEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SplitStepVector(VectorEnvironment):
    """A vector whose copies form fixed groups that step split-phase, on the vector's own threads.

    `groups` are contiguous slices of the copies, in order, covering all of them.
    `step_async(g, actions)` starts group g's copies (actions for that group alone) and returns
    at once; `step_wait(g)` blocks, without holding the GIL, until they are done and returns the
    group's `VectorStep` (rows in the group's order, auto-reset as in `step`). While one group
    steps, the caller can compute another group's actions: learner/collector.py pipelines the
    groups so (the double-buffered sampling of Sample Factory). A group has at most one step in
    flight; `step` steps every group together; `reset` and `close` first end any step still in
    flight, so no emulator thread outlives the vector.
    """

    groups: tuple[slice, ...]

    def step_async(self, group: int, actions: np.ndarray) -> None:
        """Start one step of group `group` with its actions [len(group), *action_shape]."""
        raise NotImplementedError

    def step_wait(self, group: int) -> VectorStep:
        """The step `step_async` started for `group`, once its copies are done."""
        raise NotImplementedError


def check_num_envs(num_envs: int) -> None:
    """Refuse a batch size that cannot be stepped, before anything is allocated."""
    if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
        raise EnvError(f"num_envs must be a positive integer, got {num_envs!r}")


def check_actions(actions: np.ndarray, num_envs: int, space: spaces.Space[Any]) -> np.ndarray:
    """Return `actions` as an array of shape [N, *action_shape], or raise `InvalidAction`.

    Discrete spaces are checked in two reductions (min and max), so the check costs a few
    microseconds even for thousands of copies.
    """
    array = np.asarray(actions)
    expected = (num_envs, *(space.shape or ()))
    if array.shape != expected:
        raise InvalidAction(
            f"expected actions of shape {expected} (one per environment), got shape {array.shape}"
        )
    if isinstance(space, spaces.Discrete):
        if array.dtype.kind not in "iu":
            raise InvalidAction(f"expected integer actions for {space}, got dtype {array.dtype}")
        low, high = int(space.start), int(space.start + space.n - 1)
        if num_envs and (array.min() < low or array.max() > high):
            raise InvalidAction(f"actions must lie in [{low}, {high}] for {space}")
    return array


TRUE_RETURN = "shoal.true_return"
TRUE_END = "shoal.true_end"
"""The `info` keys of envs/wrappers.py's `TrueEpisode`: the return so far of the innermost
environment, and whether it ended at this step."""


def packed_space(space: spaces.Space[Any]) -> PackedBox | None:
    """The `PackedBox` a vector stacks for a structured observation space (Dict, Tuple, Text,
    Discrete: envs/packed_obs.py, as the Gymnasium adapter packs `gym:` ids), or None for an
    array space, stacked as it is. PackingError for a space that cannot be packed."""
    return PackedBox(space) if needs_packing(space) else None


class VectorRunner(VectorEnvironment):
    """N single environments made by `factory`, stepped one after another in this process.

    Copy i is seeded with `seed + i`, so two runners built with the same seed produce the same
    episodes. The single environments' own `done`/`info["truncated"]` drive the auto-reset.
    Copies that record their true episodes (`records_episodes`: envs/wrappers.py's
    `TrueEpisode` innermost) report those: the game's return however the wrappers changed the
    rewards, when the game ends (or a time limit truncates it) however often `done` came.
    """

    def __init__(
        self,
        factory: Callable[[], BaseEnvironment[Any, Any]],
        num_envs: int,
        seed: int | None = None,
    ) -> None:
        check_num_envs(num_envs)
        self.envs: list[BaseEnvironment[Any, Any]] = []
        try:
            for _ in range(num_envs):
                self.envs.append(factory())
        except BaseException:
            self.close()
            raise
        self.num_envs = num_envs
        self.single_action_space = self.envs[0].action_space
        try:
            self._packed = packed_space(self.envs[0].observation_space)
        except BaseException:
            self.close()
            raise
        self.single_observation_space = self._packed or self.envs[0].observation_space
        self._seed = seed
        self._returns = np.zeros(num_envs, dtype=np.float64)
        self._lengths = np.zeros(num_envs, dtype=np.int32)
        self._recorded = bool(getattr(self.envs[0], "records_episodes", False))

    def reset(self, seed: int | None = None) -> np.ndarray:
        if seed is not None:
            self._seed = seed
        if self._seed is not None:
            for i, env in enumerate(self.envs):
                env.seed(self._seed + i)
            self._seed = None
        self._returns[:] = 0.0
        self._lengths[:] = 0
        return self._stack([env.reset()[0] for env in self.envs])

    def step(self, actions: np.ndarray) -> VectorStep:
        actions = check_actions(actions, self.num_envs, self.single_action_space)
        n = self.num_envs
        obs_list: list[Any] = []
        final_list: list[Any] = []
        reward = np.zeros(n, dtype=np.float32)
        done = np.zeros(n, dtype=bool)
        truncated = np.zeros(n, dtype=bool)
        ended = np.zeros(n, dtype=bool)
        for i, env in enumerate(self.envs):
            obs, r, d, info = env.step(_item(actions[i], self.single_action_space))
            reward[i] = r
            final_list.append(obs)
            done[i] = d
            truncated[i] = d and bool(info.get("truncated", False))
            if self._recorded:
                ended[i] = self._record(i, info, truncated[i])
            if d:
                obs = env.reset()[0]
            obs_list.append(obs)
        self._lengths += 1
        if not self._recorded:
            self._returns += reward
            ended = done
        episode_return = np.where(ended, self._returns, 0.0).astype(np.float32)
        episode_length = np.where(ended, self._lengths, 0).astype(np.int32)
        self._returns[ended] = 0.0
        self._lengths[ended] = 0
        return VectorStep(
            obs=self._stack(obs_list),
            reward=reward,
            done=done,
            truncated=truncated,
            final_obs=self._stack(final_list),
            episode_return=episode_return,
            episode_length=episode_length,
            episode_end=ended if self._recorded else None,
        )

    def _record(self, i: int, info: dict[str, Any], truncated: bool) -> bool:
        """Whether copy i's true episode ended (the game's own end, or any time limit), with
        its true return kept for the report."""
        if not (info.get(TRUE_END) or truncated):
            return False
        self._returns[i] = float(info.get(TRUE_RETURN, 0.0))
        return True

    def close(self) -> None:
        for env in self.envs:
            env.close()

    def _stack(self, observations: Sequence[Any]) -> np.ndarray:
        if self._packed is not None:
            return np.stack([pack(self._packed.layout, obs) for obs in observations])
        array = np.stack([np.asarray(obs) for obs in observations])
        return array.astype(np.float32) if array.dtype.kind == "f" else array


def _item(action: np.ndarray, space: spaces.Space[Any]) -> Any:
    """One copy's action in the form its single environment expects (int for Discrete)."""
    return int(action) if isinstance(space, spaces.Discrete) else action


def make_vector(
    env_id: str,
    num_envs: int,
    seed: int | None = None,
    env: EnvConfig | None = None,
    **kwargs: Any,
) -> VectorEnvironment:
    """N copies of `env_id`: the native batched implementation where one is registered and
    `env` (a job's `[env]` section) applies nothing, ale-py's C++ vector for an ALE game whose
    `env` is the `atari` set alone (envs/ale_vector.py), else a `VectorRunner` of wrapped copies.

    `seed` seeds the batch (the next `reset()` starts from it); kwargs go to the environment
    as in `make`, including `max_episode_steps` to override the registered time limit.
    """
    from shoal.envs.registry import default_registry

    if env is None or not env.active:
        return default_registry.make_vector(env_id, num_envs, seed=seed, **kwargs)
    from shoal.envs.ale_vector import make_native_atari
    from shoal.envs.wrappers import make_wrapped

    check_num_envs(num_envs)
    native = make_native_atari(env_id, num_envs, seed, env, kwargs)
    if native is not None:
        return native
    config = env
    return VectorRunner(lambda: make_wrapped(env_id, config, kwargs), num_envs, seed)
