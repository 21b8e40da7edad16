"""`shoal up`: start a local cluster of coordinator replicas (and node daemons with simulated
GPUs) in the background; with `--hosts N` each node daemon is a host of its own (shoal/hosts.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shoal.local import LocalCluster, ProcessSpec


def add_run_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="the local cluster's directory (default: $SHOAL_RUN_DIR or ~/.shoal/run)",
    )


def register(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = verbs.add_parser("up", help="start a local cluster in the background")
    parser.add_argument(
        "--replicas", type=int, default=3, help="coordinator replicas (odd: 1, 3, 5)"
    )
    parser.add_argument("--nodes", type=int, default=0, help="node daemons to start beside them")
    parser.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="run N node daemons, each a host of its own: a network namespace with its own "
        "address on a private bridge, TLS between them (root only)",
    )
    parser.add_argument("--sim-gpus", type=int, default=0, help="simulated GPUs per node")
    parser.add_argument("--island-size", type=int, default=16, help="GPUs per NVLink island")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a leader")
    parser.add_argument(
        "--coordinator-config",
        type=Path,
        metavar="FILE.toml",
        help="settings file for every replica (shoal coordinator --config), read at each start",
    )
    add_run_dir(parser)
    parser.set_defaults(func=run)


def check_options(args: argparse.Namespace) -> None:
    """Every number `shoal up` takes, checked before anything is written or started."""
    from shoal.config import check_int, check_number
    from shoal.errors import ConfigError

    if args.replicas < 1 or args.replicas % 2 == 0 or args.replicas > 9:
        raise ConfigError(
            f"--replicas={args.replicas} must be odd, between 1 and 9 (a majority must survive)"
        )
    check_int("--nodes", args.nodes, 0, 64)
    check_int("--hosts", args.hosts, 0, 64)
    if args.hosts and args.nodes not in (0, args.hosts):
        raise ConfigError(
            f"--nodes={args.nodes} with --hosts={args.hosts}: every host runs one node daemon; "
            "leave out --nodes"
        )
    check_int("--sim-gpus", args.sim_gpus, 0, 1024)
    check_int("--island-size", args.island_size, 1, 1024)
    check_number("--timeout", args.timeout, above=0, unit="seconds")


def run(args: argparse.Namespace) -> int:
    from shoal.local import LocalCluster, LocalClusterError, default_run_dir

    check_options(args)
    nodes = args.hosts or args.nodes
    local = LocalCluster(args.run_dir or default_run_dir())
    if (local.run_dir / "cluster.json").exists():  # bring the same cluster back, data and all
        _check_same_cluster(local, args, nodes)
        print(f"shoal: bringing back the cluster recorded in {local.run_dir} (its data and ports)")
    else:
        _lay_out(local, args, nodes)
    try:
        local.start_all()
        leader = local.wait_ready(timeout=args.timeout)
        found = local.wait_nodes(nodes, timeout=args.timeout)
    except LocalClusterError:
        local.stop_all()
        local.remove_network()
        raise
    _print_cluster(local, leader, found)
    return 0


def _check_same_cluster(local: LocalCluster, args: argparse.Namespace, nodes: int) -> None:
    """The options must describe the cluster the run dir holds; its network (with --hosts) is
    made again, after removing what a crash left of it."""
    from shoal.errors import ConfigError
    from shoal.local_hosts import restore_network

    specs, network = local.specs(), local.network()
    had = (
        sum(s.kind == "coordinator" for s in specs),
        sum(s.kind == "node" for s in specs),
        len(network.hosts) if network else 0,
    )
    if had != (args.replicas, nodes, args.hosts):
        raise ConfigError(
            f"--replicas={args.replicas} --nodes={nodes} --hosts={args.hosts} differ from the "
            f"cluster in {local.run_dir} ({had[0]} replicas, {had[1]} nodes, {had[2]} hosts); "
            "use another --run-dir or delete that one"
        )
    given = args.coordinator_config
    if given is not None and str(given.resolve()) not in specs[0].argv:
        raise ConfigError(
            f"--coordinator-config={given}: the cluster in {local.run_dir} re-reads the file "
            "it was created with at each start; edit that one, or use another --run-dir"
        )
    specs = [_with_this_interpreter(s) for s in specs]
    local.check_not_running()  # its own processes would hold its ports
    if network is None:
        _check_ports_free(local, specs)
    local.create(specs, network)
    restore_network(local)


def _with_this_interpreter(spec: ProcessSpec) -> ProcessSpec:
    """The spec run by the Python running `shoal up` now: the one recorded may be a deleted or
    older virtual environment's, which would start a cluster of another shoal version."""
    import dataclasses
    import sys

    argv = list(spec.argv)
    at = next((i for i, a in enumerate(argv) if a == "-m" and argv[i + 1 : i + 2] == ["shoal"]), 0)
    if at >= 1 and argv[at - 1] != sys.executable:
        argv[at - 1] = sys.executable
    return dataclasses.replace(spec, argv=argv)


