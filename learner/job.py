"""What a training job's tasks are told, and how they read it.

Every task of a job gets the same `--job` argument: the environment and the resolved
`TrainConfig`, as JSON, plus (for a run whose directory every rank shares) `--run-dir`. It is
part of the task record in the coordinators' Raft log, so a node on any host can start the task
with nothing but that record: no job.json to read from the submitter's disk. The transport
token comes in the environment (`SHOAL_JOB_TOKEN`), never on a command line. A rollout worker
derives its actors from the config (`rollout_specs`) and finds its learner rank's address in
the job's published task state (learner/peers.py), so no port is chosen before the tasks run.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shoal import boundedjson
from shoal.learner.config import TrainConfig
from shoal.learner.errors import LearnerError
from shoal.rundir import RunDir

MAX_JOB_BYTES = 256 << 10
TOKEN_VARIABLE = "SHOAL_JOB_TOKEN"


@dataclass(frozen=True)
class TaskContext:
    """What one task of a training job runs with."""

    env_id: str
    cfg: TrainConfig
    run_dir: Path
    """Where the task writes its status, ledger and events: the shared run directory when the
    job has one, else the job's directory on this node (SHOAL_JOB_DIR)."""
    token: str
    coordinator: dict[str, Any] | None = None
    """Where rank 0 posts its metrics (urls, token_file, job), for a run on one host."""


def job_argument(
    cfg: TrainConfig, env_id: str, coordinator: dict[str, Any] | None = None
) -> list[str]:
    """The `--job JSON` arguments every task of the job gets."""
    import json

    job: dict[str, Any] = {"env_id": env_id, "config": asdict(cfg)}
    if coordinator is not None:
        job["coordinator"] = coordinator
    return ["--job", json.dumps(job, separators=(",", ":"))]


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", required=True, help="the job as JSON (env_id, config)")
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="the run directory every rank shares (default: this node's job directory)",
    )


def read_task(args: argparse.Namespace, environ: dict[str, str] | None = None) -> TaskContext:
    """The task's context from its arguments and environment; a LearnerError (or the config's
    ConfigError) names what is wrong."""
    from shoal.config import load

    env = dict(os.environ if environ is None else environ)
    try:
        job = boundedjson.loads(args.job.encode(), max_bytes=MAX_JOB_BYTES, max_depth=16)
    except boundedjson.JsonRefused as exc:
        raise LearnerError(f"--job is not a job: {exc}") from None
    if not isinstance(job, dict) or not isinstance(job.get("env_id"), str):
        raise LearnerError("--job must be an object with env_id and config")
    cfg = load(TrainConfig, job.get("config") or {}, source="--job", environ={})
    run_dir = args.run_dir or (Path(env["SHOAL_JOB_DIR"]) if env.get("SHOAL_JOB_DIR") else None)
    if run_dir is None:
        raise LearnerError("give --run-dir, or start the task through a node daemon")
    token = env.get(TOKEN_VARIABLE, "").strip()
    if not token:
        raise LearnerError(f"{TOKEN_VARIABLE} is not set: the job's transport token comes there")
    coordinator = job.get("coordinator")
    run_dir.mkdir(parents=True, exist_ok=True)
    return TaskContext(
        job["env_id"],
        cfg,
        run_dir,
        token,
        coordinator if isinstance(coordinator, dict) else None,
    )


def checkpoint_dir(cfg: TrainConfig, run_dir: Path) -> Path:
    """The job's checkpoint storage (a path every host mounts), else the run dir's own."""
    return Path(cfg.checkpoint.storage) if cfg.checkpoint.storage else RunDir(run_dir).checkpoints


def listen_host(environ: dict[str, str] | None = None) -> str:
    """Where a task listens: the address its node is reached at (SHOAL_NODE_HOST), else
    loopback for a task started by hand."""
    return (os.environ if environ is None else environ).get("SHOAL_NODE_HOST") or "127.0.0.1"


def pace_share(cfg: TrainConfig) -> float:
    """Each actor's share of the fragments its rank trains on per version (0: unpaced)."""
    if not cfg.rollout.pace:
        return 0.0
    return cfg.intake.fragments_per_update * cfg.learner.ranks / cfg.total_actors


def actor_ranks(cfg: TrainConfig) -> dict[str, int]:
    """Which learner rank each rollout actor (`rollout-<worker>-<actor>`) feeds."""
    from shoal.learner.group import assign

    names = [
        f"rollout-{w}-{a}"
        for w in range(cfg.rollout.workers)
        for a in range(cfg.rollout.actors_per_worker)
    ]
    return {n: r for r, share in enumerate(assign(names, cfg.learner.ranks)) for n in share}


def rollout_specs(cfg: TrainConfig, env_id: str, worker: int) -> list[dict[str, Any]]:
    """The actor specs of rollout worker `worker` (each naming the learner rank it feeds)."""
    ranks = actor_ranks(cfg)
    specs = []
    for a in range(cfg.rollout.actors_per_worker):
        name = f"rollout-{worker}-{a}"
        specs.append(
            {
                "name": name,
                "env_id": env_id,
                "env_kwargs": cfg.env_kwargs,
                "env": asdict(cfg.env),
                "num_envs": cfg.rollout.num_envs,
                "horizon": cfg.rollout.horizon,
                "pipeline": cfg.rollout.pipeline,
                "precision": cfg.rollout.precision,
                "seed": cfg.seed + 1000 * (worker * cfg.rollout.actors_per_worker + a + 1),
                "learner_rank": ranks[name],
                "model": asdict(cfg.model),
                # A version's transfer may take its deadline; an actor waits twice that for
                # its first before it registers again.
                "weights_timeout_s": 2 * cfg.weight_sync.deadline_s,
                "fragments_per_version": pace_share(cfg),
                "text": asdict(cfg.text),
                "token": asdict(cfg.token),
            }
        )
    return specs
