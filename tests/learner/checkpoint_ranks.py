"""One rank of a real gloo group that saves or restores a sharded checkpoint (spawned by
tests/learner/test_checkpoint_dcp.py).

    checkpoint_ranks.py save|load WRAP CKPT_DIR OUT RANK WORLD PORT

WRAP is fsdp (torch.distributed.fsdp.fully_shard) or ddp. `save` trains two AdamW steps,
saves step 2 asynchronously, writes the full state at save time to OUT (rank 0), then keeps
training while the write runs. `load` restores the newest checkpoint and writes the full
state it ended up with to OUT (rank 0).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from shoal.learner.checkpoint import CheckpointManager
from shoal.learner.group import exit_after_group
from shoal.learner.train_state import model_optimizer_state, restore_model_optimizer


def build(seed: int) -> nn.Module:
    """Uneven shapes on purpose: 3 output rows do not split evenly over 2 ranks."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 4, generator=generator)
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


def full(value: Any) -> Any:
    """Every tensor of a state dict in full (a DTensor gathered: a collective)."""
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: full(v) for k, v in value.items()}
    return value


def wrapped(wrap: str, world: int, seed: int) -> nn.Module:
    model = build(seed)
    if wrap == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    return DistributedDataParallel(model)


def main() -> None:
    mode, wrap, directory, out = sys.argv[1:5]
    rank, world, port = (int(v) for v in sys.argv[5:8])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        model = wrapped(wrap, world, seed=1 if mode == "save" else 99)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
        with CheckpointManager(directory) as manager:
            if mode == "save":
                for step in range(2):
                    train_step(model, optimizer, seed=10 * step + rank)
                state = model_optimizer_state(model, optimizer)
                manager.save(state, 2, {"rank0": rank == 0, "world": world})
                expected = full(model_optimizer_state(model, optimizer))
                for step in range(2, 4):  # training goes on while the write runs
                    train_step(model, optimizer, seed=10 * step + rank)
                manager.wait()
            else:
                info = manager.latest()
                assert info is not None, "no checkpoint to load"
                restore_model_optimizer(model, optimizer, manager, info)
                expected = full(model_optimizer_state(model, optimizer))
                train_step(model, optimizer, seed=7)  # the restored optimiser steps
        if rank == 0:
            torch.save(expected, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_after_group(0)
