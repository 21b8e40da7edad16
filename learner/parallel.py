"""How a learner group holds its model: replicated, sharded, or sharded inside islands and
replicated across them, on a `DeviceMesh` laid out from where the scheduler placed the ranks.

The choice is torch's own building blocks, nothing hand-written: DDP replicates a model that
fits on every rank (one bucketed all-reduce per backward pass, the cheapest thing for a small
policy), FSDP2's `fully_shard` shards one that does not (parameters, gradients and optimiser
state split over the ranks, gathered layer by layer), and HSDP is `fully_shard` on a 2-D mesh:
shard inside an NVLink island, where bandwidth is high, and all-reduce across islands over
RDMA, which is the seed's 32 × 16 layout. `plan_parallelism` is the pure decision (tested with
hypothesis); `parallelize` applies it. The mesh rows are the islands the ranks report
(`SHOAL_TASK_ISLAND`, set by their node from its GPU topology; a CPU rank's island is its
host), so a shard group never crosses an island however the ranks were numbered.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from shoal.learner.cpu_features import native_bf16
from shoal.learner.errors import LearnerError
from shoal.learner.materialize import is_deferred, materialize, read_weights
from shoal.learner.models.base import PolicyModel
from shoal.learner.weight_plan import row_span

log = logging.getLogger(__name__)

Sharding = Literal["auto", "replicate", "fsdp", "hsdp"]
Strategy = Literal["single", "replicate", "fsdp", "hsdp"]
TRAIN_BYTES_PER_PARAM = 16
"""fp32 parameter + gradient + AdamW's two moments: what one replica of a parameter costs."""
REPLICATE_SHARE = 0.25
"""`auto` replicates a model whose training state takes at most this share of a rank's
memory; the rest is for activations, the weight-sync snapshot and the allocator's slack."""


class ParallelError(LearnerError):
    """The learner group cannot hold the model as configured."""


@dataclass(frozen=True)
class ParallelPlan:
    """The strategy and the mesh: `layout[i]` lists the ranks of shard group i (one island);
    the j-th rank of every row forms replica group j. One row for replicate and fsdp."""

    strategy: Strategy
    layout: tuple[tuple[int, ...], ...]
    reason: str

    @property
    def sharded(self) -> bool:
        return self.strategy in ("fsdp", "hsdp")


def plan_parallelism(
    sharding: Sharding, islands: Sequence[str], train_bytes: int, memory_bytes: int
) -> ParallelPlan:
    """Choose how the group holds the model; `islands[r]` is rank r's island label.

    `auto`: replicate what fits (`train_bytes` ≤ REPLICATE_SHARE of `memory_bytes`), else
    HSDP when the ranks fill two or more islands evenly, else FSDP over the whole group.
    An explicit `hsdp` on an uneven placement falls back to FSDP and says why.
    """
    world = len(islands)
    if world < 1:
        raise ParallelError("a learner group has at least one rank")
    everyone = (tuple(range(world)),)
    if world == 1:
        return ParallelPlan("single", everyone, "one rank: nothing to replicate or shard")
    if sharding == "replicate":
        return ParallelPlan("replicate", everyone, "learner.sharding = 'replicate'")
    if sharding == "fsdp":
        return ParallelPlan("fsdp", everyone, "learner.sharding = 'fsdp'")
    if sharding == "auto" and train_bytes <= REPLICATE_SHARE * memory_bytes:
        return ParallelPlan(
            "replicate",
            everyone,
            f"the model's training state ({_gib(train_bytes)}) fits every rank's memory "
            f"({_gib(memory_bytes)}) with room to spare",
        )
    rows = island_rows(islands)
    even = len(rows) > 1 and len({len(r) for r in rows}) == 1
    if even and all(len(r) > 1 for r in rows):
        return ParallelPlan(
            "hsdp",
            rows,
            f"shard inside each of {len(rows)} islands of {len(rows[0])} ranks, replicate across",
        )
    why = "one island" if len(rows) == 1 else "islands hold different numbers of ranks"
    if even:
        why = "one rank per island (nothing to shard inside an island)"
    return ParallelPlan("fsdp", everyone, f"shard over all {world} ranks: {why}")


