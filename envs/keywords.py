"""The error for an environment constructor called with keywords it does not take.

A bare TypeError names the factory (`make_single() got an unexpected keyword argument
'gravity'`), a function the user never wrote; the error here names the environment, the
keywords it refused and the ones it takes, read from the factory's signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping
from typing import Any

from shoal.envs.errors import EnvError

_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def keyword_error(
    env_id: str,
    factory: Callable[..., Any] | None,
    given: Mapping[str, Any],
    exc: TypeError,
    internal: Collection[str] = (),
    extra: Collection[str] = (),
) -> EnvError:
    """EnvError for `factory(**given)` having raised `exc` (`factory` None where it could not
    be found: the error keeps `exc`'s words). `internal` are keywords the caller passes itself
    (num_envs, seed), left out of the list; `extra` are ones the caller takes before the
    factory sees them (max_episode_steps), added to it."""
    accepted = None if factory is None else _keywords(factory)
    if accepted is not None:
        unknown = sorted(set(given) - accepted)
        if unknown:
            takes = sorted((accepted - set(internal)) | set(extra))
            return EnvError(
                f"{env_id} takes no keyword {', '.join(map(repr, unknown))}; "
                f"its keywords are: {', '.join(takes) or 'none'}"
            )
    return EnvError(f"{env_id} cannot be made with {sorted(given)}: {exc}")


def _keywords(factory: Callable[..., Any]) -> set[str] | None:
    """The keywords `factory` accepts, or None when it takes any (**kwargs) or has no
    readable signature (a builtin)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in _NAMED}
