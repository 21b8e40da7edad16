"""`shoal tls init DIR [--name ADDR ...]`: a certificate authority and one certificate for a
cluster's processes, for `$SHOAL_TLS_DIR` (docs/security.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from shoal.errors import ConfigError


def register(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = verbs.add_parser("tls", help="make TLS certificates for a cluster")
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    init = actions.add_parser("init", help="write ca.pem, cert.pem and key.pem into DIR")
    init.add_argument("directory", type=Path, metavar="DIR")
    init.add_argument(
        "--name",
        action="append",
        default=None,
        metavar="ADDR",
        help="an address or host name every process is reached by (repeat; default: loopback)",
    )
    init.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shoal.runtime.local_ca import LOCAL_NAMES, make_local_ca
    from shoal.runtime.tls import CA_FILE, TLS_DIR_ENV

    directory: Path = args.directory
    if (directory / CA_FILE).exists():
        raise ConfigError(
            f"{directory} already holds a {CA_FILE}; choose an empty directory (a new CA would "
            "not be trusted by processes that use the old one)"
        )
    names = tuple(args.name) if args.name else LOCAL_NAMES
    make_local_ca(directory, names)
    print(f"wrote {directory}: a new CA and one certificate for {', '.join(names)}")
    print(f"start every process with {TLS_DIR_ENV}={directory.resolve()}")
    return 0