def shard_bytes(plan: ParallelPlan, train_bytes: int) -> int:
    """One rank's share of the training state under `plan`: all of it unless sharded, else
    its shard group's 1/N (the state is split inside a row of the mesh, copied across rows)."""
    return -(-train_bytes // len(plan.layout[0])) if plan.sharded else train_bytes


def check_fits(plan: ParallelPlan, train_bytes: int, memory_bytes: int) -> None:
    """Refuse a plan whose training state alone outgrows a rank (ParallelError), before any
    parameter gets storage: activations and buffers only add to it, so it could never run,
    and the allocator's failure would come from deep inside the build."""
    share = shard_bytes(plan, train_bytes)
    if share > memory_bytes:
        raise ParallelError(
            f"the model's training state ({_gib(train_bytes)}: 16 bytes a parameter for the "
            f"weight, its gradient and AdamW's two moments) is {_gib(share)} per rank held as "
            f"{plan.strategy}, over a rank's {_gib(memory_bytes)}: add ranks (learner.ranks) "
            "with learner.sharding = 'fsdp', set learner.cpu_offload = true, or make the model "
            "smaller"
        )


def island_rows(islands: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The ranks grouped by island, islands in order of their lowest rank."""
    rows: dict[str, list[int]] = {}
    for rank, island in enumerate(islands):
        rows.setdefault(island, []).append(rank)
    return tuple(tuple(ranks) for ranks in rows.values())


@dataclass(frozen=True)
class ShardingOptions:
    """How a sharded model is held beyond the strategy (learner.* keys)."""

    mixed_precision: bool = False
    """bf16 compute with fp32 gradient reductions: on GPUs; on a CPU only where it is faster
    (`_cpu_autocast`)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimiser state in host memory (FSDP2)."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them."""


class Parallelized:
    """The model as the learner trains it: `module` is what forward and backward go through
    (the DDP or FSDP2 wrapper), `policy` the model itself (its spec, its checks)."""

    def __init__(
        self, module: nn.Module, policy: PolicyModel, plan: ParallelPlan, autocast: str | None
    ) -> None:
        self.module = module
        self.policy = policy
        self.plan = plan
        self.autocast = autocast
        """The device type whose bf16 autocast wraps every forward ("cuda", "cpu"), or None
        (float32, or FSDP2, which casts itself)."""

    def forward_context(self) -> contextlib.AbstractContextManager[object]:
        """bf16 autocast for an unsharded model with mixed precision."""
        if self.autocast is not None:
            return torch.autocast(self.autocast, dtype=torch.bfloat16)
        return contextlib.nullcontext()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's shards gathered (a collective: every rank of the mesh
    calls it for the same tensor in the same order), a plain tensor as it is."""
    gather = getattr(tensor, "full_tensor", None)
    return gather() if callable(gather) else tensor


def publishing_row(plan: ParallelPlan, rank: int) -> tuple[int, ...]:
    """The ranks that publish `rank`'s weight-sync parts, in part order: its shard group when
    the model is sharded (each sends the rows it holds), else the rank alone (it holds all)."""
    if not plan.sharded:
        return (rank,)
    row = next((row for row in plan.layout if rank in row), None)
    if row is None:
        raise ParallelError(f"rank {rank} is in no shard group of the plan {plan.layout}")
    return row


def owned_rows(tensor: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    """The rows of `tensor` that weight-sync part `part` of `parts` carries (`row_span`), as a
    plain tensor. A rank's own dim-0 shard is exactly those rows, so a sharded parameter needs
    no collective; any other placement is gathered (every rank then calls this for the same
    tensor in the same order, as for `full_tensor`), a plain tensor is sliced."""
    if parts == 1:
        return full_tensor(tensor)
    rows = tensor.shape[0] if tensor.dim() else 1
    lo, hi = row_span(rows, part, parts)
    local = _own_shard(tensor, part, parts, hi - lo)
    if local is not None:
        return local
    whole = full_tensor(tensor)
    return (whole if whole.dim() else whole.reshape(1))[lo:hi]


def _own_shard(tensor: torch.Tensor, part: int, parts: int, rows: int) -> torch.Tensor | None:
    """This rank's local tensor when the tensor is dim-0 sharded over a `shard` mesh dimension
    of `parts` ranks (replicated on any other), else None. The choice depends only on the
    placement, the same on every rank, so no rank gathers a tensor its peers do not."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return None
    mesh, placements = tensor.device_mesh, tensor.placements
    names = mesh.mesh_dim_names or ()
    if "shard" not in names:
        return None
    at = names.index("shard")
    replicated = all(isinstance(p, Replicate) for i, p in enumerate(placements) if i != at)
    if placements[at] != Shard(0) or mesh.size(at) != parts or not replicated:
        return None
    local = tensor.to_local()
    if mesh.get_local_rank(at) != part or local.shape[0] != rows:
        raise ParallelError(
            f"this rank holds {local.shape[0]} rows at shard coordinate "
            f"{mesh.get_local_rank(at)}, but weight-sync part {part} of {parts} is {rows} rows: "
            "the shard layout is not torch.chunk's"
        )
    return local


def parallelize(
    policy: PolicyModel,
    plan: ParallelPlan,
    device: torch.device,
    options: ShardingOptions,
    seed: int = 0,
) -> Parallelized:
    """Wrap `policy` per `plan`. A policy built eagerly is already on `device`, identically
    initialised on every rank; one built on the meta device (learner/materialize.py) is given
    storage and its initial values from `seed` here, unit by unit as it is sharded, or, deferred
    from a directory, the directory's values once it is held."""
    mixed = options.mixed_precision and device.type == "cuda"
    autocast = "cuda" if mixed else "cpu" if _cpu_autocast(policy, device, options) else None
    if options.activation_checkpointing:
        policy.enable_activation_checkpointing()
    if plan.sharded:
        _fully_shard(policy, plan, device, mixed, options.cpu_offload, seed)
        read_weights(policy)
        return Parallelized(policy, policy, plan, autocast=None)
    if is_deferred(policy):
        materialize(policy, device, seed)
        read_weights(policy)
    if plan.strategy == "single":
        return Parallelized(policy, policy, plan, autocast)
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return Parallelized(DistributedDataParallel(policy, device_ids=ids), policy, plan, autocast)


def _cpu_autocast(policy: PolicyModel, device: torch.device, options: ShardingOptions) -> bool:
    """Mixed precision on a CPU: only for a family whose step it speeds up (`cpu_autocast`:
    the CNN's is 2x faster, an MLP's 1.5x slower, docs/benchmarks.md) on a CPU with bf16
    instructions (emulated, every family is slower). Sharded CPU models stay float32."""
    return (
        options.mixed_precision and device.type == "cpu" and policy.cpu_autocast and native_bf16()
    )


def _fully_shard(
    policy: PolicyModel,
    plan: ParallelPlan,
    device: torch.device,
    mixed: bool,
    offload: bool,
    seed: int,
) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    if plan.strategy == "hsdp":
        # Row i is island i's shard group; column j, rank j of every island, a replica group.
        ranks = torch.tensor(plan.layout)
        mesh = DeviceMesh(device.type, ranks, mesh_dim_names=("replicate", "shard"))
    else:
        mesh = DeviceMesh(device.type, torch.tensor(plan.layout[0]), mesh_dim_names=("shard",))
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed
        else MixedPrecisionPolicy()
    )
    offload_policy = CPUOffloadPolicy() if offload else OffloadPolicy()

    def shard(module: nn.Module) -> None:
        fully_shard(module, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)

    if is_deferred(policy):
        materialize(policy, device, seed, shard)
    else:
        for unit in policy.shard_units():
            shard(unit)
    shard(policy)


def rank_memory_bytes(device: torch.device, ranks_on_host: int) -> int:
    """What one rank may use: its GPU's memory, or its share of this host's RAM."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total // max(ranks_on_host, 1))


def training_bytes(policy: nn.Module) -> int:
    """The model's training state if replicated on one rank (TRAIN_BYTES_PER_PARAM each)."""
    return TRAIN_BYTES_PER_PARAM * sum(p.numel() for p in policy.parameters())


def _gib(count: float) -> str:
    return f"{count / 2**30:.2f} GiB"
