"""`shoal logs [PROCESS]`: the tail of one process's log, or of every process's."""

from __future__ import annotations

import argparse
import json

from shoal.commands.up import add_run_dir
from shoal.errors import ConfigError


def register(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = verbs.add_parser("logs", help="show the local cluster's logs")
    parser.add_argument("process", nargs="?", help="one process (e.g. c1); default: all")
    parser.add_argument(
        "-n", "--lines", type=int, default=50, help="lines from the end of each log"
    )
    parser.add_argument(
        "--json", action="store_true", help="print [{process, path, lines}] as JSON instead"
    )
    add_run_dir(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shoal.local import LocalCluster, default_run_dir

    if args.lines < 1:
        raise ConfigError(f"--lines={args.lines} is invalid: use a number of lines >= 1")
    local = LocalCluster(args.run_dir or default_run_dir())
    names = [args.process] if args.process else [s.name for s in local.specs()]
    tails = []
    for name in names:
        local.spec(name)
        tails.append((name, local.log_path(name), local.tail(name, args.lines)))
    if args.json:
        rows = [{"process": n, "path": str(p), "lines": t.splitlines()} for n, p, t in tails]
        print(json.dumps(rows))
        return 0
    for _, path, text in tails:
        print(f"==> {path} <==")
        print(text)
    return 0
