"""`shoal chaos run|soak|inject`: scenarios against a fresh local cluster, repeated soaks, and
single faults on a running `shoal up` cluster."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal.commands.chaos_inject import add_inject

# seconds a scenario's cluster takes to start, for the progress bar's estimate of the whole run
STARTUP_ESTIMATE_S = 10.0
# The replicas' liveness clock in a scenario: a failed node is declared dead after DEAD_AFTER_S
# without a heartbeat, so its tasks can run elsewhere within the 10 s (the default 10 s
# alone would use it up). Long enough that a heartbeat lost to a killed or paused replica
# (3 s client timeout, then the next replica) does not look like a dead node.
SUSPECT_AFTER_S = 2.0
DEAD_AFTER_S = 5.0
# A node daemon cut off the coordinators this long stops its tasks (`--fence-after`): one
# heartbeat period (1 s) before the leader declares it dead and starts them elsewhere.
FENCE_AFTER_S = DEAD_AFTER_S - 1.0
MESSAGE_WIDTH = 60


def register(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = verbs.add_parser("chaos", help="fault injection and scenarios")
    sub = parser.add_subparsers(dest="chaos_verb", metavar="ACTION")
    sub.required = True

    run = sub.add_parser("run", help="run a scenario against a local cluster it starts")
    run.add_argument("scenario", help="a scenario file, or a shipped one: smoke, stress")
    run.add_argument("--json", action="store_true", help="print the JSON report")
    run.add_argument("--run-dir", type=Path, default=None, help="default: a fresh temporary dir")
    run.add_argument("--keep", action="store_true", help="keep the run directory afterwards")
    run.add_argument(
        "--hosts",
        type=int,
        default=None,
        metavar="N",
        help="run the scenario's N nodes as hosts of their own (network namespaces on a "
        "private bridge, as `shoal up --hosts`; root only): host-* faults need it",
    )
    run.add_argument(
        "--report-file",
        type=Path,
        default=None,
        help="also write the text report (faults, recovery, training curve) to this file",
    )
    run.set_defaults(func=_run)

    soak = sub.add_parser("soak", help="repeat a scenario until time is up or one fails")
    soak.add_argument("--hours", type=float, default=1.0, help="how long to keep going")
    soak.add_argument("--scenario", default="stress", help="file or shipped name (stress)")
    soak.add_argument("--json", action="store_true", help="print one JSON report per run")
    soak.add_argument(
        "--hosts", type=int, default=None, metavar="N", help="as for `shoal chaos run`"
    )
    soak.set_defaults(func=_soak)

    add_inject(sub)

    proxy = sub.add_parser(
        "proxy", help="a fault proxy on 127.0.0.1 in front of TARGET, switched over HTTP"
    )
    proxy.add_argument("target", help="HOST:PORT the proxy forwards to")
    proxy.add_argument("--listen", type=int, default=0, help="port to listen on (0: any free)")
    proxy.add_argument("--control", type=int, default=0, help="control API port (0: any free)")
    proxy.set_defaults(func=_proxy)


def _once(
    scenario_arg: str,
    run_dir: Path | None,
    keep: bool,
    quiet: bool,
    report_file: Path | None = None,
    hosts: int | None = None,
) -> dict[str, Any]:
    import shutil
    import sys
    import tempfile

    from shoal.chaos.report import render_text
    from shoal.chaos.runner import find_scenario, run_scenario
    from shoal.local import LocalCluster
    from shoal.progress import ProgressLine, Ticker, stderr_is_tty

    scenario = find_scenario(scenario_arg)
    if hosts is not None:
        _check_hosts(hosts, scenario)
    own = run_dir is None
    cluster = LocalCluster(run_dir or Path(tempfile.mkdtemp(prefix="shoal-chaos-")))
    try:
        made = _lay_out(cluster, scenario, hosts)
        if quiet or not stderr_is_tty():
            log = None if quiet else (lambda line: print(f"shoal chaos: {line}", file=sys.stderr))
            report = run_scenario(scenario, cluster, log, *made)
        else:
            expected = STARTUP_ESTIMATE_S + scenario.duration_s
            with Ticker(
                ProgressLine(), lambda t, msg: _chaos_line(scenario.name, t, expected, msg)
            ) as ticker:
                report = run_scenario(scenario, cluster, ticker.note, *made)
    finally:
        if hosts is not None:
            cluster.remove_network()
    if own and report.ok and not keep:
        shutil.rmtree(cluster.run_dir, ignore_errors=True)
    text = render_text(report)
    if report_file is not None:
        report_file.write_text(text + "\n")
    if not quiet:
        print(text)
    return report.to_dict()


def _check_hosts(count: int, scenario: Any) -> None:
    """Before anything is made: the count fits the scenario, and this user may make hosts
    (one line for a user who is not root)."""
    from shoal.errors import ConfigError
    from shoal.hosts import check_can_create

    if count != scenario.nodes:
        raise ConfigError(
            f"--hosts {count}: scenario {scenario.name} runs {scenario.nodes} nodes; give "
            f"--hosts {scenario.nodes} (each node a host of its own)"
        )
    check_can_create()


def _lay_out(cluster: Any, scenario: Any, hosts: int | None) -> tuple[Any, ...]:
    """Write the run's cluster: 3 replicas behind Raft proxies, the scenario's nodes each with
    a fault proxy to each replica, the reference clock and (for link faults) the link relay;
    with `hosts`, each node a host of its own (network namespaces; on loopback otherwise).
    Returns the rest of run_scenario's arguments: clock port, node links, relay port, hosts."""
    from shoal.chaos.harness import clock_file
    from shoal.chaos.node_mesh import plan_links
    from shoal.local import coordinator_specs
    from shoal.ports import free_port

    liveness = ("--suspect-after", str(SUSPECT_AFTER_S), "--dead-after", str(DEAD_AFTER_S))
    made = None
    if hosts is not None:
        from shoal.commands.chaos_hosts import make_hosts

        made = make_hosts(cluster, scenario)
    listen = "127.0.0.1" if made is None else made.bridge_address
    specs = coordinator_specs(
        cluster.run_dir,
        scenario.replicas,
        liveness,
        raft_bind=True,
        api_host=listen,
        tls_dir=cluster.tls_dir,
    )
    clock = free_port(listen, udp=True)
    names = [f"n{i + 1}" for i in range(scenario.nodes)]
    links = plan_links(names, [s.name for s in specs], lambda: free_port(listen))
    relay = _relay_port(scenario, lambda: free_port(listen))
    network = None if made is None else made.network
    nodes = _node_specs(cluster.run_dir, links, scenario.sim_gpus, clock, relay, network)
    cluster.create(specs + nodes, network)  # checks the run dir is writable, in one line
    for node in nodes:
        clock_file(cluster.run_dir, node.name).parent.mkdir(parents=True, exist_ok=True)
    return clock, links, relay, made


