"""`shoal coordinator`: run one Raft replica of the control plane with its admin API."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from shoal.errors import ConfigError

if TYPE_CHECKING:
    from shoal.raft.config import CoordinatorSettings


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
        "--secret-file",
        type=Path,
        help="cluster secret (encrypts and authenticates Raft), required; the same file on "
        "every replica",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        help="operator token: every admin API route (default: $SHOAL_API_TOKEN)",
    )
    parser.add_argument(
        "--node-token-file",
        type=Path,
        help="node credential: node daemons' routes (register, heartbeat, task state, "
        "checkpoints, events) and reads, never job submission",
    )
    parser.add_argument(
        "--read-token-file", type=Path, help="read-only token: every GET (dashboards, scrapers)"
    )
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE.toml",
        help="scheduler, balancer, liveness, raft and chaos settings (docs/operations.md); "
        "the flags below override it",
    )
    parser.add_argument("--min-election-timeout", type=float, help="seconds (default 0.2)")
    parser.add_argument("--max-election-timeout", type=float, help="seconds (default 0.35)")
    parser.add_argument("--append-period", type=float, help="leader heartbeat, seconds (0.05)")
    parser.add_argument("--suspect-after", type=float, help="seconds without heartbeat (3)")
    parser.add_argument("--dead-after", type=float, help="seconds without heartbeat (10)")
    parser.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    parser.set_defaults(func=run)


def _optional_secret(path: Path | None, what: str) -> str | None:
    return read_secret_file(path, what) if path is not None else None


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


def load_settings(path: Path | None) -> CoordinatorSettings:
    """The settings in `path` (every key optional), or the defaults when there is no file.

    Environment variables are deliberately not consulted: every replica of a cluster must run
    the same settings, and a file passed to all of them is the one thing they can share."""
    from shoal.config import load_toml
    from shoal.raft.config import CoordinatorSettings

    if path is None:
        return CoordinatorSettings()
    return load_toml(CoordinatorSettings, path, environ={})


def with_flags(settings: CoordinatorSettings, args: argparse.Namespace) -> CoordinatorSettings:
    """The file's settings with each timing flag given on the command line put over them."""
    raft = {
        key: value
        for key, value in (
            ("min_timeout", args.min_election_timeout),
            ("max_timeout", args.max_election_timeout),
            ("append_period", args.append_period),
        )
        if value is not None
    }
    if args.max_election_timeout is not None:
        raft["connection_timeout"] = max(
            settings.raft.connection_timeout, args.max_election_timeout
        )
    liveness = {
        key: value
        for key, value in (("suspect_after", args.suspect_after), ("dead_after", args.dead_after))
        if value is not None
    }
    try:
        return replace(
            settings,
            raft=replace(settings.raft, **raft),
            liveness=replace(settings.liveness, **liveness),
        )
    except ConfigError as exc:
        source = args.config or "the defaults"
        raise ConfigError(f"the timing flags do not fit {source}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from shoal.raft.config import CoordinatorConfig
    from shoal.raft.coordinator import serve_until_signalled
    from shoal.runtime import loop
    from shoal.runtime.logs import configure_logging

    configure_logging(args.log_level)
    settings = with_flags(load_settings(args.config), args)
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
        secret=read_secret_file(args.secret_file, "cluster secret") if args.secret_file else "",
        token=token,
        node_token=_optional_secret(args.node_token_file, "node token"),
        read_token=_optional_secret(args.read_token_file, "read-only token"),
        task_entry_points=settings.api.task_entry_points,
        timings=settings.raft,
        liveness=settings.liveness,
        scheduling=settings.scheduling,
        chaos=settings.chaos,
        settings_source=str(args.config) if args.config else "defaults",
    )
    loop.run(serve_until_signalled(config))
    return 0
