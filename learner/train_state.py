"""The model and optimiser state a checkpoint holds, saved and restored in one place.

`model_optimizer_state` takes torch's own distributed state dicts (`get_state_dict`): the
model's tensors and the optimiser's per-parameter state, keyed by parameter name, as local
shards (DTensors) under FSDP2 and plain tensors otherwise, with DDP's `module.` prefix gone. So
a checkpoint saved by any wrapping and world size restores into any other (DCP reshards). The
optimiser's param_groups (lr, betas, weight decay) are not saved: they come from the config,
so a changed config takes effect on resume. Format-1 checkpoints (one torch.save file from the
learner before DCP, whose hand-written Adam used torch.optim.Adam's layout, parameters named
by index) restore through the full state dict path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from shoal.learner.checkpoint import CheckpointInfo, CheckpointManager
from shoal.learner.checkpoint_files import LEGACY_FORMAT
from shoal.learner.errors import CheckpointError

_LEGACY_KEYS = ("step", "exp_avg", "exp_avg_sq")


def model_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """{"model": ..., "optimizer": per-parameter state}: tensors only, for `save()`. On a group
    every rank calls it (FSDP2 state dicts are collective-free, but keep the call symmetric)."""
    _state_for_every_parameter(optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state["state"]}


def _state_for_every_parameter(optimizer: torch.optim.Optimizer) -> None:
    """Give each trainable parameter the optimiser never stepped (a GRPO run's value head: no
    loss reaches it) the state a first step makes, by a step with zero gradients at lr 0 on
    those parameters only, as torch's state-dict code does for a fresh optimiser. A restore's
    template comes from a fresh optimiser, so it holds state for every parameter and refuses a
    checkpoint without it."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [p for p in params if p.requires_grad and not optimizer.state.get(p)]
    if not missing or not optimizer.state:  # a fresh optimiser: get_state_dict fills it all
        return
    grads = [p.grad for p in params]
    lrs = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = None
    for p in missing:
        p.grad = torch.zeros_like(p)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = torch.tensor(0.0) if isinstance(lr, torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad


def restore_model_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    manager: CheckpointManager,
    info: CheckpointInfo,
) -> None:
    """Load `info` into `model` and `optimizer` in place, whatever world size saved it.
    Format 2: COLLECTIVE in a group (every rank reads its own shards through DCP)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    groups: Any = optim_state["param_groups"]
    if info.format == LEGACY_FORMAT:
        _restore_legacy(model, optimizer, manager.load_legacy(info), groups)
        return
    template: dict[str, Any] = {"model": model_state, "optimizer": optim_state["state"]}
    manager.load_tensors(info, template)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=template["model"],
        optim_state_dict={"state": template["optimizer"], "param_groups": groups},
    )


def _restore_legacy(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    groups: list[dict[str, Any]],
) -> None:
    """A format-1 state: full tensors, the optimiser's entries keyed by parameter index."""
    try:
        model_state, saved = state["model"], state["optimizer"]
        names = [name for group in groups for name in group["params"]]
        saved_ids = [i for group in saved["param_groups"] for i in group["params"]]
        if len(saved_ids) != len(names):
            raise CheckpointError(
                f"the checkpoint's optimiser state is for {len(saved_ids)} parameters, the "
                f"model has {len(names)}: it is not from this model"
            )
        by_id = dict(zip(saved_ids, names, strict=True))
        optim_state: dict[str, Any] = {
            by_id[i]: {key: _step_tensor(entry[key]) if key == "step" else entry[key]
                       for key in _LEGACY_KEYS}
            for i, entry in saved["state"].items()
        }  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"the format-1 checkpoint has no usable model/optimizer state ({exc!r}); it was "
            "not written by a shoal learner"
        ) from None
    try:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=model_state,
            optim_state_dict={"state": optim_state, "param_groups": groups},
            options=StateDictOptions(full_state_dict=True),
        )
    except (RuntimeError, KeyError, ValueError) as exc:
        raise CheckpointError(
            f"the format-1 checkpoint does not fit this model ({exc}); resume with the model "
            "it was saved with"
        ) from None


def _step_tensor(value: Any) -> torch.Tensor:
    return torch.as_tensor(float(value), dtype=torch.float32)
