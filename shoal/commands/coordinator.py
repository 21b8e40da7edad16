"""`shoal coordinator`: run one Raft replica of the control plane with its admin API."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from shoal.errors import ConfigError


def register(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = verbs.add_parser("coordinator", help="run one coordinator replica (Raft + admin API)")
    parser.add_argument("--id", required=True, help="this replica's id, e.g. c1")
    parser.add_argument(
        "--raft", required=True, metavar="HOST:PORT", help="this replica's Raft address"
    )
    parser.add_argument(
        "--raft-bind",
        metavar="HOST:PORT",
        help="where Raft listens, when peers reach it through --raft (e.g. a proxy); default --raft",
    )
    parser.add_argument(
        "--peers", default="", metavar="HOST:PORT,...", help="the other replicas' Raft addresses"
    )
    parser.add_argument(
        "--api", required=True, metavar="HOST:PORT", help="where the admin HTTP API listens"
    )
    parser.add_argument(
        "--data-dir", required=True, type=Path, help="Raft journal and dump files go here"
    )
    parser.add_argument(
        "--secret-file", type=Path, help="cluster secret (Raft encryption); needed off loopback"
    )
    parser.add_argument(
        "--token-file", type=Path, help="API bearer token (default: $SHOAL_API_TOKEN)"
    )
    parser.add_argument("--min-election-timeout", type=float, default=0.2, help="seconds")
    parser.add_argument("--max-election-timeout", type=float, default=0.35, help="seconds")
    parser.add_argument(
        "--append-period", type=float, default=0.05, help="leader heartbeat, seconds"
    )
    parser.add_argument(
        "--suspect-after", type=float, default=3.0, help="seconds without heartbeat"
    )
    parser.add_argument("--dead-after", type=float, default=10.0, help="seconds without heartbeat")
    parser.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    parser.set_defaults(func=run)


def read_secret_file(path: Path, what: str) -> str:
    """A secret from a file that only its owner may read; refuses group/world-readable files."""
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} file {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise ConfigError(f"the {what} file {path} is readable by others; run: chmod 600 {path}")
    if not text:
        raise ConfigError(f"the {what} file {path} is empty")
    return text


def run(args: argparse.Namespace) -> int:
    import logging

    from shoal.raft.config import CoordinatorConfig, LivenessConfig, RaftTimings
    from shoal.raft.coordinator import serve_until_signalled
    from shoal.runtime import loop

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    token = (
        read_secret_file(args.token_file, "API token")
        if args.token_file
        else os.environ.get("SHOAL_API_TOKEN", "")
    )
    config = CoordinatorConfig(
        replica_id=args.id,
        raft=args.raft,
        raft_bind=args.raft_bind,
        peers=tuple(p for p in args.peers.split(",") if p),
        api=args.api,
        data_dir=args.data_dir,
        secret=read_secret_file(args.secret_file, "cluster secret") if args.secret_file else None,
        token=token,
        timings=RaftTimings(
            append_period=args.append_period,
            min_timeout=args.min_election_timeout,
            max_timeout=args.max_election_timeout,
            connection_timeout=max(1.0, args.max_election_timeout),
        ),
        liveness=LivenessConfig(suspect_after=args.suspect_after, dead_after=args.dead_after),
    )
    loop.run(serve_until_signalled(config))
    return 0
