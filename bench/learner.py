"""`shoal bench learner`: what the learner costs as the policy grows, beside torch's own
baselines measured in the same run.

Five figures, each in real child processes (bench/learner_child.py) on 127.0.0.1:
peak resident memory per rank of one forward/backward/AdamW step of a Qwen2-style causal LM,
2 gloo ranks under FSDP2 against 1 rank unsharded; peak resident memory per rank of building
that LM sharded over 4 ranks, on the meta device unit by unit (the learner's way) against
built whole and then sharded; weight sync time and MB/s through shoal's
bucketed snapshot over the actor runtime against a torch.distributed broadcast over gloo and a
plain TCP socket carrying the same bytes; the share of a 2-rank FSDP2 step spent in
collectives against the seed's 15 % bound; sharded checkpoint save (blocking and async) and a
load resharded from 2 ranks to 1 against torch.save/torch.load of the same state. `quick`
shrinks every model to a few million parameters, for smoke tests of the table's shape.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shoal.bench.learner_child import PORT_ENV, RANK_ENV, WORLD_ENV, lm_shape
from shoal.bench.report import Row
from shoal.errors import ShoalError
from shoal.ports import free_port

MIB = 1024 * 1024
MB = 1e6
SEED_COMM_BOUND = 15.0
CHILD = "from shoal.bench.learner_child import main; main()"
BUCKET_MIB = 256.0
"""weight_sync.bucket_mb's default; the baselines send buckets of the same size."""


@dataclass(frozen=True)
class Sizes:
    """Parameter counts and batch shape of each figure."""

    memory_params: int
    sync_params: tuple[int, ...]
    comm_params: int
    checkpoint_params: int
    batch: int
    seq: int
    comm_steps: int
    sync_repeats: int


FULL = Sizes(
    memory_params=250_000_000,
    sync_params=(10_000_000, 100_000_000),
    comm_params=25_000_000,
    checkpoint_params=50_000_000,
    batch=4,
    seq=256,
    comm_steps=3,
    sync_repeats=3,
)
QUICK = Sizes(
    memory_params=2_000_000,
    sync_params=(1_000_000,),
    comm_params=1_000_000,
    checkpoint_params=1_000_000,
    batch=2,
    seq=32,
    comm_steps=1,
    sync_repeats=1,
)


def sizes_for(quick: bool, params: int | None) -> Sizes:
    """The suite's sizes; `params` sets the memory row's model and adds a weight-sync size."""
    sizes = QUICK if quick else FULL
    if params is None:
        return sizes
    if params < 100_000:
        raise ShoalError(f"--params {params} is too small: give at least 100000 (e.g. 1e9)")
    sync = sizes.sync_params if params in sizes.sync_params else (*sizes.sync_params, params)
    return replace(sizes, memory_params=params, sync_params=sync)


# -- child processes ------------------------------------------------------------------------


def run_group(world: int, task: dict[str, Any]) -> list[dict[str, Any]]:
    """Run `task` on `world` gloo ranks in child processes; every rank's JSON result."""
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(world)]
        try:
            for rank, log in enumerate(logs):
                env = dict(os.environ, **{RANK_ENV: str(rank), WORLD_ENV: str(world)})
                env[PORT_ENV] = str(port)
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", CHILD, json.dumps(task)],
                        stdout=subprocess.PIPE,
                        stderr=log,
                        text=True,
                        env=env,
                    )
                )
            _wait_all_or_first_failure(procs)
            outputs = [proc.communicate()[0] for proc in procs]
            return [_result(task, p, out, log) for p, out, log in zip(procs, outputs, logs)]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def _wait_all_or_first_failure(procs: list[subprocess.Popen[str]]) -> None:
    """Wait for every rank; once one fails, stop the rest (they would wait in a collective
    for the gloo time-out, half an hour)."""
    while any(proc.poll() is None for proc in procs):
        if any(proc.poll() not in (None, 0) for proc in procs):
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            return
        time.sleep(0.1)


def _result(task: dict[str, Any], proc: subprocess.Popen[str], out: str, log: Any) -> Any:
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        log.seek(0)
        tail = log.read()[-2000:].decode(errors="replace")
        raise ShoalError(
            f"the benchmark's {task['job']} process exited with status {proc.returncode}; "
            f"its last output:\n{tail}"
        )
    return json.loads(lines[-1])


