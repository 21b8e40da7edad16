"""The node daemon: one per host. An ActorSystem on uvloop with its transport, health collectors
(host, GPUs by NVML or simulated, DCGM and PTP where the host has them, optionally clock), and
the agent that registers the node, heartbeats and runs the tasks the coordinator assigns (see
shoal/agent.py).

The data directory holds the node's stable id (`node-id`), a lock so two daemons never share
it, `node.json` (pid, id, transport address: what tools and tests read), the simulated GPUs'
state (`simgpu.json`, so chaos can raise an XID on a running node), the outcomes of the chaos
faults it executed (`chaos-faults.json`, shoal/node_faults.py) and `tasks/` (one log per child
process task). SIGTERM or SIGINT drains the node and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import signal
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.agent import NodeAgent
from shoal.agent_policy import Registration
from shoal.errors import ConfigError
from shoal.files import lock_directory, write_atomically
from shoal.node_config import NodeConfig, parse_listen
from shoal.node_faults import NodeFaults
from shoal.node_metrics import add_xids, node_gauges
from shoal.scheduler.health.collector import (
    Collector,
    Report,
    merge_gpus,
    summarise,
    utilisation_source,
)
from shoal.scheduler.health.presence import collector_states

log = logging.getLogger("shoal.node")

# -- identity and topology (pure but for the id file) ----------------------------------------


def node_identity(data_dir: Path, wanted: str | None) -> str:
    """The node's stable id: kept in `data_dir/node-id` so a restarted node is the same node."""
    path = data_dir / "node-id"
    stored = path.read_text().strip() if path.exists() else ""
    if wanted and stored and wanted != stored:
        raise ConfigError(
            f"--node-id={wanted!r} but {data_dir} belongs to node {stored!r}: "
            "use that id, another --data-dir, or delete the node-id file"
        )
    if stored:
        return stored
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname()).strip(".-")[:100] or "node"
    node_id = wanted or f"{host}-{secrets.token_hex(3)}"
    write_atomically(path, node_id + "\n", durable=True)
    return node_id


def gpu_topology(
    reports: Sequence[Report], node_id: str, island_size: int, domain: str, simulated: bool
) -> list[dict[str, Any]]:
    """The GPUs to register, with NVLink island and RDMA domain labels.

    Islands are per node (`<node>/nvl<k>`), GPU i in island i // island_size. Simulated GPUs
    get the node id in their UUID, since every simulated node numbers its GPUs from 0. A GPU
    that NVML and DCGM both see is one GPU.
    """
    gpus = []
    for g in merge_gpus(reports):
        uuid = g.uuid or f"GPU-{node_id}-{g.index}"
        gpus.append(
            {
                "index": g.index,
                "uuid": f"{uuid}@{node_id}" if simulated else uuid,
                "island": f"{node_id}/nvl{g.index // island_size}",
                "domain": domain,
            }
        )
    return gpus


