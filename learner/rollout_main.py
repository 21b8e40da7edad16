"""A rollout worker process: an ActorSystem on the real transport hosting one or more RolloutActors.

`python -m shoal.learner.rollout_main --job JSON --worker I [--run-dir DIR]` derives worker I's
actor specs from the job's config (learner/job.py), takes the transport token from
SHOAL_JOB_TOKEN, starts the actors, and runs until SIGTERM/SIGINT (exit 0) or until an actor's
collection loop fails (exit 1). Each actor finds its learner rank's address in the job's
published task state (learner/peers.py), again whenever it registers anew.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shoal.learner.errors import LearnerError
from shoal.learner.events import append_event
from shoal.learner.models.base import PRECISIONS
from shoal.learner.rollout import RolloutActor, RolloutSpec
from shoal.rundir import RunDir


def spec_from_json(value: dict[str, Any]) -> RolloutSpec:
    """A RolloutSpec from job.json; a malformed entry is a LearnerError naming the problem."""
    try:
        return RolloutSpec(
            name=str(value["name"]),
            env_id=str(value["env_id"]),
            num_envs=int(value["num_envs"]),
            horizon=int(value["horizon"]),
            pipeline=_flag(value, "pipeline"),
            precision=_precision(value),
            seed=int(value["seed"]),
            learner_path=str(value.get("learner_path", "")),
            learner_rank=int(value.get("learner_rank", 0)),
            env_kwargs=dict(value.get("env_kwargs") or {}),
            model=dict(value.get("model") or {}),
            weights_timeout_s=float(value.get("weights_timeout_s", 120.0)),
            fragments_per_version=float(value.get("fragments_per_version", 0.0)),
            text=dict(value.get("text") or {}),
            env=dict(value.get("env") or {}),
            token=dict(value.get("token") or {}),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise LearnerError(f"malformed rollout spec {value!r}: {exc}") from exc


def _precision(value: dict[str, Any]) -> str:
    """The spec's sampling dtype (absent: float32); an unknown one is malformed."""
    precision = value.get("precision", "float32")
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def _flag(value: dict[str, Any], key: str) -> bool:
    """A boolean field of the spec (absent: False); anything else is malformed, not False."""
    flag = value.get(key, False)
    if not isinstance(flag, bool):
        raise TypeError(f"{key} must be true or false, got {flag!r}")
    return flag


def locator(spec: RolloutSpec) -> Callable[[], str | None]:
    """Where the actor's learner rank is now: its fixed path, else the address the rank
    last published."""
    from shoal.learner.peers import LEARNER_NAME, learner_address

    def locate() -> str | None:
        if spec.learner_path:
            return spec.learner_path
        address = learner_address(spec.learner_rank)
        return None if address is None else f"{address}/{LEARNER_NAME}"

    return locate


async def serve(specs: list[RolloutSpec], token: str, run_dir: Path) -> int:
    """Host the actors until a stop signal (0) or an actor failure (1)."""
    from shoal.learner.job import listen_host
    from shoal.learner.peers import Publication
    from shoal.runtime.system import ActorSystem
    from shoal.runtime.transport import TransportConfig, attach

    torch.set_num_threads(1)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    failed: asyncio.Future[None] = loop.create_future()
    async with ActorSystem("rollout") as system:
        # Learners may start after us: retry connecting quickly rather than backing off to 2 s.
        # It listens where its host is reached: learners send weights to the actors' paths.
        config = TransportConfig(
            token=token, host=listen_host(), reconnect_max=0.25, connect_timeout=2.0
        )
        transport = await attach(system, config)
        append_event(
            run_dir,
            {"event": "start", "process": "rollout", "pid": os.getpid(), "actors": len(specs)},
        )
        publication = Publication(role="rollout")  # the worker's actors share one record
        try:
            for spec in specs:
                await system.spawn(
                    RolloutActor,
                    spec,
                    failed,
                    RunDir(run_dir).accounting,
                    locator(spec),
                    max_frame_bytes=config.max_frame_bytes,
                    publication=publication,
                    name=spec.name,
                )
            stop: asyncio.Future[Any] = asyncio.ensure_future(stopping.wait())
            waits: list[asyncio.Future[Any]] = [stop, failed]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
        finally:
            await transport.close()
    if failed.done():
        logging.getLogger("shoal.rollout").error("a rollout actor failed: %r", failed.exception())
        return 1
    failed.cancel()
    return 0


def main(argv: list[str] | None = None) -> int:
    from shoal.errors import ShoalError
    from shoal.learner.job import add_task_arguments, read_task, rollout_specs
    from shoal.runtime.logs import configure_logging
    from shoal.runtime.loop import run

    parser = argparse.ArgumentParser(prog="shoal-rollout", description="one rollout worker")
    add_task_arguments(parser)
    parser.add_argument("--worker", type=int, required=True, help="this worker's index")
    args = parser.parse_args(argv)
    configure_logging(os.environ.get("SHOAL_LOG_LEVEL", "INFO"))
    try:
        task = read_task(args)
        workers = task.cfg.rollout.workers
        if not 0 <= args.worker < workers:
            raise LearnerError(f"--worker {args.worker} is not in the job (0..{workers - 1})")
        specs = [spec_from_json(s) for s in rollout_specs(task.cfg, task.env_id, args.worker)]
    except (OSError, ShoalError) as exc:
        print(f"shoal-rollout: error: {exc}", file=sys.stderr)
        return 2
    return run(serve(specs, task.token, task.run_dir))


if __name__ == "__main__":
    sys.exit(main())