def _task(job: str, sizes: Sizes, params: int, **extra: Any) -> dict[str, Any]:
    return {
        "job": job,
        "shape": lm_shape(params),
        "batch": sizes.batch,
        "seq": sizes.seq,
        "steps": sizes.comm_steps,
        **extra,
    }


def _millions(params: int) -> str:
    return f"{params / 1e6:,.0f}M" if params >= 1e6 else f"{params / 1e6:.2g}M"


# -- rows -----------------------------------------------------------------------------------


def memory_rows(sizes: Sizes) -> list[Row]:
    task = _task("step_memory", sizes, sizes.memory_params)
    single = run_group(1, task)[0]
    sharded = run_group(2, task)
    name = f"peak RSS per rank, {_millions(single['params'])}-param LM step (fwd/bwd/AdamW)"
    return [
        Row(
            f"{name}, 2 ranks FSDP2",
            "MiB",
            max(r["peak_rss"] for r in sharded) / MIB,
            single["peak_rss"] / MIB,
            "1 rank unsharded",
            higher_is_better=False,
        ),
        Row(
            f"{name} above the process's own, 2 ranks FSDP2",
            "MiB",
            max(r["peak_rss"] - r["process_rss"] for r in sharded) / MIB,
            (single["peak_rss"] - single["process_rss"]) / MIB,
            "1 rank unsharded",
            higher_is_better=False,
        ),
    ]


BUILD_RANKS = 4
"""Ranks of the build row: enough that a rank's shard is well under the whole model."""


def build_rows(sizes: Sizes) -> list[Row]:
    """Building the memory row's LM sharded over BUILD_RANKS ranks, before any step: on the
    meta device unit by unit (the learner's way) against built whole, then sharded."""
    deferred = run_group(
        BUILD_RANKS, _task("build_memory", sizes, sizes.memory_params, deferred=True)
    )
    eager = run_group(
        BUILD_RANKS, _task("build_memory", sizes, sizes.memory_params, deferred=False)
    )
    name = (
        f"peak RSS per rank, building a {_millions(deferred[0]['params'])}-param LM sharded "
        f"over {BUILD_RANKS} ranks (FSDP2), deferred"
    )
    baseline = "built whole, then sharded"
    return [
        Row(
            name,
            "MiB",
            max(r["peak_rss"] for r in deferred) / MIB,
            max(r["peak_rss"] for r in eager) / MIB,
            baseline,
            higher_is_better=False,
        ),
        Row(
            f"{name}, above the process's own",
            "MiB",
            max(r["peak_rss"] - r["process_rss"] for r in deferred) / MIB,
            max(r["peak_rss"] - r["process_rss"] for r in eager) / MIB,
            baseline,
            higher_is_better=False,
        ),
    ]


def snapshot_rows(sizes: Sizes) -> list[Row]:
    """One version's weight-sync snapshot on each of BUILD_RANKS FSDP2 ranks, in bf16: each
    rank's part (the rows it holds) against the whole model gathered on every rank."""
    ranks = run_group(
        BUILD_RANKS,
        _task("snapshot_parts", sizes, sizes.memory_params, repeats=sizes.sync_repeats),
    )
    name = (
        f"weight-sync snapshot of a {_millions(ranks[0]['params'])}-param LM (bf16) on each of "
        f"{BUILD_RANKS} FSDP2 ranks, its own part"
    )
    baseline = "whole model, gathered on every rank"
    return [
        Row(
            f"{name}: host memory per rank",
            "MiB",
            max(r["part_bytes"] for r in ranks) / MIB,
            max(r["whole_bytes"] for r in ranks) / MIB,
            baseline,
            higher_is_better=False,
        ),
        Row(
            f"{name}: build time per version",
            "s",
            max(r["part_s"] for r in ranks),
            max(r["whole_s"] for r in ranks),
            baseline,
            higher_is_better=False,
        ),
    ]


