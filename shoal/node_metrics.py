"""The node daemon's Prometheus exporter: `shoal node --metrics HOST:PORT` serves `/metrics`
from a small aiohttp server of its own, apart from the actor transport, as Prometheus
exporters do: a scrape never queues behind actor frames, and the scrape port can be opened to
the monitoring network without opening the transport.

A scrape renders what the health monitor collected last and the agent's counters; it never
queries NVML itself, so scraping often costs the GPUs nothing. GPU series carry the labels
`node` and `gpu` and are named after the DCGM exporter's fields (the HELP text names the
field), in base units: a ratio where DCGM gives percent, bytes where it gives MiB.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping, Sequence

from aiohttp import web

from shoal.errors import ConfigError
from shoal.raft.metrics import Gauges, Labels
from shoal.scheduler.health.collector import Report, merge_gpus

MIB = 1024 * 1024

# (report metric, gauge name, scale to base units, HELP)
HOST_GAUGES = (
    ("cpu_fraction", "shoal_node_cpu_ratio", 1.0, "busy share of the host's CPUs (0..1)"),
    ("cpus", "shoal_node_cpus", 1.0, "CPUs of the host"),
    ("memory_fraction", "shoal_node_memory_used_ratio", 1.0, "share of memory not available"),
    ("memory_total_mb", "shoal_node_memory_total_bytes", MIB, "physical memory"),
    ("memory_available_mb", "shoal_node_memory_available_bytes", MIB, "MemAvailable"),
    ("disk_total_gb", "shoal_node_disk_total_bytes", 1e9, "size of the data dir's filesystem"),
    ("disk_free_gb", "shoal_node_disk_free_bytes", 1e9, "space left on the data dir's filesystem"),
    ("disk_fraction", "shoal_node_disk_used_ratio", 1.0, "share of the data dir's disk used"),
    ("load1", "shoal_node_load1", 1.0, "1-minute load average"),
    ("load5", "shoal_node_load5", 1.0, "5-minute load average"),
    ("offset_ms", "shoal_node_clock_offset_seconds", 1e-3, "clock offset to the --clock peer"),
    ("delay_ms", "shoal_node_clock_delay_seconds", 1e-3, "round trip to the --clock peer"),
    ("ptp_offset_ms", "shoal_node_ptp_offset_seconds", 1e-3, "ptp4l's offset from its master"),
)

# (GpuSample attribute, gauge name, scale, HELP)
GPU_GAUGES = (
    (
        "utilisation",
        "shoal_gpu_utilisation_ratio",
        1.0,
        "GPU utilisation 0..1, like DCGM_FI_DEV_GPU_UTIL (which is percent)",
    ),
    (
        "memory_used_mb",
        "shoal_gpu_memory_used_bytes",
        MIB,
        "framebuffer memory used, like DCGM_FI_DEV_FB_USED (which is MiB)",
    ),
    (
        "memory_total_mb",
        "shoal_gpu_memory_total_bytes",
        MIB,
        "framebuffer memory, like DCGM_FI_DEV_FB_TOTAL (which is MiB)",
    ),
    (
        "temperature_c",
        "shoal_gpu_temperature_celsius",
        1.0,
        "GPU temperature, like DCGM_FI_DEV_GPU_TEMP",
    ),
    ("power_w", "shoal_gpu_power_watts", 1.0, "power draw, like DCGM_FI_DEV_POWER_USAGE"),
    ("nvlinks_up", "shoal_gpu_nvlinks_up", 1.0, "NVLink links up, like DCGM_FI_DEV_NVLINK_*"),
)

GPU_COUNTERS = (
    (
        "ecc_corrected",
        "shoal_gpu_ecc_corrected_errors_total",
        "corrected (single-bit) ECC errors since the driver loaded, "
        "like DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
    ),
    (
        "ecc_uncorrected",
        "shoal_gpu_ecc_uncorrected_errors_total",
        "uncorrectable (double-bit) ECC errors since the driver loaded, "
        "like DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    ),
)

XID_HELP = (
    "XID errors seen since the node daemon started; "
    "DCGM_FI_DEV_XID_ERRORS holds only the last XID's number, this counts them"
)


def add_xids(totals: MutableMapping[int, int], reports: Iterable[Report]) -> None:
    """Count each collection's XID events per GPU: the collector hands each event out once,
    so the running total has to live here to be a counter. A GPU NVML and DCGM both see counts
    once (`merge_gpus`)."""
    for gpu in merge_gpus(reports):
        totals[gpu.index] = totals.get(gpu.index, 0) + len(gpu.xid_events)


def node_gauges(
    node_id: str,
    reports: Sequence[Report],
    xid_totals: MutableMapping[int, int],
    running_kinds: Iterable[str],
    assigned_states: Iterable[str],
) -> tuple[Gauges, Gauges]:
    """(gauges, counters kept elsewhere) of one node. Pure: tests feed it reports by hand."""
    node: Labels = (("node", node_id),)
    gauges: Gauges = {}
    counted: Gauges = {}
    up: dict[Labels, float] = {
        (("node", node_id), ("source", r.source)): float(r.available) for r in reports
    }
    gauges["shoal_node_health_source_up"] = ("1 when the health source has data, else 0", up)
    for report in reports:
        if not report.available:
            continue
        for key, name, scale, help_text in HOST_GAUGES:
            if key in report.metrics:
                gauges[name] = (help_text, {node: float(report.metrics[key]) * scale})
    samples = merge_gpus(reports)
    for attr, name, scale, help_text in GPU_GAUGES:
        cells = {
            _gpu(g.index, node_id): float(getattr(g, attr)) * scale
            for g in samples
            if getattr(g, attr) is not None
        }
        if cells:
            gauges[name] = (help_text, cells)
    for attr, name, help_text in GPU_COUNTERS:
        cells = {
            _gpu(g.index, node_id): float(getattr(g, attr))
            for g in samples
            if getattr(g, attr) is not None
        }
        if cells:
            counted[name] = (help_text, cells)
    if samples:
        xids = {_gpu(g.index, node_id): float(xid_totals.get(g.index, 0)) for g in samples}
        counted["shoal_gpu_xid_errors_total"] = (XID_HELP, xids)
    gauges["shoal_node_tasks_running"] = (
        "tasks running in this node daemon, by kind",
        _count(node_id, "kind", running_kinds),
    )
    gauges["shoal_node_tasks_assigned"] = (
        "tasks the coordinator places on this node, by state in its last heartbeat reply",
        _count(node_id, "state", assigned_states),
    )
    return gauges, counted


def _gpu(index: int, node_id: str) -> Labels:
    return (("gpu", str(index)), ("node", node_id))


def _count(node_id: str, label: str, values: Iterable[str]) -> dict[Labels, float]:
    counts: dict[Labels, float] = {}
    for value in values:
        key: Labels = tuple(sorted(((label, value), ("node", node_id))))
        counts[key] = counts.get(key, 0.0) + 1
    return counts


async def serve_metrics(
    address: str, host: str, port: int, render: Callable[[], str]
) -> tuple[web.AppRunner, str]:
    """Start the scrape server; returns its runner (close with `cleanup()`) and its URL."""

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            text=render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(
            f"--metrics={address} cannot be bound ({exc.strerror}); pick a free address"
        ) from None
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, f"http://{_url_host(bound_host)}:{bound_port}/metrics"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
