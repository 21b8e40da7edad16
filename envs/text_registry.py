"""Which environment ids are text environments, and how to make one.

A text environment is trained through the token path (a causal LM writes its completion), so
the rollout worker and the pipeline ask `is_text_env(env_id)` and build it with
`make_text_env`. Ids and aliases resolve through the shared registry first (`codegen` is
CodeGen-v1), so a text environment is also listed by `shoal envs list`. CodeExec-v1 is both:
`make` gives its gym-style form (a whole program as one action), `make_text_env` its 24 tasks
as prompts whose completion is the function body.
"""

from __future__ import annotations

import importlib
from typing import Any

from shoal.envs.errors import EnvError
from shoal.envs.keywords import keyword_error
from shoal.envs.text_tasks import TextEnvironment

__all__ = ["TEXT_ENVS", "is_text_env", "make_text_env", "text_env_hash", "text_manifest"]

TEXT_ENVS: dict[str, str] = {
    "CodeGen-v1": "shoal.envs.codegen:CodeGenEnv",
    "Countdown-v1": "shoal.envs.countdown:CountdownEnv",
    "CodeExec-v1": "shoal.envs.code_exec_text:CodeExecTextEnv",
}
SHARED_KWARGS = ("tokenizer", "max_new_tokens")
"""The keyword arguments every text environment takes (the rest are each one's own)."""


def _canonical(env_id: str) -> str | None:
    """The registered id behind an id or alias, None when the registry does not know it."""
    from shoal.envs.registry import default_registry

    if env_id in TEXT_ENVS:
        return env_id
    try:
        return default_registry.spec(env_id).id
    except EnvError:
        return None


def is_text_env(env_id: str) -> bool:
    """Whether `env_id` (or an alias of it) is trained through the token path."""
    return isinstance(env_id, str) and _canonical(env_id) in TEXT_ENVS


def make_text_env(env_id: str, **kwargs: Any) -> TextEnvironment:
    """A new text environment; kwargs are its constructor's (tokenizer, max_new_tokens, ...)."""
    canonical = _canonical(env_id) if isinstance(env_id, str) else None
    if canonical not in TEXT_ENVS:
        raise EnvError(
            f"{env_id!r} is not a text environment; the text environments are "
            f"{', '.join(sorted(TEXT_ENVS))}"
        )
    module_name, _, attr = TEXT_ENVS[canonical].partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    try:
        env: TextEnvironment = factory(**kwargs)
    except TypeError as exc:
        raise keyword_error(canonical, factory, kwargs, exc) from exc
    return env


def text_env_hash(env: TextEnvironment) -> str:
    """The environment hash of a text environment: sha256 of its manifest (generator name,
    version, parameters, tokenizer fingerprint, completion length, stop strings)."""
    return env.digest()


def text_manifest(env_id: str, params: dict[str, Any]) -> dict[str, Any] | None:
    """The text manifest that `env_manifest` adds for a text id (None for any other id); only
    the shared kwargs of `params` apply (the rest configure the registry's gym-style form)."""
    if not is_text_env(env_id):
        return None
    env = make_text_env(env_id, **{k: params[k] for k in SHARED_KWARGS if k in params})
    try:
        return env.manifest()
    finally:
        env.close()
