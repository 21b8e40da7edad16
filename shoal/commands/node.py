"""`shoal node`: run this host's node daemon (actor runtime, health, task agent)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from shoal.errors import ConfigError


def register(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = verbs.add_parser("node", help="run the node daemon of this host")
    parser.add_argument(
        "--coordinators",
        required=True,
        metavar="URL[,URL...]",
        help="API URLs of the coordinator replicas, e.g. http://10.0.0.1:8001,http://10.0.0.2:8001",
    )
    parser.add_argument(
        "--data-dir", required=True, type=Path, help="node id, logs and task output go here"
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        help="the node credential: the coordinators' --node-token-file, also this node's "
        "transport token (default: $SHOAL_API_TOKEN)",
    )
    parser.add_argument("--node-id", help="this node's id (default: kept in the data dir)")
    parser.add_argument(
        "--listen", default="127.0.0.1:0", metavar="HOST:PORT", help="actor transport address"
    )
    parser.add_argument(
        "--stream-port",
        type=int,
        default=0,
        metavar="PORT",
        help="port of the actor transport's frame streams (default 0: any free port)",
    )
    parser.add_argument("--sim-gpus", type=int, default=0, help="simulate N GPUs instead of NVML")
    parser.add_argument("--island-size", type=int, default=16, help="GPUs per NVLink island")
    parser.add_argument("--domain", default="default", help="RDMA domain label of this node")
    parser.add_argument(
        "--label", action="append", default=[], metavar="KEY=VALUE", help="node label (repeat)"
    )
    parser.add_argument(
        "--clock", metavar="HOST:PORT", help="clock responder to measure this host's offset"
    )
    parser.add_argument(
        "--dcgm-host",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="DCGM host engine (IP, IP:PORT or unix://PATH; default the local one); the DCGM "
        "collector runs when DCGM answers there",
    )
    parser.add_argument(
        "--ptp-socket",
        metavar="PATH",
        help="ptp4l's Unix socket (its uds_address) if not /var/run/ptp4l; the PTP collector "
        "runs when ptp4l answers",
    )
    parser.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus /metrics here (port 0 picks one; node.json names it); default off",
    )
    parser.add_argument("--heartbeat", type=float, default=1.0, help="heartbeat period, seconds")
    parser.add_argument(
        "--health-period", type=float, default=2.0, help="health collection period, seconds"
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=20.0,
        help="seconds a task may take to stop on drain before SIGKILL",
    )
    parser.add_argument(
        "--fence-after",
        type=float,
        metavar="S",
        help="stop every task here after S seconds without an accepted heartbeat, until one "
        "is accepted again (default: never); keep S below the coordinators' --dead-after "
        "minus one heartbeat",
    )
    parser.add_argument("--log-level", default="INFO")
    parser.set_defaults(func=run)


def parse_labels(items: list[str]) -> dict[str, str]:
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--label {item!r} is invalid: write KEY=VALUE")
        labels[key] = value
    return labels


def run(args: argparse.Namespace) -> int:
    from shoal.agent_policy import AgentConfig
    from shoal.commands.coordinator import read_secret_file
    from shoal.node import serve_until_signalled
    from shoal.node_config import NodeConfig
    from shoal.runtime.logs import configure_logging
    from shoal.runtime.loop import run as run_loop

    configure_logging(args.log_level)
    token = (
        read_secret_file(args.token_file, "API token")
        if args.token_file
        else os.environ.get("SHOAL_API_TOKEN", "")
    )
    config = NodeConfig(
        coordinators=tuple(u.strip() for u in args.coordinators.split(",") if u.strip()),
        data_dir=args.data_dir.resolve(),
        token=token,
        node_id=args.node_id,
        listen=args.listen,
        stream_port=args.stream_port,
        sim_gpus=args.sim_gpus,
        island_size=args.island_size,
        domain=args.domain,
        labels=parse_labels(args.label),
        clock=args.clock,
        dcgm_host=args.dcgm_host,
        ptp_socket=args.ptp_socket,
        metrics=args.metrics,
        health_s=args.health_period,
        agent=AgentConfig(
            heartbeat_s=args.heartbeat,
            stop_timeout_s=args.stop_timeout,
            fence_after_s=args.fence_after,
        ),
    )
    run_loop(serve_until_signalled(config))
    return 0
