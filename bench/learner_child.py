"""What runs inside the child processes of `shoal bench learner`.

Each child is one rank of a gloo group (or a lone rank), started by bench/learner.py with its
job as JSON in argv; it prints one JSON line of results and exits. Memory is measured here, in
a process that did nothing else, as the kernel's resident high-water mark (VmHWM).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from shoal.learner.models import PolicyModel

RANK_ENV = "SHOAL_BENCH_RANK"
WORLD_ENV = "SHOAL_BENCH_WORLD"
PORT_ENV = "SHOAL_BENCH_PORT"
MB = 1e6
ACTIONS = 16
"""Discrete actions of the bench policy: the first 16 logits of the last position."""


def peak_rss_bytes() -> int:
    """This process's resident high-water mark, from /proc/self/status (VmHWM, in kB)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


# -- the model ------------------------------------------------------------------------------


def lm_shape(params: int) -> dict[str, int]:
    """A Qwen2-style causal LM of about `params` parameters: a width by size class, as many
    decoder layers as the budget left after the (untied) embeddings allows, then the
    vocabulary grown or shrunk to spend the rest."""
    if params < 5_000_000:
        hidden, vocab = 128, 4096
    elif params < 80_000_000:
        hidden, vocab = 512, 8192
    elif params < 500_000_000:
        hidden, vocab = 1024, 32000
    else:
        hidden, vocab = 2048, 32000
    heads = hidden // 64
    kv_heads = max(1, heads // 4)
    intermediate = round(hidden * 2.75 / 64) * 64
    kv = kv_heads * 64
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate
    layers = max(1, (params - 2 * vocab * hidden) // per_layer)
    vocab = max(ACTIONS, (params - layers * per_layer) // (2 * hidden))
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "intermediate_size": intermediate,
    }


def build_policy(shape: dict[str, int], seq: int, deferred: bool = False) -> PolicyModel:
    """shoal's causal-lm policy (the LM plus its value head), the same weights on every rank
    (seeded), in fp32 on the CPU; observations are `seq` token ids, ACTIONS discrete actions.
    `deferred`: on the meta device, as a learner builds it (`parallelize` materialises it)."""
    from gymnasium import spaces

    from shoal.learner.materialize import build_policy as build_deferred
    from shoal.learner.models import ModelConfig, build_model

    torch.manual_seed(0)
    cfg = ModelConfig(
        family="causal-lm",
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        num_layers=shape["num_layers"],
        num_heads=shape["num_heads"],
        num_kv_heads=shape["num_kv_heads"],
        intermediate_size=shape["intermediate_size"],
        max_positions=max(seq, 64),
    )
    tokens = spaces.Box(0, shape["vocab_size"] - 1, (seq,), np.int64)
    if deferred:
        return build_deferred(cfg, tokens, spaces.Discrete(ACTIONS), torch.device("cpu"))
    return build_model(cfg, tokens, spaces.Discrete(ACTIONS))


class Trainer:
    """shoal's learner step, `PPOLearner.minibatch_step` (forward, PPO loss, backward, gradient
    clipping, AdamW), on a fixed random batch of `batch` sequences; under FSDP2 (the group's
    `parallelize`, one shard unit per decoder layer, then the root) when the group has ranks.
    The model is built as a learner builds it: on the meta device, materialised by
    `parallelize`."""

    def __init__(self, task: dict[str, Any]) -> None:
        from shoal.learner.parallel import ShardingOptions, parallelize, plan_parallelism
        from shoal.learner.ppo import Batch, PPOConfig, PPOLearner

        world = dist.get_world_size() if dist.is_initialized() else 1
        policy = build_policy(task["shape"], task["seq"], deferred=True)
        plan = plan_parallelism("fsdp", ["bench"] * world, 0, 1)
        parallel = parallelize(policy, plan, torch.device("cpu"), ShardingOptions())
        self.learner = PPOLearner(
            parallel.module,
            PPOConfig(),
            policy=parallel.policy,
            forward_context=parallel.forward_context,
        )
        generator = torch.Generator().manual_seed(1)
        n, vocab = task["batch"], task["shape"]["vocab_size"]
        obs = torch.randint(0, vocab, (n, task["seq"]), generator=generator)
        actions = torch.randint(0, ACTIONS, (n,), generator=generator)
        with torch.no_grad():
            self.prox_logp, _, values = self.learner.evaluate(obs, actions)
        advantages = torch.randn(n, generator=generator)
        self.batch = Batch(obs, actions, self.prox_logp, values, advantages, values + advantages)
        self.index = torch.arange(n)
        self.weights = torch.ones(n)

    @property
    def model(self) -> nn.Module:
        return self.learner.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.learner.optimizer

    def step(self) -> None:
        self.learner.minibatch_step(self.batch, self.index, self.prox_logp, self.weights)


def _param_total(model: nn.Module) -> int:
    """Parameters of the whole model, however it is sharded (a DTensor's shape is global)."""
    return sum(int(torch.Size(p.shape).numel()) for p in model.parameters())


# -- jobs -----------------------------------------------------------------------------------


def step_memory(task: dict[str, Any]) -> dict[str, Any]:
    """Peak resident memory of one training step, unsharded (world 1) or under FSDP2, and
    the process's own before the model (torch, transformers and the group set up)."""
    from transformers import Qwen2ForCausalLM  # noqa: F401 - its import is not the model's

    before = peak_rss_bytes()
    trainer = Trainer(task)
    start = time.perf_counter()
    trainer.step()
    return {
        "params": _param_total(trainer.model),
        "peak_rss": peak_rss_bytes(),
        "process_rss": before,
        "step_s": time.perf_counter() - start,
    }


def build_memory(task: dict[str, Any]) -> dict[str, Any]:
    """Peak resident memory of building the LM and holding it sharded under FSDP2 over the
    group, before any step: built on the meta device and materialised unit by unit
    (`deferred`, the learner's way), or built whole on every rank and then sharded."""
    from transformers import Qwen2ForCausalLM  # noqa: F401 - its import is not the model's

    from shoal.learner.parallel import ShardingOptions, parallelize, plan_parallelism

    before = peak_rss_bytes()
    policy = build_policy(task["shape"], task["seq"], deferred=task["deferred"])
    plan = plan_parallelism("fsdp", ["bench"] * dist.get_world_size(), 0, 1)
    parallelize(policy, plan, torch.device("cpu"), ShardingOptions())
    return {
        "params": _param_total(policy),
        "peak_rss": peak_rss_bytes(),
        "process_rss": before,
    }


def snapshot_parts(task: dict[str, Any]) -> dict[str, Any]:
    """One version's weight-sync snapshot on each rank of an FSDP2 group, in bf16: the rows this
    rank holds as its part (the learner's way, no gather), against the whole model gathered
    tensor by tensor on every rank (before parts); host bytes and seconds of each build, the
    two alternating `repeats` times, the best time of each kept."""
    from functools import partial

    from shoal.learner.parallel import (
        ShardingOptions,
        full_tensor,
        owned_rows,
        parallelize,
        plan_parallelism,
    )
    from shoal.learner.weight_plan import WeightSyncConfig
    from shoal.learner.weight_sync import WeightSnapshot

    rank, world = dist.get_rank(), dist.get_world_size()
    policy = build_policy(task["shape"], task["seq"], deferred=True)
    parallelize(policy, plan_parallelism("fsdp", ["bench"] * world, 0, 1), torch.device("cpu"),
                ShardingOptions())  # fmt: skip
    params = list(policy.state_dict().items())
    cfg = WeightSyncConfig(wire_dtype="bfloat16")
    ways = {
        "part": lambda: WeightSnapshot.build(
            1, params, partial(owned_rows, part=rank, parts=world), cfg, part=rank, parts=world
        ),
        "whole": lambda: WeightSnapshot.build(1, params, full_tensor, cfg),
    }
    result: dict[str, Any] = {"params": _param_total(policy)}
    for _ in range(task["repeats"]):
        for way, build in ways.items():
            dist.barrier()
            start = time.perf_counter()
            snapshot = build()
            seconds = time.perf_counter() - start
            result[f"{way}_bytes"] = snapshot.nbytes
            result[f"{way}_s"] = min(seconds, result.get(f"{way}_s", seconds))
            del snapshot
    return result


def comm_share(task: dict[str, Any]) -> dict[str, Any]:
    """The share of a step's wall time during which a gloo collective was in flight, from
    torch.profiler's `gloo:*` events (the union of their intervals, so overlapping ones count
    once), over `steps` profiled steps after one warm-up step."""
    from torch.profiler import ProfilerActivity, profile

    trainer = Trainer(task)
    trainer.step()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(task["steps"]):
            trainer.step()
        wall = time.perf_counter() - start
    intervals = sorted(
        (event.time_range.start, event.time_range.end)
        for event in prof.events()
        if event.name.startswith("gloo:")
    )
    busy_us = _union_length(intervals)
    return {
        "params": _param_total(trainer.model),
        "collective_s": busy_us / 1e6,
        "step_s": wall / task["steps"],
        "wall_s": wall,
        "share": busy_us / 1e6 / wall,
    }


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total = 0.0
    end = float("-inf")
    for lo, hi in intervals:
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def wire_buckets(model: nn.Module, dtype: torch.dtype, bucket_bytes: int) -> Iterator[torch.Tensor]:
    """The model's state dict cast to the wire dtype and packed into flat byte buckets of at
    most `bucket_bytes` (a tensor bigger than a bucket spans several), tensor by tensor."""
    pending: list[torch.Tensor] = []
    size = 0
    for tensor in model.state_dict().values():
        data = tensor.detach().to(dtype).reshape(-1).view(torch.uint8)
        offset = 0
        while offset < data.numel():
            part = data[offset : offset + bucket_bytes - size]
            pending.append(part)
            size += part.numel()
            offset += part.numel()
            if size == bucket_bytes:
                yield torch.cat(pending)
                pending, size = [], 0
    if pending:
        yield torch.cat(pending)


def wire_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    return sum(t.numel() for t in model.state_dict().values()) * dtype.itemsize


def baseline_sync(task: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 sends the model's parameters in the wire dtype to rank 1, twice per case: with
    torch.distributed.broadcast over gloo, then over a plain TCP socket on 127.0.0.1 (the
    ceiling). Both times run from the fp32 parameters to the last byte received; the best of
    `repeats` of each."""
    rank = dist.get_rank()
    results = []
    for case in task["cases"]:
        model = build_policy(case["shape"], 64)
        dtype = getattr(torch, case["dtype"])
        total = wire_bytes(model, dtype)
        bucket, repeats = task["bucket_bytes"], range(task["repeats"])
        gloo_s = min(_gloo_broadcast(model, dtype, total, bucket, rank) for _ in repeats)
        tcp_s = min(_tcp_send(model, dtype, total, bucket, rank, case["port"]) for _ in repeats)
        results.append(
            {
                "params": _param_total(model),
                "dtype": case["dtype"],
                "bytes": total,
                "gloo_s": gloo_s,
                "tcp_s": tcp_s,
            }
        )
        del model
    return {"cases": results}


def _gloo_broadcast(
    model: nn.Module, dtype: torch.dtype, total: int, bucket_bytes: int, rank: int
) -> float:
    receive = torch.empty(min(bucket_bytes, total), dtype=torch.uint8)
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        for bucket in wire_buckets(model, dtype, bucket_bytes):
            dist.broadcast(bucket, src=0)
    else:
        left = total
        while left:
            part = receive[: min(left, bucket_bytes)]
            dist.broadcast(part, src=0)
            left -= part.numel()
    dist.barrier()
    return time.perf_counter() - start


def _tcp_send(
    model: nn.Module, dtype: torch.dtype, total: int, bucket_bytes: int, rank: int, port: int
) -> float:
    if rank == 1:
        server = socket.create_server(("127.0.0.1", port))
        dist.barrier()
        conn, _ = server.accept()
        with server, conn:
            buffer = bytearray(min(bucket_bytes, total))
            view = memoryview(buffer)
            left = total
            while left:
                got = conn.recv_into(view[: min(left, len(buffer))])
                if not got:
                    raise RuntimeError("the TCP sender closed early")
                left -= got
            conn.sendall(b"k")
        dist.barrier()
        return 0.0
    dist.barrier()
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        for bucket in wire_buckets(model, dtype, bucket_bytes):
            conn.sendall(bucket.numpy().data)
        conn.recv(1)
    elapsed = time.perf_counter() - start
    dist.barrier()
    return elapsed


def _checksum(model: nn.Module) -> float:
    from shoal.learner.parallel import full_tensor

    return float(sum(full_tensor(p.detach()).double().sum().item() for p in model.parameters()))


TRAINER_STATE = {"version": 1, "bench": "shoal bench learner"}


def dcp_save(task: dict[str, Any]) -> dict[str, Any]:
    """Two ranks under FSDP2, after one step, save model + AdamW state through shoal's
    CheckpointManager (DCP, each rank its shards, then the hashed manifest): blocking, then
    asynchronously (how long the call holds the step, and how long until it is complete)."""
    from shoal.learner.checkpoint import CheckpointManager
    from shoal.learner.train_state import model_optimizer_state

    trainer = Trainer(task)
    trainer.step()
    with CheckpointManager(task["directory"]) as manager:
        dist.barrier()
        start = time.perf_counter()
        manager.save(
            model_optimizer_state(trainer.model, trainer.optimizer), 1, TRAINER_STATE, block=True
        )
        blocking = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        manager.save(model_optimizer_state(trainer.model, trainer.optimizer), 2, TRAINER_STATE)
        held = time.perf_counter() - start
        manager.wait()
        async_total = time.perf_counter() - start
        dist.barrier()
    return {
        "params": _param_total(trainer.model),
        "blocking_s": blocking,
        "async_block_s": held,
        "async_total_s": async_total,
        "checksum": _checksum(trainer.model),
    }


def dcp_load(task: dict[str, Any]) -> dict[str, Any]:
    """One rank resumes from what two ranks saved (the newest checkpoint found and every file
    hashed against its manifest, then DCP resharding 2 -> 1), beside torch.save/torch.load of
    the same state, unsharded, in the same process."""
    from shoal.learner.checkpoint import CheckpointManager
    from shoal.learner.train_state import restore_model_optimizer

    trainer = Trainer(task)
    trainer.step()
    plain = Path(task["directory"]).parent / "plain.pt"
    start = time.perf_counter()
    torch.save(
        {"model": trainer.model.state_dict(), "optim": trainer.optimizer.state_dict()}, plain
    )
    torch_save = time.perf_counter() - start
    start = time.perf_counter()
    loaded = torch.load(plain, weights_only=True)
    trainer.model.load_state_dict(loaded["model"])
    trainer.optimizer.load_state_dict(loaded["optim"])
    torch_load = time.perf_counter() - start
    del loaded
    with CheckpointManager(task["directory"]) as manager:
        start = time.perf_counter()
        info = manager.latest()
        if info is None:
            raise RuntimeError(f"no complete checkpoint in {task['directory']}")
        found = time.perf_counter() - start
        restore_model_optimizer(trainer.model, trainer.optimizer, manager, info)
        resharded = time.perf_counter() - start
    return {
        "torch_save_s": torch_save,
        "torch_load_s": torch_load,
        "verify_s": found,
        "dcp_load_s": resharded,
        "checksum": _checksum(trainer.model),
        "bytes_torch": plain.stat().st_size,
        "bytes_dcp": info.size,
    }


JOBS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "step_memory": step_memory,
    "build_memory": build_memory,
    "snapshot_parts": snapshot_parts,
    "comm_share": comm_share,
    "baseline_sync": baseline_sync,
    "dcp_save": dcp_save,
    "dcp_load": dcp_load,
}


def main() -> None:
    """Entry point: `python -c 'from shoal.bench.learner_child import main; main()' JOB`."""
    task = json.loads(sys.argv[1])
    rank, world = int(os.environ[RANK_ENV]), int(os.environ[WORLD_ENV])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{os.environ[PORT_ENV]}",
            rank=rank,
            world_size=world,
        )
    try:
        result = JOBS[task["job"]](task)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print(json.dumps(result), flush=True)