def comm_rows(sizes: Sizes) -> list[Row]:
    ranks = run_group(2, _task("comm_share", sizes, sizes.comm_params))
    share = max(r["share"] for r in ranks) * 100
    return [
        Row(
            f"collective share of a step, {_millions(ranks[0]['params'])}-param LM, "
            f"2 ranks FSDP2 (gloo), {sizes.batch}x{sizes.seq} tokens",
            "%",
            share,
            SEED_COMM_BOUND,
            "the seed's bound",
            higher_is_better=False,
        )
    ]


def checkpoint_rows(sizes: Sizes, root: Path) -> list[Row]:
    directory = root / "checkpoints"
    directory.mkdir()
    task = _task("dcp_save", sizes, sizes.checkpoint_params, directory=str(directory))
    saved = run_group(2, task)
    loaded = run_group(1, {**task, "job": "dcp_load"})[0]
    if abs(loaded["checksum"] - saved[0]["checksum"]) > 1e-6 * max(1.0, abs(loaded["checksum"])):
        raise ShoalError(
            "the checkpoint loaded at 1 rank does not hold the weights 2 ranks saved "
            f"(checksums {loaded['checksum']} and {saved[0]['checksum']})"
        )
    what = f"{_millions(saved[0]['params'])} params + AdamW"
    return [
        Row(
            f"checkpoint save, blocking, {what}, 2 ranks (DCP + hashed manifest)",
            "s",
            max(r["blocking_s"] for r in saved),
            loaded["torch_save_s"],
            "torch.save, 1 rank",
            higher_is_better=False,
        ),
        Row(
            f"checkpoint save, async: time the step is held, {what}, 2 ranks (DCP)",
            "s",
            max(r["async_block_s"] for r in saved),
            loaded["torch_save_s"],
            "torch.save, 1 rank",
            higher_is_better=False,
        ),
        Row(
            f"checkpoint load resharded 2 -> 1 rank, {what} (files hashed, then DCP)",
            "s",
            loaded["dcp_load_s"],
            loaded["torch_load_s"],
            "torch.load, 1 rank",
            higher_is_better=False,
        ),
    ]


def sync_rows(sizes: Sizes) -> list[Row]:
    from shoal.bench import learner_sync
    from shoal.learner.weight_plan import WeightSyncConfig

    bucket_bytes = WeightSyncConfig(bucket_mb=BUCKET_MIB).bucket_bytes()
    cases = [
        {"shape": lm_shape(params), "dtype": dtype, "port": free_port()}
        for params in sizes.sync_params
        for dtype in ("float32", "bfloat16")
    ]
    task = {
        "job": "baseline_sync",
        "cases": cases,
        "bucket_bytes": bucket_bytes,
        "repeats": sizes.sync_repeats,
    }
    baselines = run_group(2, task)[0]["cases"]
    ours = learner_sync.measure(cases, BUCKET_MIB, sizes.sync_repeats)
    rows = []
    for case, base in zip(ours, baselines):
        if case["bytes"] != base["bytes"]:
            raise ShoalError(
                f"shoal sent {case['bytes']} bytes, the baselines {base['bytes']}: not the same "
                "weights"
            )
        label = f"weight sync {_millions(case['params'])} params, {_wire_name(base['dtype'])}"
        rows.append(
            Row(
                f"{label}: time",
                "s",
                case["seconds"],
                base["gloo_s"],
                "torch.distributed broadcast (gloo)",
                higher_is_better=False,
            )
        )
        rows.append(
            Row(
                f"{label}: throughput",
                "MB/s",
                case["bytes"] / MB / case["seconds"],
                base["bytes"] / MB / base["tcp_s"],
                "raw TCP, same bytes",
                higher_is_better=True,
            )
        )
    return rows


def _wire_name(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16"}[dtype]


def run(quick: bool, params: int | None = None) -> list[Row]:
    """All rows of the suite, in one run."""
    sizes = sizes_for(quick, params)
    root = Path(tempfile.mkdtemp(prefix="shoal-bench-learner-"))
    try:
        rows = memory_rows(sizes)
        rows.extend(build_rows(sizes))
        rows.extend(snapshot_rows(sizes))
        rows.extend(sync_rows(sizes))
        rows.extend(comm_rows(sizes))
        rows.extend(checkpoint_rows(sizes, root))
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)
