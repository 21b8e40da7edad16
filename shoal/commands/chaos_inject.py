"""`shoal chaos inject`: one fault on a running cluster."""

from __future__ import annotations

import argparse
import time
from typing import Any

from shoal.commands.up import add_run_dir


def add_inject(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    inject = sub.add_parser("inject", help="one fault on a running local cluster (shoal up)")
    inject.add_argument("kind", choices=["kill", "pause"], help="SIGKILL or SIGSTOP")
    inject.add_argument("target", help="leader, follower or a process name (c1, c2, ...)")
    inject.add_argument(
        "--duration",
        type=float,
        default=None,
        help="heal after this many seconds (restart / SIGCONT); kill without it stays down",
    )
    add_run_dir(inject)
    inject.set_defaults(func=_inject)


def _inject(args: argparse.Namespace) -> int:
    from shoal.chaos.faults import Fault, KillProcess, PauseProcess
    from shoal.errors import ConfigError
    from shoal.local import LocalCluster, default_run_dir

    if args.duration is not None and not 0 <= args.duration <= 3600:
        raise ConfigError(f"--duration={args.duration} must be in 0..3600 seconds")
    if args.kind == "pause" and args.duration is None:
        raise ConfigError("pause needs --duration (a paused process would stay stopped)")
    cluster = LocalCluster(args.run_dir or default_run_dir())
    name = _target(cluster, args.target)
    fault: Fault = (
        KillProcess(cluster, name) if args.kind == "kill" else PauseProcess(cluster, name)
    )
    started = time.monotonic()
    print(f"shoal chaos: {fault.inject()}")
    if args.duration is None:
        return 0
    time.sleep(args.duration)
    print(f"shoal chaos: {fault.heal()}")
    leader = cluster.wait_ready(timeout=60.0)
    print(f"shoal chaos: leader {leader} after {time.monotonic() - started:.2f} s")
    return 0


def _target(cluster: Any, target: str) -> str:
    from shoal.chaos.errors import FaultError

    if target not in ("leader", "follower"):
        return str(cluster.spec(target).name)
    leader_api = cluster.wait_ready(timeout=10.0)
    names = [s.name for s in cluster.specs() if cluster.pid(s.name)]
    leader = next(s.name for s in cluster.specs() if s.api_url == leader_api)
    if target == "leader":
        return leader
    followers = [n for n in names if n != leader]
    if not followers:
        raise FaultError("no running follower to fault")
    return followers[0]
