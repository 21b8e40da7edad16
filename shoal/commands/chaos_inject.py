"""`shoal chaos inject KIND --target T`: one fault on a running cluster.

Three families. `kill` and `pause` signal a process of a local `shoal up` cluster from this host
(leader, follower, c1.., n1..). `host-cut` and `host-kill` fault a whole host of a `shoal up
--hosts` cluster (root): cut off the other hosts, or everything on it SIGKILLed (its node daemon
started again after --duration). The API kinds (`task-kill`, `task-pause`, `node-kill`,
`gpu-xid`, `clock-skew`) go through the coordinator's chaos API (the cluster's config must enable it), so they
reach any host: the node that runs the target executes the fault and reports its outcome,
which this command waits for and prints.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from shoal.commands.up import add_run_dir

LOCAL_KINDS = ("kill", "pause")
HOST_KINDS = ("host-cut", "host-kill")
API_KINDS = ("task-kill", "task-pause", "node-kill", "gpu-xid", "clock-skew")
MAX_DURATION_S = 3600.0


def add_inject(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    inject = sub.add_parser(
        "inject",
        help="one fault on a running cluster: a local process, or a task, node or GPU via the API",
    )
    inject.add_argument(
        "kind",
        choices=[*LOCAL_KINDS, *HOST_KINDS, *API_KINDS],
        help="kill/pause: SIGKILL/SIGSTOP a `shoal up` process; host-cut/host-kill: a host of a "
        "`shoal up --hosts` cluster cut off the others / everything on it SIGKILLed; task-kill, "
        "task-pause, node-kill, gpu-xid, clock-skew: through the chaos API, executed by the "
        "target's node",
    )
    inject.add_argument(
        "--target",
        required=True,
        help="kill/pause: leader, follower or a process name (c1, n1, ...); host-*: a node "
        "(its host); task-*: a task id; node-kill, gpu-xid, clock-skew: a node id",
    )
    inject.add_argument(
        "--duration",
        type=float,
        default=None,
        help="heal after this many seconds (restart / SIGCONT / cut healed); kill and host-kill "
        "without it stay down",
    )
    inject.add_argument("--gpu", type=int, default=None, help="gpu-xid: the GPU index")
    inject.add_argument("--xid", type=int, default=None, help="gpu-xid: the XID number (79)")
    inject.add_argument(
        "--offset", type=float, default=None, help="clock-skew: seconds added to the node's clock"
    )
    inject.add_argument(
        "--coordinator",
        metavar="URL[,URL...]",
        default=None,
        help="API kinds: the replicas' API URLs (default: the local cluster's in --run-dir)",
    )
    inject.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="API kinds with --coordinator: the API token (default: $SHOAL_API_TOKEN)",
    )
    inject.add_argument(
        "--wait",
        type=float,
        default=15.0,
        help="API kinds: seconds to wait for the node's outcome (0: do not wait)",
    )
    add_run_dir(inject)
    inject.set_defaults(func=_inject)


def _inject(args: argparse.Namespace) -> int:
    from shoal.errors import ConfigError

    if args.duration is not None and not 0 <= args.duration <= MAX_DURATION_S:
        raise ConfigError(f"--duration={args.duration} must be in 0..{MAX_DURATION_S:g} seconds")
    if args.kind in ("pause", "task-pause", "clock-skew", "host-cut") and not args.duration:
        raise ConfigError(f"{args.kind} needs --duration > 0 (seconds until it is undone)")
    if args.kind != "gpu-xid" and (args.gpu is not None or args.xid is not None):
        raise ConfigError(f"--gpu and --xid belong to gpu-xid, not {args.kind}")
    if args.kind == "gpu-xid" and args.gpu is None:
        raise ConfigError("gpu-xid needs --gpu N, the index of the GPU to fault")
    if args.offset is not None and args.kind != "clock-skew":
        raise ConfigError(f"--offset belongs to clock-skew, not {args.kind}")
    if args.kind == "clock-skew" and not args.offset:
        raise ConfigError("clock-skew needs --offset S, the non-zero seconds to add to the clock")
    if args.kind in LOCAL_KINDS + HOST_KINDS:
        if args.coordinator is not None:
            raise ConfigError(
                f"{args.kind} faults a local `shoal up` cluster and takes no --coordinator; "
                "use task-kill, task-pause or node-kill for a remote cluster"
            )
        return _host(args) if args.kind in HOST_KINDS else _local(args)
    if not 0 <= args.wait <= MAX_DURATION_S:
        raise ConfigError(f"--wait={args.wait} must be in 0..{MAX_DURATION_S:g} seconds")
    return _through_api(args)


# -- local processes of `shoal up` -------------------------------------------------------------


def _local(args: argparse.Namespace) -> int:
    from shoal.chaos.faults import Fault, KillProcess, PauseProcess
    from shoal.local import LocalCluster, default_run_dir

    cluster = LocalCluster(args.run_dir or default_run_dir())
    name = _target(cluster, args.target)
    fault: Fault = (
        KillProcess(cluster, name) if args.kind == "kill" else PauseProcess(cluster, name)
    )
    started = time.monotonic()
    print(f"shoal chaos: {fault.inject()}")
    if args.duration is None:
        return 0
    time.sleep(args.duration)
    print(f"shoal chaos: {fault.heal()}")
    leader = cluster.wait_ready(timeout=60.0)
    print(f"shoal chaos: leader {leader} after {time.monotonic() - started:.2f} s")
    return 0


def _host(args: argparse.Namespace) -> int:
    """host-cut / host-kill on a `shoal up --hosts` cluster, with chaos's own host faults."""
    import asyncio

    from shoal.chaos.errors import FaultError
    from shoal.chaos.hostfaults import HostFaults
    from shoal.chaos.scenario import FaultSpec
    from shoal.commands.chaos_hosts import NamespaceHosts
    from shoal.hosts import check_can_create
    from shoal.local import LocalCluster, default_run_dir

    cluster = LocalCluster(args.run_dir or default_run_dir())
    network = cluster.network()
    if network is None:
        raise FaultError(
            f"the cluster in {cluster.run_dir} has no hosts of its own; start it with "
            "`shoal up --hosts N` to fault hosts"
        )
    check_can_create()
    node = network.host(args.target).node
    faults = HostFaults(NamespaceHosts(network, cluster.run_dir / "storage"), cluster)
    if args.kind == "host-kill":
        print(f"shoal chaos: {asyncio.run(faults.kill(node))}")
        if args.duration is None:
            return 0
        time.sleep(args.duration)
        print(f"shoal chaos: {asyncio.run(faults.revive(node))}")
        cluster.wait_nodes(len(network.hosts), timeout=60.0)
        print(f"shoal chaos: {node} registered and alive again")
        return 0
    spec = FaultSpec("host-cut", node, at=0.0, duration=args.duration, recover_within_s=0.0)
    print(f"shoal chaos: {asyncio.run(faults.cut(spec, node))}")
    try:
        time.sleep(args.duration)
    finally:  # Ctrl-C too: a cut left behind would outlive this command
        print(f"shoal chaos: {asyncio.run(faults.uncut(spec, node))}")
    return 0


