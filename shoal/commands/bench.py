"""`shoal bench SUITE [--json]`: run one benchmark suite from bench/ and print its table."""

from __future__ import annotations

import argparse
import importlib

# suite name -> module in shoal.bench exposing `run(quick: bool) -> list[Row]`
SUITES: dict[str, str] = {
    "chaos": "chaos",
    "envs": "envs",
    "hosts": "hosts",
    "raft": "raft",
    "runtime": "runtime",
    "sandbox": "sandbox",
    "scheduler": "scheduler",
    "schedloop": "schedloop",
    "train": "train",
}


def register(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = verbs.add_parser(
        "bench", help="measure shoal beside a baseline run in the same process"
    )
    parser.add_argument("suite", choices=sorted(SUITES), help="which benchmark suite to run")
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows instead")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (for smoke tests)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shoal.bench.report import render_json, render_table
    from shoal.progress import ProgressLine, Ticker, stderr_is_tty

    module = importlib.import_module(f"shoal.bench.{SUITES[args.suite]}")
    # a suite reports nothing while it measures: show the elapsed time, only to a person
    progress = ProgressLine(enabled=stderr_is_tty() and not args.json)
    with Ticker(progress, lambda elapsed, _: (f"shoal bench {args.suite}: {elapsed:.0f} s", None)):
        rows = module.run(quick=args.quick)
    print(render_json(rows) if args.json else render_table(f"shoal bench {args.suite}", rows))
    return 0
