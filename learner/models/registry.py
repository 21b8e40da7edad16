"""Which family a `[model]` section or a stored spec builds: `build_model` and `model_from_spec`.

Custom families are named by import path (`package.module:factory`), as environments are: the
factory is called as factory(observation_space, action_space, **options) and must return a
`PolicyModel`; the path and the options go into the spec, so checkpoints of a custom model
rebuild it too. A spec is read back from storage, so it is bounded and checked before use.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from gymnasium import spaces

from shoal.envs.packed_obs import PackedBox
from shoal.learner.errors import PolicyError
from shoal.learner.models.base import PolicyModel
from shoal.learner.models.causal_lm import CausalLMPolicy
from shoal.learner.models.cnn import CNNPolicy, is_image_space
from shoal.learner.models.config import FACTORY_RE, MAX_OPTIONS, ModelConfig
from shoal.learner.models.mlp import MLPPolicy, legacy_spec_spaces
from shoal.learner.models.multi import MultiPolicy
from shoal.learner.models.spaces import check_bounded, space_from_json

_FROM_SPEC: dict[str, Callable[..., PolicyModel]] = {
    "mlp": MLPPolicy.from_spec,
    "cnn": CNNPolicy.from_spec,
    "multi": MultiPolicy.from_spec,
    "causal-lm": CausalLMPolicy.from_spec,
}


def build_model(
    cfg: ModelConfig, observation_space: spaces.Space[Any], action_space: spaces.Space[Any]
) -> PolicyModel:
    """A fresh policy of `cfg.family` for these spaces (seed torch first for a reproducible one)."""
    family = cfg.family
    if family == "auto":
        family = auto_family(observation_space)
    if family == "mlp":
        return MLPPolicy(observation_space, action_space, cfg.hidden)
    if family == "multi":
        return MultiPolicy(observation_space, action_space, cfg.hidden)
    if family == "cnn":
        return CNNPolicy(observation_space, action_space, cfg.channels, cfg.hidden)
    if family == "causal-lm":
        return CausalLMPolicy.from_config(cfg, observation_space, action_space)
    return _custom(family, observation_space, action_space, cfg.options)


def auto_family(observation_space: spaces.Space[Any]) -> str:
    """`family = "auto"`: multi for packed structured observations, cnn for images, else mlp."""
    if isinstance(observation_space, PackedBox):
        return "multi"
    return "cnn" if is_image_space(observation_space) else "mlp"


def model_from_spec(spec: Mapping[str, Any]) -> PolicyModel:
    """The architecture `PolicyModel.spec()` described, with fresh weights (load them after).

    Also reads the specs of the former `ActorCritic` (no `family`: an MLP). PolicyError on a
    malformed, oversized or unknown spec.
    """
    check_bounded(spec, "the policy spec")
    if not isinstance(spec, Mapping):
        raise PolicyError(f"a policy spec must be an object, got {type(spec).__name__}")
    if "family" not in spec and "obs_shape" in spec:
        observation_space, action_space = legacy_spec_spaces(spec)
        return MLPPolicy.from_spec(observation_space, action_space, spec)
    family = spec.get("family")
    observation_space = space_from_json(spec.get("observation_space"))
    action_space = space_from_json(spec.get("action_space"))
    if isinstance(family, str) and family in _FROM_SPEC:
        return _FROM_SPEC[family](observation_space, action_space, spec)
    if isinstance(family, str) and FACTORY_RE.match(family):
        options = spec.get("options", {})
        if not isinstance(options, dict) or len(options) > MAX_OPTIONS:
            raise PolicyError("policy spec: options must be an object of keyword arguments")
        return _custom(family, observation_space, action_space, options)
    raise PolicyError(
        f"policy spec: family {family!r:.60} is unknown; valid: {', '.join(_FROM_SPEC)} or "
        "'package.module:factory'"
    )


def _custom(
    path: str,
    observation_space: spaces.Space[Any],
    action_space: spaces.Space[Any],
    options: dict[str, Any],
) -> PolicyModel:
    factory = _import_factory(path)
    try:
        json.dumps(options)
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"model.options for {path} must be plain JSON values: {exc}") from exc
    model = factory(observation_space, action_space, **options)
    if not isinstance(model, PolicyModel):
        raise PolicyError(
            f"{path} returned {type(model).__name__}, not a PolicyModel: subclass "
            "shoal.learner.models.PolicyModel (see docs/models.md)"
        )
    model.custom_factory = (path, dict(options))
    return model


def _import_factory(path: str) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PolicyError(
            f"model family {path!r}: cannot import {module_name!r} ({exc}); install the package "
            "that provides it on every host"
        ) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise PolicyError(f"model family {path!r}: {module_name} has no callable {attr!r}")
    return factory
