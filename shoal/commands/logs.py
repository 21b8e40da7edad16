"""`shoal logs [PROCESS]`: the tail of one process's log, or of every process's."""

from __future__ import annotations

import argparse

from shoal.commands.up import add_run_dir


def register(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = verbs.add_parser("logs", help="show the local cluster's logs")
    parser.add_argument("process", nargs="?", help="one process (e.g. c1); default: all")
    parser.add_argument(
        "-n", "--lines", type=int, default=50, help="lines from the end of each log"
    )
    add_run_dir(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shoal.local import LocalCluster, default_run_dir

    local = LocalCluster(args.run_dir or default_run_dir())
    names = [args.process] if args.process else [s.name for s in local.specs()]
    for name in names:
        local.spec(name)
        print(f"==> {local.log_path(name)} <==")
        print(local.tail(name, args.lines))
    return 0
