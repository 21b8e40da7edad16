"""`shoal down`: stop every process of the local cluster (SIGTERM, then SIGKILL), then remove
its hosts' network (`shoal up --hosts`): namespaces, veths and bridge."""

from __future__ import annotations

import argparse

from shoal.commands.up import add_run_dir


def register(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = verbs.add_parser("down", help="stop the local cluster")
    add_run_dir(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shoal.local import LocalCluster, LocalClusterError, default_run_dir

    local = LocalCluster(args.run_dir or default_run_dir())
    stopped = local.stop_all()
    left = [s.name for s in local.specs() if local.pid(s.name)]
    if left:
        raise LocalClusterError(f"still running after SIGKILL: {left}")
    print(f"shoal: stopped {', '.join(stopped) if stopped else 'nothing (no process was running)'}")
    removed = local.remove_network()
    if removed:
        print(f"shoal: removed the hosts' network ({', '.join(removed)})")
    return 0
