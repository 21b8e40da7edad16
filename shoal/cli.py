"""The `shoal` command line: one vocabulary of verbs, each in its own module under commands/.

A user's mistake ends in one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import errno
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
    "export",
    "chaos",
    "completion",
    "console",
    "tls",
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


# File-system errors a user causes with a path they gave (a read-only or full --data-dir or
# --run-dir, a missing parent), each with what to do about it. Other OSErrors are bugs and
# keep their traceback.
_PATH_FIXES: dict[int, str] = {
    errno.EACCES: "choose a path this user may write, or fix its permissions",
    errno.EPERM: "choose a path this user may write, or fix its permissions",
    errno.EROFS: "choose a directory on a writable file system",
    errno.ENOSPC: "free space there, or choose a directory on a larger disk",
    errno.EDQUOT: "free space in your quota, or choose a directory on another disk",
    errno.EFBIG: "the file size limit (ulimit -f) was hit; raise it",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a directory; check the path",
    errno.EISDIR: "the path is a directory where a file belongs; check the path",
    errno.EEXIST: "something is already there; remove it or choose another path",
    errno.ENAMETOOLONG: "choose a shorter path",
    errno.ELOOP: "the path has a symbolic-link loop; check the path",
}


def path_error(exc: OSError) -> str | None:
    """The one line for a file-system error on a user's path, or None when it is not one."""
    fix = _PATH_FIXES.get(exc.errno or 0)
    if fix is None or exc.filename is None:
        return None
    return f"{exc.filename}: {exc.strerror}; {fix}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int | None = args.func(args)
    except ShoalError as exc:
        print(f"shoal: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        line = path_error(exc)
        if line is None:
            raise
        print(f"shoal: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shoal: interrupted", file=sys.stderr)
        return 130
    return result or 0


if __name__ == "__main__":
    sys.exit(main())