def _chaos_line(name: str, elapsed: float, expected: float, message: str) -> tuple[str, float]:
    """The bar's text and an estimated fraction (time against the scenario's length, never 1
    before the report: invariant checks after the workload take a while too)."""
    short = message if len(message) <= MESSAGE_WIDTH else message[: MESSAGE_WIDTH - 3] + "..."
    return f"chaos {name} {elapsed:.0f}/{expected:.0f} s  {short}", min(0.99, elapsed / expected)


def _relay_port(scenario: Any, free_port: Callable[[], int]) -> int | None:
    """A port for the link relay when the scenario faults rollout<->learner links; otherwise
    the tasks' links dial directly, as in a cluster without chaos."""
    from shoal.chaos.scenario import LINK_KINDS

    return free_port() if any(f.kind in LINK_KINDS for f in scenario.faults) else None


def _node_specs(
    run_dir: Path,
    links: Any,
    gpus: int,
    clock_port: int,
    relay_port: int | None = None,
    network: Any = None,
) -> list[Any]:
    """Node daemons n1..nN on free loopback ports, each reaching the replicas through its own
    fault proxies (`links`, from chaos.node_mesh.plan_links), each with its data dir under the
    run dir (where chaos finds its simulated GPUs' state file), its clock read through an
    offset file there (the clock-skew hook) and measured against the run's reference clock on
    `clock_port` (UDP); with `relay_port`, every link their tasks open dials through the
    run's link relay there (`$SHOAL_LINK_RELAY`, inherited by the tasks).

    With a `network` (shoal.hosts.Network) node n<i> runs inside host h<i>'s namespace and
    listens on its address; the proxies, clock and relay are on the bridge address, the API
    is https under the cluster's CA ($SHOAL_TLS_DIR), and the node holds the node credential,
    as under `shoal up --hosts`."""
    import sys

    from shoal import hosts
    from shoal.chaos.harness import clock_file
    from shoal.chaos.node_mesh import coordinator_urls
    from shoal.local import ProcessSpec
    from shoal.runtime.tls import TLS_DIR_ENV
    from shoal.runtime.tunnel import RELAY_ENV
    from shoal.scheduler.health.clock import CHAOS_CLOCK_ENV

    bridge = "127.0.0.1" if network is None else network.bridge_address
    specs = []
    for name in links:
        host = None if network is None else network.host(name)
        prefix = [] if host is None else hosts.exec_prefix(host)
        urls = coordinator_urls(links, name, bridge, "http" if host is None else "https")
        token = run_dir / ("api-token" if host is None else "node-token")
        argv = [
            *prefix, sys.executable, "-m", "shoal", "node", "--coordinators", urls,
            "--data-dir", str(run_dir / "nodes" / name), "--token-file", str(token),
            "--node-id", name, "--listen", f"{'127.0.0.1' if host is None else host.address}:0",
            "--sim-gpus", str(gpus),
            "--clock", f"{bridge}:{clock_port}", "--fence-after", str(FENCE_AFTER_S),
        ]  # fmt: skip
        env = {CHAOS_CLOCK_ENV: str(clock_file(run_dir, name))}
        if host is not None:
            env[TLS_DIR_ENV] = str(run_dir / "tls")
        if relay_port is not None:
            env[RELAY_ENV] = f"{bridge}:{relay_port}"
        specs.append(ProcessSpec(name, argv, "node", env=env))
    return specs