def _check_ports_free(local: LocalCluster, specs: list[ProcessSpec]) -> None:
    """A cluster brought back listens on the ports it was made with; one another program took
    since would make a replica fail at start, so say which, and how to get fresh ones."""
    import socket
    from urllib.parse import urlsplit

    from shoal.errors import ConfigError

    for spec in specs:
        for address in (spec.api_url, spec.raft, spec.raft_bind):
            if not address:
                continue
            parts = urlsplit(address if "//" in address else f"//{address}")
            with socket.socket() as probe:
                try:
                    probe.bind((parts.hostname or "127.0.0.1", parts.port or 0))
                except OSError:
                    raise ConfigError(
                        f"{spec.name} of the cluster in {local.run_dir} listens on {address}, "
                        "which another program now holds: stop it, or delete that directory "
                        "(`shoal down` first) for a new cluster on free ports"
                    ) from None


def _lay_out(local: LocalCluster, args: argparse.Namespace, nodes: int) -> None:
    from shoal.local import coordinator_specs, node_specs
    from shoal.local_hosts import create_hosts_cluster

    config_args: tuple[str, ...] = ()
    if args.coordinator_config is not None:
        from shoal.commands.coordinator import load_settings

        load_settings(args.coordinator_config)  # a mistake stops here, before any process
        config_args = ("--config", str(args.coordinator_config.resolve()))
    if args.hosts:
        create_hosts_cluster(
            local, args.hosts, args.replicas, args.sim_gpus, args.island_size, config_args
        )
        return
    specs = coordinator_specs(local.run_dir, args.replicas, config_args)
    urls = [s.api_url for s in specs if s.api_url]
    local.create(specs + node_specs(local.run_dir, urls, nodes, args.sim_gpus, args.island_size))


def _print_cluster(local: LocalCluster, leader: str, nodes: list[dict[str, Any]]) -> None:
    """What runs where; with --hosts each node's host, its address and namespace (`shoal
    status` lists the processes again later)."""
    network = local.network()
    print(f"shoal: local cluster up in {local.run_dir}")
    for spec in local.specs():
        if spec.kind == "node" and network:
            host = network.host(spec.name)
            print(
                f"  {spec.name}  pid {local.pid(spec.name)}  node  host {host.name} "
                f"{host.address} (netns {host.netns})"
            )
        elif spec.kind == "node":
            print(f"  {spec.name}  pid {local.pid(spec.name)}  node")
        else:
            print(
                f"  {spec.name}  pid {local.pid(spec.name)}  api {spec.api_url}  raft {spec.raft}"
            )
    if nodes:
        gpus = sum(n["gpus"] for n in nodes)
        islands = sum(len(n["islands"]) for n in nodes)
        print(f"  {len(nodes)} nodes, {gpus} GPUs in {islands} NVLink islands")
    if network:
        print(
            f"  hosts on bridge {network.bridge} {network.bridge_address}/24; "
            f"storage {local.run_dir / 'storage'}"
        )
        print(f"  TLS: tools on this host need SHOAL_TLS_DIR={local.tls_dir}")
    print(f"  leader {leader}; API token in {local.run_dir / 'api-token'}")
