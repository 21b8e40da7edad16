"""Gymnasium wrappers a job turns on by name: `[[env.wrappers]]` in the job TOML, `--wrapper`.

A wrapper is a named set (`atari`: envs/atari.py) or any `gymnasium.Wrapper` class exported by
`gymnasium.wrappers`, with JSON keyword arguments. The list comes from a user's file or
command line, so `parse_wrappers` bounds it (entries, keyword arguments, text, list length and
depth), checks every name and keyword against what exists, and refuses with a `WrapperError`
that says what to write instead. `prepare_gym_env` applies a job's `EnvConfig` to one
Gymnasium environment: the true episode's return innermost (so reported returns are the
game's, whatever the wrappers do to rewards), the wrappers in order, running observation and
reward normalisation, then whatever every environment needs to travel as one array (boolean
frames as uint8, structured observations packed: envs/packed_obs.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, SupportsFloat

import gymnasium
import gymnasium.wrappers
import numpy as np
from gymnasium import spaces

from shoal.envs.atari import AtariOptions, BoolFrames, ale_make_kwargs, apply_atari
from shoal.envs.base import BaseEnvironment
from shoal.envs.errors import EnvError
from shoal.envs.vector import TRUE_END, TRUE_RETURN
from shoal.errors import ConfigError

MAX_WRAPPERS = 16
MAX_KWARGS = 16
MAX_TEXT = 256
"""Longest name or string value."""
MAX_LIST = 64
MAX_DEPTH = 3
"""Deepest nesting of lists in one keyword argument's value (a shape is depth 1)."""
MAX_INT = 2**53
NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")

NAMED_SETS: dict[str, type[Any]] = {"atari": AtariOptions}
"""Wrapper sets by name, each with the dataclass of its keyword arguments."""

_REFUSED = {
    "Autoreset": "shoal's vectors reset every copy themselves",
    "HumanRendering": "it opens a window on the node that runs the rollout",
    "RecordVideo": "it writes files on the node that runs the rollout",
}


class WrapperError(EnvError, ConfigError):
    """A wrapper list cannot be used as given; the message names the entry and the fix."""


@dataclass(frozen=True)
class WrapperSpec:
    """One checked entry of a wrapper list: a set or Gymnasium wrapper name and its kwargs."""

    name: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kwargs": dict(self.kwargs)}


def gymnasium_wrappers() -> dict[str, type[gymnasium.Wrapper[Any, Any, Any, Any]]]:
    """Every `gymnasium.Wrapper` subclass `gymnasium.wrappers` exports, by name: the allow-list
    (the module's other names, and vector wrappers, are never instantiated from a job)."""
    found = {}
    for name in dir(gymnasium.wrappers):
        value = getattr(gymnasium.wrappers, name, None)
        if (
            not name.startswith("_")
            and isinstance(value, type)
            and issubclass(value, gymnasium.Wrapper)
        ):
            found[name] = value
    return found


def parse_wrappers(raw: object) -> tuple[WrapperSpec, ...]:
    """A job's wrapper list (`[{"name": ..., "kwargs": {...}}, ...]`) checked into specs."""
    if not isinstance(raw, list | tuple):
        raise WrapperError(
            f"env.wrappers must be a list of tables ([[env.wrappers]] name = ...), got "
            f"{type(raw).__name__}"
        )
    if len(raw) > MAX_WRAPPERS:
        raise WrapperError(
            f"env.wrappers has {len(raw)} entries; at most {MAX_WRAPPERS} are allowed"
        )
    return tuple(_parse_entry(i, entry) for i, entry in enumerate(raw))


def _parse_entry(index: int, entry: object) -> WrapperSpec:
    where = f"wrappers[{index}]"
    if not isinstance(entry, Mapping):
        raise WrapperError(f"{where} must be a table with name and kwargs, got {_short(entry)}")
    extra = sorted(str(k)[:MAX_TEXT] for k in entry if k not in ("name", "kwargs"))
    if extra:
        raise WrapperError(f"{where}: unknown key(s) {', '.join(extra)}; valid: name, kwargs")
    name = entry.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise WrapperError(
            f"{where}.name = {_short(name)} is invalid: name a wrapper set ({', '.join(NAMED_SETS)}) "
            "or a class of gymnasium.wrappers (e.g. NormalizeObservation)"
        )
    kwargs = entry.get("kwargs", {})
    if not isinstance(kwargs, Mapping):
        raise WrapperError(f"{where}.kwargs must be a table of keyword arguments")
    if len(kwargs) > MAX_KWARGS:
        raise WrapperError(f"{where}.kwargs has {len(kwargs)} keys; at most {MAX_KWARGS}")
    checked = {}
    for key, value in kwargs.items():
        if not isinstance(key, str) or not NAME_RE.fullmatch(key):
            raise WrapperError(f"{where}.kwargs key {_short(key)} is not a keyword argument name")
        checked[key] = _json_value(f"{where}.kwargs.{key}", value, 0)
    _check_name_and_kwargs(where, name, checked)
    return WrapperSpec(name, checked)