def health_summary(
    node_id: str, reports: Sequence[Report], absent: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The heartbeat's health object: the balancer's NodeHealth, each GPU on its own (the
    summary keeps only the mean utilisation; the dashboard's heat map shows every GPU), why a
    source is missing, every collector's state (up, down or absent, with the reason: what
    `shoal status` and the dashboard show) and which source the GPU utilisation came from."""
    return {
        "summary": summarise(node_id, reports).to_dict(),
        "gpus": gpu_health(reports),
        "unavailable": {r.source: r.reason for r in reports if not r.available},
        "collectors": collector_states(reports, absent or {}),
        "gpu_util_source": utilisation_source(reports),
    }


def gpu_health(reports: Sequence[Report]) -> list[dict[str, Any]]:
    """One entry per GPU, by index: fractions, degrees, watts and this collection's errors;
    None where the device cannot say."""
    return [
        {
            "index": g.index,
            "utilisation": g.utilisation,
            "memory": g.memory_fraction,
            "temperature_c": g.temperature_c,
            "power_w": g.power_w,
            "xid_errors": len(g.xid_events),
            "ecc_errors": g.ecc_uncorrected_new,
        }
        for g in merge_gpus(reports)
    ]


def host_resources() -> tuple[float, int]:
    """(usable CPUs, physical memory in bytes) of this host."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(cpus or 1), int(memory)


# -- health ------------------------------------------------------------------------------------


@dataclass
class Collectors:
    """What `build_collectors` made: the collectors it built, and for each one it did not
    build, why (shown beside the built ones in the heartbeat's health)."""

    built: list[Collector]
    absent: dict[str, str] = field(default_factory=dict)


class HealthMonitor:
    """Runs the collectors in a worker thread every period; `latest()` is the newest summary."""

    def __init__(self, node_id: str, collectors: Collectors) -> None:
        self.node_id = node_id
        self.collectors = collectors.built
        self.absent = dict(collectors.absent)
        self._latest: dict[str, Any] = {}
        self.reports: list[Report] = []
        self.xid_totals: dict[int, int] = {}
        """XID events per GPU since start: each is handed out by the collector only once."""

    def latest(self) -> dict[str, Any]:
        return self._latest

    def _collect_all(self) -> list[Report]:
        return [c.collect() for c in self.collectors]

    async def collect(self) -> list[Report]:
        reports = await asyncio.to_thread(self._collect_all)
        self._latest = health_summary(self.node_id, reports, self.absent)
        self.reports = reports
        add_xids(self.xid_totals, reports)
        return reports

    async def run(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                await self.collect()
            except Exception:  # a collector bug must not stop the heartbeats
                log.exception("health collection failed; keeping the last summary")

    def close(self) -> None:
        for collector in self.collectors:
            collector.close()


def build_collectors(config: NodeConfig) -> Collectors:
    """Host and GPU (NVML or simulated) always; DCGM and PTP only where a first collection
    has data (a host engine answers, ptp4l answers), each absent one logged once with why;
    clock with --clock. Blocking (DCGM may take seconds to refuse): call it from a thread."""
    from shoal.scheduler.health.clock import CHAOS_CLOCK_ENV, ClockCollector, chaos_clock
    from shoal.scheduler.health.host import HostCollector
    from shoal.scheduler.health.simgpu import gpu_collector

    out = Collectors(
        [
            HostCollector(config.data_dir),
            gpu_collector(config.sim_gpus, config.island_size, _sim_state(config)),
        ]
    )
    _build_if_present(out, "dcgm", _dcgm_maker(config))
    _build_if_present(out, "ptp", _ptp_maker(config), _ptp_clocks())
    if config.clock is not None:
        host, port = parse_listen(config.clock, "--clock")
        if os.environ.get(CHAOS_CLOCK_ENV):
            log.warning("chaos hook: clock offset read from %s", os.environ[CHAOS_CLOCK_ENV])
        out.built.append(ClockCollector(host, port, clock=chaos_clock()))
    else:
        out.absent["clock"] = "no --clock responder given"
    return out


Maker = Callable[[], Collector | str]
"""Builds a collector, or says in a string why there is none to build."""


def _build_if_present(out: Collectors, name: str, make: Maker, note: str = "") -> None:
    """Build `name` and keep it if its first collection has data; else close it and record why
    (the report's reason, then `note`), with one log line either way."""
    made = make()
    if not isinstance(made, str):
        first = made.collect()
        if first.available:
            out.built.append(made)
            log.info("%s collector built", name)
            return
        made.close()
        made = first.reason.removeprefix("unavailable: ")
    out.absent[name] = f"{made}; {note}" if note else made
    log.info("%s collector absent: %s", name, out.absent[name])


def _dcgm_maker(config: NodeConfig) -> Maker:
    from shoal.scheduler.health.dcgm import DcgmCollector

    if config.sim_gpus:
        return lambda: "the node simulates its GPUs (--sim-gpus); DCGM would see the real ones"
    return lambda: DcgmCollector(host=config.dcgm_host)


def _ptp_maker(config: NodeConfig) -> Maker:
    from shoal.scheduler.health.clock import PtpCollector

    return lambda: PtpCollector(uds=config.ptp_socket)


def _ptp_clocks() -> str:
    """Which PTP hardware clocks the host has: says whether an absent ptp4l could run on one."""
    from shoal.scheduler.health.clock import ptp_devices

    return f"PTP hardware clocks: {', '.join(ptp_devices()) or 'none'}"


def _clock_file(config: NodeConfig) -> Path | None:
    """The chaos clock hook's offset file, which only a node measuring its clock (--clock) reads."""
    from shoal.scheduler.health.clock import CHAOS_CLOCK_ENV

    path = os.environ.get(CHAOS_CLOCK_ENV)
    return Path(path) if path and config.clock is not None else None


def _sim_state(config: NodeConfig) -> Path | None:
    return config.data_dir / "simgpu.json" if config.sim_gpus else None


# -- the daemon --------------------------------------------------------------------------------


def data_dir_error(data_dir: Path, exc: OSError) -> ConfigError:
    """A data dir the daemon cannot create or write, as one line naming it and the reason."""
    where = exc.filename if exc.filename is not None else data_dir
    return ConfigError(
        f"--data-dir={data_dir} is unusable: {where}: {exc.strerror or exc}; "
        "choose a directory this user can create and write"
    )


@contextlib.contextmanager
def claim(data_dir: Path) -> Iterator[None]:
    """An exclusive lock on the data dir: two daemons with one node id would fight over tasks.
    Creates the directory; one it cannot create or write is a ConfigError."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        handle = lock_directory(
            data_dir,
            f"--data-dir={data_dir} is used by another running node daemon; give each its own",
        )
    except OSError as exc:
        raise data_dir_error(data_dir, exc) from None
    with handle:
        yield


async def serve(config: NodeConfig, stop: asyncio.Event) -> None:
    """Run the node until `stop` is set, then drain it and return."""
    with claim(config.data_dir):
        try:
            node_id = node_identity(config.data_dir, config.node_id)
        except OSError as exc:
            raise data_dir_error(config.data_dir, exc) from None
        monitor = HealthMonitor(node_id, await asyncio.to_thread(build_collectors, config))
        try:
            reports = await monitor.collect()
            await _serve(config, node_id, monitor, reports, stop)
        finally:
            await asyncio.to_thread(monitor.close)


async def _serve(
    config: NodeConfig,
    node_id: str,
    monitor: HealthMonitor,
    reports: list[Report],
    stop: asyncio.Event,
) -> None:
    from shoal.raft.client import CoordinatorClient
    from shoal.runtime.system import ActorSystem
    from shoal.runtime.transport import TransportConfig, attach

    host, port = parse_listen(config.listen)
    cpus, memory = host_resources()
    gpus = gpu_topology(reports, node_id, config.island_size, config.domain, config.sim_gpus > 0)
    async with ActorSystem(f"node-{node_id}") as system:
        try:
            transport = await attach(
                system,
                TransportConfig(
                    token=config.token, host=host, port=port, stream_port=config.stream_port
                ),
            )
        except OSError as exc:
            what = f"--listen={config.listen}"
            if config.stream_port:
                what += f" or --stream-port={config.stream_port}"
            raise ConfigError(
                f"{what} cannot be bound ({exc.strerror}); pick a free address"
            ) from None
        try:
            registration = Registration(
                node_id, transport.address, cpus, memory, gpus, dict(config.labels)
            )
            client = CoordinatorClient(
                config.coordinators,
                config.token,
                timeout=max(3.0, 2 * config.agent.heartbeat_s),
                request_timeout=config.request_timeout_s,
            )
            async with client:
                agent = NodeAgent(
                    client,
                    registration,
                    system,
                    config.data_dir / "tasks",
                    config.agent,
                    monitor.latest,
                    NodeFaults(
                        node_id, client, config.data_dir, _sim_state(config), _clock_file(config)
                    ),
                )
                async with _scrape_server(config, monitor, agent) as metrics_url:
                    _write_node_file(config.data_dir, registration, metrics_url)
                    health = asyncio.create_task(monitor.run(config.health_s), name="shoal-health")
                    try:
                        await agent.run(stop)
                    finally:
                        health.cancel()
                        await asyncio.gather(health, return_exceptions=True)
        finally:
            await transport.close()
    log.info("node %s stopped", node_id)


@contextlib.asynccontextmanager
async def _scrape_server(
    config: NodeConfig, monitor: HealthMonitor, agent: NodeAgent
) -> AsyncIterator[str | None]:
    """The `/metrics` server while the node runs (its URL), or None without --metrics."""
    if config.metrics is None:
        yield None
        return
    from shoal.node_metrics import serve_metrics

    def render() -> str:
        gauges, counted = node_gauges(
            monitor.node_id,
            monitor.reports,
            monitor.xid_totals,
            [t.spec.kind for t in agent.running.values()],
            [t.state for t in agent.assigned],
        )
        return agent.metrics.render(gauges, counted)

    host, port = parse_listen(config.metrics, "--metrics")
    runner, url = await serve_metrics(config.metrics, host, port, render)
    log.info("serving metrics at %s", url)
    try:
        yield url
    finally:
        await runner.cleanup()


def _write_node_file(data_dir: Path, reg: Registration, metrics_url: str | None) -> None:
    info = {
        "pid": os.getpid(),
        "node_id": reg.node_id,
        "address": reg.address,
        "gpus": reg.gpus,
        "metrics": metrics_url,
    }
    write_atomically(data_dir / "node.json", json.dumps(info, indent=1), durable=False)


async def serve_until_signalled(config: NodeConfig) -> None:
    """Run the node until SIGTERM or SIGINT, then drain."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await serve(config, stop)
