"""`shoal console [--run-dir DIR | --coordinators URLS --token-file F]`: an async Python REPL
connected to the cluster (see shoal/console.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from shoal.commands.up import add_run_dir


def register(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = verbs.add_parser(
        "console", help="a Python REPL (ptpython, top-level await) connected to the cluster"
    )
    add_run_dir(parser)
    parser.add_argument(
        "--coordinators",
        metavar="URL[,URL...]",
        help="API URLs of the replicas (instead of the local run directory)",
    )
    parser.add_argument(
        "--token-file", type=Path, help="API bearer token (default: $SHOAL_API_TOKEN)"
    )
    parser.add_argument(
        "--history",
        type=Path,
        default=Path.home() / ".shoal" / "console_history",
        help="where typed lines are kept (default: ~/.shoal/console_history)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from shoal.console import ConsoleError, connect_local, connect_remote, run_console
    from shoal.local import default_run_dir

    if args.coordinators is not None:
        if args.run_dir is not None:
            raise ConsoleError("pass either --run-dir or --coordinators, not both")
        conn = connect_remote(args.coordinators, args.token_file)
    else:
        if args.token_file is not None:
            raise ConsoleError("--token-file goes with --coordinators (a run dir has its own)")
        conn = connect_local(args.run_dir or default_run_dir())
    history: Path | None = args.history
    if history is not None:
        try:
            history.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            history = None  # a read-only home still gets a console, without history
    asyncio.run(run_console(conn, history))
    return 0
