"""Versioned environment ids (`Name-vN`), what each one makes, and the errors that name the fix.

Ids follow one regex: an optional lower-case namespace with a colon, a name, and a version.
shoal's own environments have no namespace (`CartPole-v1`, `GridWorld-HeldOut-v1`); every
installed Gymnasium environment is reachable as `gym:<its Gymnasium id>` (`gym:ALE/Pong-v5`).
Short, case-insensitive aliases (`cartpole`, `cartpole-v1`) resolve to shoal's newest version.

`make` is a dictionary lookup and a constructor call: entry points written as "module:attr"
are imported once and cached, so making a registered environment costs microseconds.
"""

from __future__ import annotations

import builtins
import difflib
import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shoal.envs.base import BaseEnvironment
from shoal.envs.errors import (
    DeprecatedEnvironment,
    EnvError,
    InvalidEnvironmentId,
    RegistrationError,
    UnknownEnvironment,
)
from shoal.envs.keywords import keyword_error
from shoal.envs.time_limit import TimeLimit
from shoal.envs.vector import VectorEnvironment, VectorRunner, check_num_envs

ID_RE = re.compile(
    r"^(?:(?P<namespace>[a-z][a-z0-9_]*):)?(?P<name>[A-Za-z0-9][\w./-]*?)(?:-v(?P<version>\d+))?$"
)
GYM_NAMESPACE = "gym"
LIMIT = "max_episode_steps"
"""The keyword every id takes: its time limit, applied by the registry."""

EntryPoint = str | Callable[..., Any]


@dataclass(frozen=True)
class ParsedId:
    namespace: str | None
    name: str
    version: int | None


def parse_id(env_id: str) -> ParsedId:
    """Split an id into namespace, name and version, or raise `InvalidEnvironmentId`."""
    match = ID_RE.fullmatch(env_id) if isinstance(env_id, str) else None
    if match is None:
        raise InvalidEnvironmentId(
            f"{env_id!r} is not a valid environment id: use Name-vN (e.g. GridWorld-v1) "
            "or gym:<Gymnasium id> (e.g. gym:CartPole-v1)"
        )
    version = match.group("version")
    return ParsedId(
        match.group("namespace"), match.group("name"), None if version is None else int(version)
    )


@dataclass(frozen=True)
class EnvSpec:
    """Everything needed to make one registered environment and to hash it.

    `requirements` names the distributions whose versions enter the environment hash.
    """

    id: str
    entry_point: EntryPoint
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    max_episode_steps: int | None = None
    vector_entry_point: EntryPoint | None = None
    requirements: tuple[str, ...] = ()
    description: str = ""

    @property
    def entry_point_name(self) -> str:
        """The entry point as text, for the hash and for `shoal envs info`."""
        return _entry_point_name(self.entry_point)


def _entry_point_name(entry: EntryPoint) -> str:
    if isinstance(entry, str):
        return entry
    return f"{entry.__module__}:{entry.__qualname__}"