def _json_value(where: str, value: object, depth: int) -> Any:
    """`value` when it is a JSON scalar or a bounded list of them; else a WrapperError."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise WrapperError(f"{where} = {_short(value)} is out of range (|n| <= 2**53)")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise WrapperError(f"{where} = {value!r} is invalid: use a finite number")
        return value
    if isinstance(value, str):
        if len(value) > MAX_TEXT:
            raise WrapperError(
                f"{where} is a string of {len(value)} characters; at most {MAX_TEXT}"
            )
        return value
    if isinstance(value, list | tuple):
        if depth >= MAX_DEPTH or len(value) > MAX_LIST:
            raise WrapperError(
                f"{where}: lists may hold at most {MAX_LIST} items, nested {MAX_DEPTH} deep"
            )
        return [_json_value(f"{where}[{i}]", item, depth + 1) for i, item in enumerate(value)]
    raise WrapperError(
        f"{where} = {_short(value)} is invalid: keyword arguments are numbers, strings, booleans "
        "or lists of them"
    )


def _check_name_and_kwargs(where: str, name: str, kwargs: dict[str, Any]) -> None:
    if name in NAMED_SETS:
        try:
            NAMED_SETS[name](**kwargs)
        except TypeError:
            valid = ", ".join(f.name for f in dataclasses.fields(NAMED_SETS[name]))
            raise WrapperError(
                f"{where}: the {name} set takes {valid}; got {sorted(kwargs)}"
            ) from None
        except EnvError as exc:
            raise WrapperError(f"{where}: {exc}") from None
        return
    if name in _REFUSED:
        raise WrapperError(f"{where}: {name} cannot be used from a job: {_REFUSED[name]}")
    known = gymnasium_wrappers()
    cls = known.get(name)
    if cls is None:
        close = difflib.get_close_matches(name, [*NAMED_SETS, *known], n=3, cutoff=0.6)
        hint = (
            f"did you mean {', '.join(close)}?"
            if close
            else "name a wrapper set (atari) or a class of gymnasium.wrappers"
        )
        raise WrapperError(f"{where}: no wrapper {name!r}; {hint}")
    _check_signature(where, cls, kwargs)


def _check_signature(where: str, cls: type[Any], kwargs: dict[str, Any]) -> None:
    """The keyword arguments name parameters of the wrapper, and every required one is given."""
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, env
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    names = [p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise WrapperError(
            f"{where}: {cls.__name__} has no argument(s) {', '.join(unknown)}; it takes "
            f"{', '.join(names) or 'none'}"
        )
    missing = [p.name for p in params if p.default is inspect.Parameter.empty and p.name in names]
    missing = [n for n in missing if n not in kwargs]
    if missing:
        raise WrapperError(
            f"{where}: {cls.__name__} needs {', '.join(missing)}, which a job gives as JSON "
            "values only (no functions or spaces); choose a wrapper whose arguments are values"
        )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class EnvConfig:
    """The job's `[env]` section: Gymnasium wrappers and normalisation applied to every copy.

    ```toml
    [env]
    normalize_observation = true
    [[env.wrappers]]
    name = "atari"
    kwargs = { frame_stack = 4 }
    ```
    """

    wrappers: tuple[dict[str, Any], ...] = ()
    """Wrapper sets (`atari`) or `gymnasium.wrappers` classes, applied in order, each
    `{name, kwargs}`."""
    normalize_observation: bool = False
    """Gymnasium's running mean/std observation normalisation, per environment copy."""
    normalize_reward: bool = False
    """Gymnasium's reward scaling by the running std of the discounted return (γ = 0.99)."""

    def __post_init__(self) -> None:
        parse_wrappers(self.wrappers)
        for key in ("normalize_observation", "normalize_reward"):
            if not isinstance(getattr(self, key), bool):
                raise WrapperError(
                    f"env.{key} = {getattr(self, key)!r} is invalid: use true or false"
                )

    @classmethod
    def from_json(cls, value: object, source: str) -> EnvConfig:
        """The section from its JSON form (a rollout spec, a checkpoint's config), checked as a
        job file's is; ConfigError naming `source` when it is wrong."""
        from shoal.config import load

        return load(cls, value if isinstance(value, Mapping) else {}, source=source, environ={})

    @property
    def specs(self) -> tuple[WrapperSpec, ...]:
        return parse_wrappers(self.wrappers)

    @property
    def active(self) -> bool:
        """Whether anything is applied (else environments are made exactly as registered)."""
        return bool(self.wrappers) or self.normalize_observation or self.normalize_reward

    @property
    def uses_atari(self) -> bool:
        return any(spec.name == "atari" for spec in self.specs)

    def manifest(self) -> dict[str, Any]:
        """What the environment hash records of this section."""
        return {
            "wrappers": [spec.to_json() for spec in self.specs],
            "normalize_observation": self.normalize_observation,
            "normalize_reward": self.normalize_reward,
        }


