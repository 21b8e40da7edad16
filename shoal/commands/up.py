"""`shoal up`: start a local cluster of coordinator replicas in the background."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_run_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="the local cluster's directory (default: $SHOAL_RUN_DIR or ~/.shoal/run)",
    )


def register(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = verbs.add_parser("up", help="start a local cluster in the background")
    parser.add_argument(
        "--replicas", type=int, default=3, help="coordinator replicas (odd: 1, 3, 5)"
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a leader")
    add_run_dir(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shoal.errors import ConfigError
    from shoal.local import LocalCluster, LocalClusterError, coordinator_specs, default_run_dir

    if args.replicas < 1 or args.replicas % 2 == 0 or args.replicas > 9:
        raise ConfigError(
            f"--replicas={args.replicas} must be odd, between 1 and 9 (a majority must survive)"
        )
    local = LocalCluster(args.run_dir or default_run_dir())
    if (local.run_dir / "cluster.json").exists():  # bring the same cluster back, data and all
        specs = local.specs()
        if sum(s.kind == "coordinator" for s in specs) != args.replicas:
            raise ConfigError(
                f"--replicas={args.replicas} differs from the cluster in {local.run_dir}; "
                "use another --run-dir or delete that one"
            )
    else:
        specs = coordinator_specs(local.run_dir, args.replicas)
    local.create(specs)
    try:
        local.start_all()
        leader = local.wait_ready(timeout=args.timeout)
    except LocalClusterError:
        local.stop_all()
        raise
    print(f"shoal: local cluster up in {local.run_dir}")
    for spec in local.specs():
        print(f"  {spec.name}  pid {local.pid(spec.name)}  api {spec.api_url}  raft {spec.raft}")
    print(f"  leader {leader}; API token in {local.run_dir / 'api-token'}")
    return 0
