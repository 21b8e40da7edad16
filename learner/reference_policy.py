"""`frozen_copy`: a frozen copy of a policy as it is now, held as the policy is held, for the
token update's KL penalty to a reference (learner/token_ppo.py).

A plain or DDP-replicated policy is deep-copied. An FSDP2-sharded one refuses `deepcopy`, and
a full copy of a model that had to be sharded would not fit a rank anyway, so the copy is built
on the meta device from the policy's spec, sharded on the policy's own mesh and materialised
there, and each rank copies its own shards into it: nothing is gathered, and the reference
costs each rank one more shard of the parameters, no gradients and no optimiser state. Its
forward all-gathers layer by layer through its own FSDP2 hooks, in float32 (the reference
takes no gradients, so mixed precision would only add rounding to the KL).
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from shoal.learner.errors import PolicyError
from shoal.learner.models.base import PolicyModel
from shoal.learner.models.registry import model_from_spec


def frozen_copy(policy: PolicyModel) -> PolicyModel:
    """A copy of `policy`'s current weights that takes no gradients and is in eval mode. For
    an FSDP2-sharded policy this is a collective: every rank of its mesh calls it."""
    reference = _sharded_copy(policy) if isinstance(policy, FSDPModule) else copy.deepcopy(policy)
    return reference.requires_grad_(False).eval()


def _sharded_copy(policy: PolicyModel) -> PolicyModel:
    for module in policy.modules():  # after a forward the root keeps its parameters gathered
        if isinstance(module, FSDPModule):
            module.reshard()
    shard = next(p for p in policy.parameters() if isinstance(p, DTensor))
    mesh = shard.device_mesh
    local = shard.to_local().device
    offloaded = local.type == "cpu" and mesh.device_type != "cpu"
    offload = CPUOffloadPolicy() if offloaded else OffloadPolicy()
    with torch.device("meta"):
        reference = model_from_spec(policy.spec())
    for unit in reference.shard_units():
        fully_shard(unit, mesh=mesh, offload_policy=offload)
    fully_shard(reference, mesh=mesh, offload_policy=offload)
    reference.to_empty(device=local)
    with torch.no_grad():
        for (name, mine), (theirs_name, theirs) in zip(
            [*reference.named_parameters(), *reference.named_buffers()],
            [*policy.named_parameters(), *policy.named_buffers()],
            strict=True,
        ):
            if name != theirs_name:
                raise PolicyError(
                    f"the reference built from the policy's spec has {name!r} where the policy "
                    f"has {theirs_name!r}: its spec does not rebuild its architecture"
                )
            _local(mine).copy_(_local(theirs))
    return reference


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
