"""A rollout worker process: an ActorSystem on the real transport hosting one or more RolloutActors.

`python -m shoal.learner.rollout_main --run-dir DIR --worker I` reads worker I's actor specs from
DIR/job.json (written by `shoal train`) and the cluster token from DIR/cluster.token, starts the
actors, and runs until SIGTERM/SIGINT (exit 0) or until an actor's collection loop fails (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from shoal.learner.errors import LearnerError
from shoal.learner.learner_main import append_event
from shoal.learner.rollout import RolloutActor, RolloutSpec


def spec_from_json(value: dict[str, Any]) -> RolloutSpec:
    """A RolloutSpec from job.json; a malformed entry is a LearnerError naming the problem."""
    try:
        return RolloutSpec(
            name=str(value["name"]),
            env_id=str(value["env_id"]),
            num_envs=int(value["num_envs"]),
            horizon=int(value["horizon"]),
            seed=int(value["seed"]),
            learner_path=str(value["learner_path"]),
            env_kwargs=dict(value.get("env_kwargs") or {}),
            hidden=tuple(int(h) for h in value.get("hidden", (64, 64))),
            fragments_per_version=float(value.get("fragments_per_version", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise LearnerError(f"malformed rollout spec {value!r} in job.json: {exc}") from exc


async def serve(specs: list[RolloutSpec], token: str, run_dir: Path) -> int:
    """Host the actors until a stop signal (0) or an actor failure (1)."""
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
        config = TransportConfig(token=token, reconnect_max=0.25, connect_timeout=2.0)
        transport = await attach(system, config)
        append_event(
            run_dir,
            {"event": "start", "process": "rollout", "pid": os.getpid(), "actors": len(specs)},
        )
        try:
            for spec in specs:
                await system.spawn(
                    RolloutActor, spec, failed, run_dir / "accounting", name=spec.name
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
    from shoal.runtime.logs import configure_logging
    from shoal.runtime.loop import run

    parser = argparse.ArgumentParser(prog="shoal-rollout", description="one rollout worker")
    parser.add_argument("--run-dir", type=Path, required=True, help="the run directory")
    parser.add_argument("--worker", type=int, required=True, help="this worker's index")
    args = parser.parse_args(argv)
    configure_logging(os.environ.get("SHOAL_LOG_LEVEL", "INFO"))
    try:
        job = json.loads((args.run_dir / "job.json").read_text())
        workers = job["workers"]
        if not 0 <= args.worker < len(workers):
            raise LearnerError(f"--worker {args.worker} is not in job.json (0..{len(workers) - 1})")
        specs = [spec_from_json(s) for s in workers[args.worker]]
        token = (args.run_dir / "cluster.token").read_text().strip()
    except (OSError, KeyError, ValueError, LearnerError) as exc:
        print(f"shoal-rollout: error: {exc}", file=sys.stderr)
        return 2
    return run(serve(specs, token, args.run_dir))


if __name__ == "__main__":
    sys.exit(main())