def parse_wrapper_flag(text: str) -> dict[str, Any]:
    """`--wrapper NAME[:key=value,...]` as a wrapper entry; values are read as JSON where they
    parse (`4`, `true`, `[84, 84]`), else kept as text."""
    if len(text) > 4 * MAX_TEXT:
        raise WrapperError(f"--wrapper is {len(text)} characters long; at most {4 * MAX_TEXT}")
    name, _, rest = text.partition(":")
    kwargs: dict[str, Any] = {}
    for item in _split_items(rest) if rest else []:
        key, sep, value = item.partition("=")
        if not sep:
            raise WrapperError(
                f"--wrapper {text}: {item!r} is not key=value (e.g. atari:frame_stack=4)"
            )
        try:
            kwargs[key.strip()] = json.loads(value)
        except ValueError:
            kwargs[key.strip()] = value
    entry = {"name": name.strip(), "kwargs": kwargs}
    try:
        parse_wrappers([entry])
    except WrapperError as exc:
        reason = str(exc).removeprefix("wrappers[0]").lstrip(":. ")
        raise WrapperError(f"--wrapper {text}: {reason}") from None
    return entry


def _split_items(text: str) -> list[str]:
    """Comma-separated items, keeping commas inside [...] (a list value) in their item."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item.strip()]


def prepare_gym_env(env: gymnasium.Env[Any, Any], cfg: EnvConfig) -> gymnasium.Env[Any, Any]:
    """`env` with the job's wrappers and normalisation, then in the form a vector stacks."""
    from shoal.envs.packed_obs import PackObservation, needs_packing

    if cfg.active:
        env = TrueEpisode(env)
    for spec in cfg.specs:
        env = _apply(env, spec)
    if cfg.normalize_observation:
        env = _apply(env, WrapperSpec("NormalizeObservation"))
    if cfg.normalize_reward:
        env = _apply(env, WrapperSpec("NormalizeReward"))
    space = env.observation_space
    if isinstance(space, spaces.Box) and space.dtype == np.bool_:
        env = BoolFrames(env)
    if needs_packing(env.observation_space):
        env = PackObservation(env)
    return env


class TrueEpisode(gymnasium.Wrapper[Any, Any, Any, Any]):
    """Innermost: puts the environment's own return so far and whether it ended in every
    step's info (`shoal.true_return`, `shoal.true_end`), so the vector reports the game's
    score and episodes however the outer wrappers clip rewards or split games into lives."""

    def __init__(self, env: gymnasium.Env[Any, Any]) -> None:
        super().__init__(env)
        self._return = 0.0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        self._return = 0.0
        return self.env.reset(seed=seed, options=options)

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._return += float(reward)
        ended = bool(terminated or truncated)
        info = {**info, TRUE_RETURN: self._return, TRUE_END: ended}
        if ended:
            self._return = 0.0
        return obs, reward, terminated, truncated, info


def _apply(env: gymnasium.Env[Any, Any], spec: WrapperSpec) -> gymnasium.Env[Any, Any]:
    if spec.name == "atari":
        return apply_atari(env, AtariOptions(**spec.kwargs))
    cls = gymnasium_wrappers()[spec.name]
    try:
        return cls(env, **spec.kwargs)
    except EnvError:
        raise
    except Exception as exc:  # a wrapper's own checks: any type, turned into the job's error
        raise WrapperError(
            f"wrapper {spec.name} cannot wrap {env.spec.id if env.spec else env}: {exc}; fix its "
            "kwargs or drop it"
        ) from None


def make_wrapped(
    env_id: str, cfg: EnvConfig, kwargs: Mapping[str, Any]
) -> BaseEnvironment[Any, Any]:
    """One copy of `env_id` (a `gym:` id or shoal's own) with `cfg` applied, as a shoal env."""
    from shoal.envs.gym_adapter import GymEnvironment, ShoalGymEnv, make_gym, make_gymnasium
    from shoal.envs.registry import default_registry

    spec = default_registry.spec(env_id)
    if spec.entry_point is make_gym:
        gym_id = str(spec.kwargs["gym_id"])
        made = ale_make_kwargs(gym_id, dict(kwargs)) if cfg.uses_atari else dict(kwargs)
        env = make_gymnasium(gym_id, made)
    elif cfg.uses_atari:
        raise WrapperError(
            f"the atari wrapper set needs an Arcade Learning Environment game, not {spec.id}: "
            "use gym:ALE/<Game>-v5 (e.g. gym:ALE/Pong-v5)"
        )
    else:
        env = ShoalGymEnv(default_registry.make(spec.id, **kwargs))
    try:
        return GymEnvironment(prepare_gym_env(env, cfg))
    except BaseException:
        env.close()
        raise