def _run(args: argparse.Namespace) -> int:
    if args.report_file is not None and not args.report_file.parent.is_dir():
        from shoal.errors import ConfigError

        raise ConfigError(
            f"--report-file {args.report_file}: folder {args.report_file.parent} does not exist"
        )
    result = _once(args.scenario, args.run_dir, args.keep, args.json, args.report_file, args.hosts)
    if args.json:
        print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


def _soak(args: argparse.Namespace) -> int:
    from shoal.errors import ConfigError

    if not 0 < args.hours <= 24 * 30:
        raise ConfigError(f"--hours={args.hours} must be in (0, 720]")
    import sys

    # with --json, stdout is one JSON report per line and nothing else
    verdicts = sys.stderr if args.json else sys.stdout
    deadline = time.monotonic() + args.hours * 3600
    runs = 0
    while time.monotonic() < deadline:
        result = _once(args.scenario, None, False, quiet=args.json, hosts=args.hosts)
        runs += 1
        if args.json:
            print(json.dumps(result), flush=True)
        if not result["ok"]:
            print(f"shoal chaos soak: run {runs} broke an invariant; stopping", file=verdicts)
            return 1
    print(f"shoal chaos soak: {runs} runs, every invariant held", file=verdicts)
    return 0


def _proxy(args: argparse.Namespace) -> int:
    import asyncio

    from shoal.errors import ConfigError

    host, sep, port = args.target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"target={args.target!r} is not HOST:PORT with a port in 1..65535")
    for key in ("listen", "control"):
        if not 0 <= getattr(args, key) < 65536:
            raise ConfigError(f"--{key}={getattr(args, key)} is not a port in 0..65535")
    asyncio.run(_serve_proxy((host, int(port)), args.listen, args.control))
    return 0


async def _serve_proxy(target: tuple[str, int], listen: int, control: int) -> None:
    """Serve until SIGINT/SIGTERM; prints the two ports first, one line each, for scripts."""
    import asyncio
    import signal

    from shoal.chaos.proxy import FaultProxy
    from shoal.chaos.proxy_control import serve_control

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with FaultProxy(target, listen) as proxy:
        runner = await serve_control({"proxy": proxy}, control)
        try:
            print(f"proxy 127.0.0.1:{proxy.port} -> {target[0]}:{target[1]}", flush=True)
            print(f"control http://127.0.0.1:{runner.addresses[0][1]}/proxies", flush=True)
            await stop.wait()
        finally:
            await runner.cleanup()
