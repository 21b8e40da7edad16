"""Building a model too big for one rank: on the `meta` device first (shapes, no storage), then
given storage and initialised one shard unit at a time on the rank's device, each unit handed to
`shard` (FSDP2's `fully_shard`) before the next one is allocated.

An eager build makes every rank hold the whole fp32 model before `fully_shard` can cut it: at
100B parameters that is 400 GB per GPU (docs/scaling.md, "What breaks first"). Built this way a
rank's high-water mark is its shards of the units done so far plus one whole unit (the
embeddings, a decoder layer or the head). Every rank runs the same initialisation in the
same order from the same seed, in an RNG fork so the caller's stream is untouched: the full
tensors the shards are cut from are the same on every rank, and the same a lone rank or a
replicated group starts from, so the strategy changes how the model is held, never the model.

Only the causal LM is deferred (it says how to fill one module: `PolicyModel.init_module`):
from `[model]` sizes its values are drawn; from `model.path` they are read from the directory's
safetensors once the model is held (`read_weights`: DCP's HuggingFace reader, each rank only
its own rows; learner/models/lm_files.py). Tied embeddings (a directory's
`tie_word_embeddings`) stay one parameter: they are in no unit of their own, so the root
holds them, and the tie is made again once every module has storage. The small MLP/CNN/multi
families are built whole, as before.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from gymnasium import spaces
from torch import nn

from shoal.learner.models.base import PolicyModel
from shoal.learner.models.causal_lm import CausalLMPolicy
from shoal.learner.models.config import ModelConfig
from shoal.learner.models.registry import build_model


def build_policy(
    cfg: ModelConfig,
    observation_space: spaces.Space[Any],
    action_space: spaces.Space[Any],
    device: torch.device,
) -> PolicyModel:
    """A learner's policy: a causal LM on the meta device (`materialize` gives it storage
    once the group knows how it is held), anything else built and moved to `device`."""
    if cfg.family == "causal-lm":
        return CausalLMPolicy.deferred(cfg, observation_space, action_space)
    return build_model(cfg, observation_space, action_space).to(device)


def read_weights(policy: PolicyModel) -> None:
    """A policy deferred from a directory gets the directory's values where they are held,
    once it is materialised (and sharded): each rank of a sharded group reads only its rows."""
    if isinstance(policy, CausalLMPolicy) and policy.source is not None:
        policy.source.load_into(policy.lm)


def is_deferred(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` still has no storage."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def materialize(
    policy: PolicyModel,
    device: torch.device,
    seed: int,
    shard: Callable[[nn.Module], None] | None = None,
) -> None:
    """Give a deferred `policy` storage on `device` and its initial values, unit by unit
    (`policy.shard_units()`, then everything outside them), calling `shard` on each unit as
    soon as it is initialised. The caller shards the root (the rest) afterwards."""
    units = policy.shard_units()
    inside = {id(m) for unit in units for m in unit.modules()}
    rest = [m for m in policy.modules() if id(m) not in inside]
    ties = _ties(policy)
    forked = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked), torch.no_grad():
        torch.manual_seed(seed)
        for unit in units:
            _initialise(policy, unit.modules(), device)
            if shard is not None:
                shard(unit)
        _initialise(policy, rest, device)
    for module, name, owner, owner_name in ties:
        setattr(module, name, getattr(owner, owner_name))


def _ties(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """Every parameter that a module shares with an earlier one (tied embeddings: the LM head's
    weight is the input embeddings'), as (module, name, owner, owner's name). Giving modules
    storage one at a time gives each its own tensor, so the ties are made again afterwards;
    a shard unit keeps its ties inside it (`shard_units`), so they are all in one unit."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            owner = first.setdefault(id(param), (module, name))
            if owner[0] is not module:
                ties.append((module, name, *owner))
    return ties


def _initialise(policy: PolicyModel, modules: Iterable[nn.Module], device: torch.device) -> None:
    for module in modules:
        module.to_empty(device=device, recurse=False)
        policy.init_module(module)
