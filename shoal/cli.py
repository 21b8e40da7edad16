"""The `shoal` command line: one vocabulary of verbs, each in its own module under commands/.

A user's mistake ends in one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from shoal.errors import ShoalError
from shoal.version import __version__

# Each module in shoal.commands registers one verb; heavy imports happen inside the verb.
_COMMAND_MODULES: tuple[str, ...] = (
    "bench",
    "coordinator",
    "envs",
    "up",
    "status",
    "down",
    "logs",
    "node",
    "train",
    "eval",
    "chaos",
    "completion",
    "console",
)


class _Parser(argparse.ArgumentParser):
    """A usage mistake ends in one line that names the fix, like every other user error;
    sub-commands inherit this class through `add_subparsers`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shoal",
        description="Asynchronous reinforcement-learning training on a cluster.",
    )
    parser.add_argument("--version", action="version", version=f"shoal {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True
    for name in _COMMAND_MODULES:
        module = importlib.import_module(f"shoal.commands.{name}")
        module.register(verbs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int | None = args.func(args)
    except ShoalError as exc:
        print(f"shoal: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shoal: interrupted", file=sys.stderr)
        return 130
    return result or 0


if __name__ == "__main__":
    sys.exit(main())
