"""Adapters both ways between shoal's `BaseEnvironment` and Gymnasium's `Env`.

`GymEnvironment` runs any installed Gymnasium environment as a shoal one (registry ids
`gym:<Gymnasium id>`); `ShoalGymEnv` hands a shoal environment to Gymnasium code, and passes
`gymnasium.utils.env_checker.check_env`. The only translation is the step signature:
Gymnasium's `(terminated, truncated)` pair against shoal's `done` plus `info["truncated"]`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, SupportsFloat

import gymnasium
import numpy as np
from gymnasium.envs.registration import load_env_creator

from shoal.envs.base import BaseEnvironment
from shoal.envs.engine_warnings import route_mujoco_warnings
from shoal.envs.errors import EnvError
from shoal.envs.keywords import keyword_error

if TYPE_CHECKING:
    from shoal.envs.registry import EnvSpec

# Packages that register their environments with Gymnasium when imported (MinAtar's
# `minatar.gym` registers them when its `register_envs` is called).
GYMNASIUM_PLUGINS: tuple[str, ...] = ("ale_py", "minigrid", "minatar.gym")

_plugins_loaded = False


def load_plugins() -> None:
    """Import the installed Gymnasium plugins once, so their ids are in Gymnasium's registry."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    for module in GYMNASIUM_PLUGINS:
        try:
            plugin = importlib.import_module(module)
        except ImportError:
            continue
        if module == "ale_py":
            gymnasium.register_envs(plugin)
        elif module == "minatar.gym" and "MinAtar/Breakout-v1" not in gymnasium.envs.registry:
            plugin.register_envs()
    route_mujoco_warnings()
    _plugins_loaded = True


# The namespace under which `register_in_gymnasium` puts shoal's environments.
SHOAL_NAMESPACE = "shoal"


def gymnasium_ids() -> list[str]:
    """Every id in Gymnasium's registry, plugins included, sorted (shoal's own left out)."""
    load_plugins()
    prefix = SHOAL_NAMESPACE + "/"
    return sorted(gym_id for gym_id in gymnasium.envs.registry if not gym_id.startswith(prefix))


def requirements_of(entry_point: object) -> tuple[str, ...]:
    """The distributions a Gymnasium environment depends on, for its environment hash."""
    module = entry_point if isinstance(entry_point, str) else getattr(entry_point, "__module__", "")
    module = str(module).partition(":")[0]
    names = {"gymnasium"}
    top = module.split(".")[0]
    names.update(importlib.metadata.packages_distributions().get(top, []))
    for engine in ("mujoco", "box2d"):
        if f".{engine}" in module:
            names.add(engine)
    return tuple(sorted(names))


def gym_spec(full_id: str, gym_id: str, not_found: Callable[[str], EnvError]) -> EnvSpec:
    """A shoal `EnvSpec` for the Gymnasium id `gym_id`, or the registry's lookup error."""
    from shoal.envs.registry import EnvSpec

    load_plugins()
    gym_spec_ = gymnasium.envs.registry.get(gym_id)
    if gym_spec_ is None:
        raise not_found(full_id)
    return EnvSpec(
        id=full_id,
        entry_point=make_gym,
        kwargs={"gym_id": gym_id},
        max_episode_steps=None,
        vector_entry_point=None,
        requirements=requirements_of(gym_spec_.entry_point),
        description=f"Gymnasium's {gym_id} (time limit {gym_spec_.max_episode_steps})",
    )


def make_gym(gym_id: str, **kwargs: Any) -> GymEnvironment:
    """Make a Gymnasium environment as a shoal one, in the form a vector stacks (boolean
    frames as uint8, structured observations packed: envs/wrappers.py `prepare_gym_env`);
    Gymnasium applies its own time limit."""
    from shoal.envs.wrappers import EnvConfig, prepare_gym_env

    env = make_gymnasium(gym_id, kwargs)
    try:
        return GymEnvironment(prepare_gym_env(env, EnvConfig()))
    except BaseException:
        env.close()
        raise


