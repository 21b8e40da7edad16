"""`shoal bench SUITE [--json]`: run one benchmark suite from bench/ and print its table."""

from __future__ import annotations

import argparse
import importlib

from shoal.errors import ConfigError

# suite name -> module in shoal.bench exposing `run(quick: bool) -> list[Row]`
# (`learner` also takes `params`)
SUITES: dict[str, str] = {
    "chaos": "chaos",
    "envs": "envs",
    "generation": "generation",
    "hosts": "hosts",
    "learning": "learning",
    "learner": "learner",
    "precision": "precision",
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
    parser.add_argument(
        "--params",
        type=parameter_count,
        default=None,
        help="learner suite: the memory row's model size and an extra weight-sync size "
        "(e.g. 1e9 or 1B; default 250M)",
    )
    parser.set_defaults(func=run)


_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}


def parameter_count(text: str) -> int:
    """`1e9`, `1B`, `250M` or `250000000` as a whole number of parameters."""
    scale = _SUFFIX.get(text[-1:].lower(), 1.0)
    digits = text[:-1] if scale != 1.0 else text
    try:
        value = float(digits) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a parameter count: give a number such as 1e9, 1B or 250M"
        ) from None
    if not 1e5 <= value <= 1e12:
        raise argparse.ArgumentTypeError(
            f"{text!r} is out of range: give between 100K and 1000B parameters"
        )
    return int(value)


def run(args: argparse.Namespace) -> int:
    from shoal.bench.report import render_json, render_table
    from shoal.progress import ProgressLine, Ticker, stderr_is_tty

    if args.params is not None and args.suite != "learner":
        raise ConfigError(
            f"--params applies to `shoal bench learner` only, not to {args.suite!r}: drop it"
        )
    module = importlib.import_module(f"shoal.bench.{SUITES[args.suite]}")
    extra = {} if args.params is None else {"params": args.params}
    # a suite reports nothing while it measures: show the elapsed time, only to a person
    progress = ProgressLine(enabled=stderr_is_tty() and not args.json)
    with Ticker(progress, lambda elapsed, _: (f"shoal bench {args.suite}: {elapsed:.0f} s", None)):
        rows = module.run(quick=args.quick, **extra)
    print(render_json(rows) if args.json else render_table(f"shoal bench {args.suite}", rows))
    return 0