class Registry:
    """A set of environment specs; `default_registry` is the one `make` and `list` use."""

    def __init__(self) -> None:
        self._specs: dict[str, EnvSpec] = {}
        self._aliases: dict[str, str] | None = None
        self._resolved: dict[str, Callable[..., Any]] = {}
        self._gym_specs: dict[str, EnvSpec] = {}

    def register(
        self,
        env_id: str,
        entry_point: EntryPoint,
        *,
        kwargs: Mapping[str, Any] | None = None,
        max_episode_steps: int | None = None,
        vector_entry_point: EntryPoint | None = None,
        requirements: tuple[str, ...] = (),
        description: str = "",
    ) -> EnvSpec:
        """Add an environment; its id must be `Name-vN` and not yet taken."""
        parsed = parse_id(env_id)
        if parsed.version is None or parsed.namespace is not None:
            raise InvalidEnvironmentId(
                f"cannot register {env_id!r}: shoal ids are Name-vN with a version and no "
                "namespace (e.g. GridWorld-v1)"
            )
        if env_id in self._specs:
            raise RegistrationError(
                f"{env_id} is already registered; register a new version instead"
            )
        if max_episode_steps is not None and (
            isinstance(max_episode_steps, bool)
            or not isinstance(max_episode_steps, int)
            or max_episode_steps < 1
        ):
            raise RegistrationError(
                f"max_episode_steps of {env_id} must be a positive integer or None, got {max_episode_steps!r}"
            )
        spec = EnvSpec(
            env_id,
            entry_point,
            dict(kwargs or {}),
            max_episode_steps,
            vector_entry_point,
            tuple(requirements),
            description,
        )
        self._specs[env_id] = spec
        self._aliases = None
        return spec

    def spec(self, env_id: str) -> EnvSpec:
        """The spec behind an id or alias; raises the error that names the fix."""
        spec = self._specs.get(env_id)
        if spec is not None:
            return spec
        if isinstance(env_id, str) and env_id.startswith(GYM_NAMESPACE + ":"):
            return self._gym_spec(env_id)
        canonical = self._alias_table().get(env_id.lower()) if isinstance(env_id, str) else None
        if canonical is not None:
            return self._specs[canonical]
        raise self._lookup_error(env_id)

    def make(self, env_id: str, **kwargs: Any) -> BaseEnvironment[Any, Any]:
        """A new environment; kwargs override the registered ones, `max_episode_steps` the limit."""
        spec = self.spec(env_id)
        limit = kwargs.pop(LIMIT, spec.max_episode_steps)
        factory = self._resolve(spec.entry_point)
        try:
            env: BaseEnvironment[Any, Any] = factory(**{**spec.kwargs, **kwargs})
        except TypeError as exc:
            raise keyword_error(spec.id, factory, kwargs, exc, extra=[LIMIT]) from exc
        if limit is not None:
            env = TimeLimit(env, limit)
        return env

    def make_vector(
        self, env_id: str, num_envs: int, seed: int | None = None, **kwargs: Any
    ) -> VectorEnvironment:
        """N copies: the native batched form where the spec has one, else a `VectorRunner`."""
        check_num_envs(num_envs)
        spec = self.spec(env_id)
        if spec.vector_entry_point is None:
            return VectorRunner(lambda: self.make(spec.id, **kwargs), num_envs, seed)
        merged = {**spec.kwargs, **kwargs}
        merged.setdefault(LIMIT, spec.max_episode_steps)
        factory = self._resolve(spec.vector_entry_point)
        try:
            vector: VectorEnvironment = factory(num_envs=num_envs, seed=seed, **merged)
        except TypeError as exc:
            raise keyword_error(spec.id, factory, kwargs, exc, ["num_envs", "seed"]) from exc
        return vector

    def list(self, include_gym: bool = True) -> builtins.list[str]:
        """Every id this registry can make: shoal's own, then `gym:` ones (sorted within each)."""
        ids = sorted(self._specs)
        if include_gym:
            from shoal.envs.gym_adapter import gymnasium_ids

            ids += [f"{GYM_NAMESPACE}:{gym_id}" for gym_id in gymnasium_ids()]
        return ids

    def native_specs(self) -> builtins.list[EnvSpec]:
        return [self._specs[env_id] for env_id in sorted(self._specs)]

    def _resolve(self, entry: EntryPoint) -> Callable[..., Any]:
        if not isinstance(entry, str):
            return entry
        resolved = self._resolved.get(entry)
        if resolved is None:
            module_name, _, attr = entry.partition(":")
            try:
                resolved = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as exc:
                raise EnvError(f"entry point {entry!r} cannot be loaded: {exc}") from exc
            self._resolved[entry] = resolved
        return resolved

    def _gym_spec(self, env_id: str) -> EnvSpec:
        spec = self._gym_specs.get(env_id)
        if spec is None:
            from shoal.envs.gym_adapter import gym_spec

            spec = gym_spec(env_id, env_id[len(GYM_NAMESPACE) + 1 :], self._lookup_error)
            self._gym_specs[env_id] = spec
        return spec

    def _alias_table(self) -> dict[str, str]:
        """lower-case id -> id, and lower-case name -> the newest version of that name."""
        if self._aliases is None:
            table: dict[str, str] = {}
            newest: dict[str, tuple[int, str]] = {}
            for env_id in self._specs:
                parsed = parse_id(env_id)
                table[env_id.lower()] = env_id
                key = parsed.name.lower()
                version = parsed.version or 0
                if key not in newest or version > newest[key][0]:
                    newest[key] = (version, env_id)
            for key, (_, env_id) in newest.items():
                table.setdefault(key, env_id)
            self._aliases = table
        return self._aliases

    def newest_version(self, name: str) -> str | None:
        """The newest registered id whose name is `name` (case-insensitive), if any."""
        return self._alias_table().get(name.lower())

    def _lookup_error(self, env_id: str) -> EnvError:
        parsed = parse_id(env_id)
        if parsed.namespace is None:
            newest = self.newest_version(parsed.name)
            if newest is not None and parsed.version is not None:
                newest_version = parse_id(newest).version or 0
                if parsed.version < newest_version:
                    return DeprecatedEnvironment(f"{env_id} is outdated; use {newest} instead")
                return UnknownEnvironment(
                    f"{env_id} does not exist; the newest version is {newest}"
                )
        close = []
        if parsed.namespace is None:
            close = difflib.get_close_matches(env_id, builtins.list(self._specs), n=3, cutoff=0.6)
        if not close:  # an alias misspelt (`cartpol`): matched without case, named canonically
            aliases = self._alias_table()
            near = difflib.get_close_matches(
                env_id.lower(), builtins.list(aliases), n=3, cutoff=0.6
            )
            close = builtins.list(dict.fromkeys(aliases[a] for a in near))
        if not close:
            close = difflib.get_close_matches(env_id, self.list(), n=3, cutoff=0.6)
        if close:
            return UnknownEnvironment(
                f"no environment {env_id!r}; did you mean {', '.join(close)}?"
            )
        return UnknownEnvironment(
            f"no environment {env_id!r}; run 'shoal envs list' to see the available ids"
        )


default_registry = Registry()


def register(
    env_id: str,
    entry_point: EntryPoint,
    *,
    kwargs: Mapping[str, Any] | None = None,
    max_episode_steps: int | None = None,
    vector_entry_point: EntryPoint | None = None,
    requirements: tuple[str, ...] = (),
    description: str = "",
) -> EnvSpec:
    """Register an environment in the default registry (see `Registry.register`)."""
    return default_registry.register(
        env_id,
        entry_point,
        kwargs=kwargs,
        max_episode_steps=max_episode_steps,
        vector_entry_point=vector_entry_point,
        requirements=requirements,
        description=description,
    )


def make(env_id: str, **kwargs: Any) -> BaseEnvironment[Any, Any]:
    """A new environment from the default registry (see `Registry.make`)."""
    return default_registry.make(env_id, **kwargs)


def spec(env_id: str) -> EnvSpec:
    return default_registry.spec(env_id)


def list(include_gym: bool = True) -> builtins.list[str]:
    return default_registry.list(include_gym)