def make_gymnasium(gym_id: str, kwargs: dict[str, Any]) -> gymnasium.Env[Any, Any]:
    """`gymnasium.make(gym_id, **kwargs)`, its refusals as EnvError."""
    try:
        return gymnasium.make(gym_id, **kwargs)
    except gymnasium.error.Error as exc:
        raise EnvError(f"Gymnasium cannot make {gym_id}: {exc}") from exc
    except TypeError as exc:
        raise keyword_error(
            f"gym:{gym_id}", _creator(gym_id), kwargs, exc, extra=["max_episode_steps"]
        ) from exc


def _creator(gym_id: str) -> Callable[..., Any] | None:
    """The class or function Gymnasium makes `gym_id` with, whose signature names the keywords
    it takes; None where it cannot be loaded (the error then keeps Gymnasium's words)."""
    try:
        entry = gymnasium.spec(gym_id).entry_point
        return entry if callable(entry) else load_env_creator(str(entry))
    except Exception:  # any failure here only loses the list of keywords
        return None


class GymEnvironment(BaseEnvironment[Any, Any]):
    """A Gymnasium `Env` behind shoal's interface; `seed(n)` applies at the next `reset`."""

    def __init__(self, env: gymnasium.Env[Any, Any]) -> None:
        self.env = env
        self.observation_space = env.observation_space
        self.action_space = env.action_space
        self._pending_seed: int | None = None
        self.records_episodes = _records_episodes(env)
        """Whether `info` carries the true episode's return and end (envs/wrappers.py
        `TrueEpisode`), which the learner's rewards and `done` may not: an Atari life lost
        ends the learner's episode only, clipped rewards are not the game's score."""

    def seed(self, seed: int | None) -> None:
        self._pending_seed = seed

    def reset(self) -> tuple[Any, dict[str, Any]]:
        seed, self._pending_seed = self._pending_seed, None
        obs, info = self.env.reset(seed=seed)
        return obs, dict(info)

    def step(self, action: Any) -> tuple[Any, float, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        info = dict(info)
        info["truncated"] = bool(truncated) and not terminated
        return obs, float(reward), bool(terminated or truncated), info

    def render(self, mode: str = "human") -> np.ndarray | None:
        frame = self.env.render()
        return frame if isinstance(frame, np.ndarray) else None

    def close(self) -> None:
        self.env.close()

    def __repr__(self) -> str:
        return f"<GymEnvironment {self.env}>"


def _records_episodes(env: gymnasium.Env[Any, Any]) -> bool:
    from shoal.envs.wrappers import TrueEpisode

    while isinstance(env, gymnasium.Wrapper):
        if isinstance(env, TrueEpisode):
            return True
        env = env.env
    return False


class ShoalGymEnv(gymnasium.Env[Any, Any]):
    """A shoal environment as a Gymnasium `Env`: `reset(seed=n)` seeds it, then resets it."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, env: BaseEnvironment[Any, Any], render_mode: str | None = None) -> None:
        self.env = env
        self.observation_space = env.observation_space
        self.action_space = env.action_space
        self.render_mode = render_mode

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is not None:
            self.env.seed(seed)
        return self.env.reset()

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        obs, reward, done, info = self.env.step(action)
        truncated = bool(info.get("truncated", False))
        return obs, reward, done and not truncated, truncated, info

    def render(self) -> Any:
        return self.env.render(self.render_mode or "human")

    def close(self) -> None:
        self.env.close()


def to_gymnasium(env_id: str, **kwargs: Any) -> ShoalGymEnv:
    """A registered shoal environment, ready for Gymnasium code (`check_env`, wrappers, vectors)."""
    from shoal.envs.registry import make

    return ShoalGymEnv(make(env_id, **kwargs))


def register_in_gymnasium(env_ids: list[str]) -> list[str]:
    """Make shoal environments available to `gymnasium.make` as `shoal/<id>`; returns those ids.

    The time limit is shoal's (inside the environment), so Gymnasium adds none of its own.
    """
    registered = []
    for env_id in env_ids:
        gym_id = f"{SHOAL_NAMESPACE}/{env_id}"
        if gym_id not in gymnasium.envs.registry:
            gymnasium.register(id=gym_id, entry_point=functools.partial(to_gymnasium, env_id))
        registered.append(gym_id)
    return registered