def _target(cluster: Any, target: str) -> str:
    from shoal.chaos.errors import FaultError

    if target not in ("leader", "follower"):
        return str(cluster.spec(target).name)
    leader_api = cluster.wait_ready(timeout=10.0)
    names = [s.name for s in cluster.specs() if cluster.pid(s.name)]
    leader = next(s.name for s in cluster.specs() if s.api_url == leader_api)
    if target == "leader":
        return leader
    followers = [n for n in names if n != leader]
    if not followers:
        raise FaultError("no running follower to fault")
    return followers[0]


# -- through the chaos API ------------------------------------------------------------------------


def _through_api(args: argparse.Namespace) -> int:
    from shoal.runtime import loop

    urls, token = _endpoint(args)
    params: dict[str, Any] = {}
    if args.duration is not None:
        params["duration_s"] = args.duration
    if args.gpu is not None:
        params["gpu"] = args.gpu
    if args.xid is not None:
        params["xid"] = args.xid
    if args.offset is not None:
        params["offset_s"] = args.offset
    fault = loop.run(_inject_and_wait(urls, token, args.kind, args.target, params, args.wait))
    return 0 if fault["state"] in ("injected", "healed") or args.wait == 0 else 1


def _endpoint(args: argparse.Namespace) -> tuple[list[str], str]:
    """The replicas' URLs and the token: given by flags, else the local cluster's."""
    import os

    from shoal.commands.coordinator import read_secret_file
    from shoal.errors import ConfigError
    from shoal.local import LocalCluster, default_run_dir

    if args.coordinator is None:
        if args.token_file is not None:
            raise ConfigError("--token-file goes with --coordinator; a local cluster has its own")
        local = LocalCluster(args.run_dir or default_run_dir())
        return local.api_urls(), local.token
    urls = [u.strip().rstrip("/") for u in args.coordinator.split(",") if u.strip()]
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"--coordinator entry {url!r} is invalid: use http://HOST:PORT of a replica's API"
            )
    if not urls:
        raise ConfigError("--coordinator is empty: give the replicas' API URLs, comma-separated")
    if args.token_file is not None:
        return urls, read_secret_file(args.token_file, "API token")
    token = os.environ.get("SHOAL_API_TOKEN", "")
    if not token:
        raise ConfigError("no API token: pass --token-file or set $SHOAL_API_TOKEN")
    return urls, token


async def _inject_and_wait(
    urls: list[str], token: str, kind: str, target: str, params: dict[str, Any], wait: float
) -> dict[str, Any]:
    import asyncio

    from shoal.raft.client import CoordinatorClient

    async with CoordinatorClient(urls, token, timeout=10.0) as client:
        fault = await client.inject_fault(kind, target, **params)
        print(
            f"shoal chaos: fault {fault['id']}: {kind} of {target} on node {fault['node']} requested"
        )
        # A pause or a skew is healed after its duration, a kill once the tasks it stopped run
        # again (the leader restarts or re-places them): wait for that too.
        undone = kind in ("task-pause", "clock-skew") or bool(fault.get("tasks"))
        final = ("healed", "failed") if undone else ("injected", "failed")
        deadline = time.monotonic() + wait + (params.get("duration_s", 0.0) if wait else 0.0)
        shown = "requested"
        while time.monotonic() < deadline:
            fault = await client.fault(fault["id"])
            if fault["state"] != shown:
                shown = fault["state"]
                print(f"shoal chaos: fault {fault['id']} {shown}: {fault['message']}")
            if fault["state"] in final:
                return fault
            await asyncio.sleep(0.2)
        if wait:
            why = (
                "its tasks do not run again yet"
                if fault["state"] == "injected"
                else f"is node {fault['node']} up?"
            )
            print(
                f"shoal chaos: fault {fault['id']} is still {fault['state']} after {wait:g} s: "
                f"{why} (GET /v1/chaos/faults/{fault['id']})"
            )
        return fault
