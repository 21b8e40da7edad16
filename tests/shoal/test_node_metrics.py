"""The node daemon's `/metrics` as Prometheus reads it (prometheus_client's parser): the pure
gauge builder on hand-made reports, and a real `shoal node --sim-gpus --metrics` process
heartbeating a real coordinator, with load and an XID injected through the simulated GPUs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from shoal.local import LocalCluster, coordinator_specs
from shoal.node import gpu_health, health_summary
from shoal.node_metrics import add_xids, node_gauges
from shoal.ports import free_port
from shoal.raft.client import CoordinatorClient
from shoal.raft.dashboard import node_gpus
from shoal.raft.metrics import Metrics
from shoal.scheduler.health.collector import GpuSample, Report, unavailable
from shoal.scheduler.health.simgpu import SimGpuBackend
from tests.support.waiting import eventually

HERE = Path(__file__).parent
NODE = "metrics-node"


def families(text: str) -> dict[str, list[Sample]]:
    parsed = list(text_string_to_metric_families(text))
    for family in parsed:
        assert family.documentation, family.name
        if family.type == "counter":
            assert all(s.name == family.name + "_total" for s in family.samples), family.name
    return {f.name: f.samples for f in parsed}


def by_gpu(samples: list[Sample]) -> dict[str, float]:
    for s in samples:
        assert s.labels["node"] == NODE
    return {s.labels["gpu"]: s.value for s in samples}


def _reports() -> list[Report]:
    host = Report(
        "host",
        True,
        metrics={"cpu_fraction": 0.5, "memory_total_mb": 1024.0, "load1": 2.0, "disk_free_gb": 1.5},
    )
    gpus = (
        GpuSample(0, utilisation=0.25, memory_used_mb=10, memory_total_mb=80, xid_events=(79,)),
        GpuSample(1, utilisation=None, temperature_c=61.0, power_w=300.5, ecc_uncorrected=3),
    )
    return [host, Report("nvml", True, gpus=gpus), unavailable("clock", "no responder")]


def test_gauges_use_base_units_dcgm_names_and_node_and_gpu_labels() -> None:
    totals: dict[int, int] = {}
    add_xids(totals, _reports())
    gauges, counted = node_gauges(NODE, _reports(), totals, ["rollout"], ["running", "pending"])
    metrics = Metrics()
    metrics.inc("shoal_node_heartbeats_sent_total", "sent")
    text = metrics.render(gauges, counted)
    found = families(text)
    assert found["shoal_node_memory_total_bytes"][0].value == 1024 * 1024 * 1024
    assert found["shoal_node_disk_free_bytes"][0].value == 1.5e9
    assert found["shoal_node_cpu_ratio"][0].labels == {"node": NODE}
    assert by_gpu(found["shoal_gpu_utilisation_ratio"]) == {"0": 0.25}  # GPU 1 cannot say
    assert by_gpu(found["shoal_gpu_memory_used_bytes"]) == {"0": 10 * 1024 * 1024}
    assert by_gpu(found["shoal_gpu_temperature_celsius"]) == {"1": 61.0}
    assert by_gpu(found["shoal_gpu_power_watts"]) == {"1": 300.5}
    assert by_gpu(found["shoal_gpu_xid_errors"]) == {"0": 1.0, "1": 0.0}
    assert by_gpu(found["shoal_gpu_ecc_uncorrected_errors"]) == {"1": 3.0}
    up = {s.labels["source"]: s.value for s in found["shoal_node_health_source_up"]}
    assert up == {"host": 1.0, "nvml": 1.0, "clock": 0.0}
    assert "shoal_node_clock_offset_seconds" not in found
    running = {s.labels["kind"]: s.value for s in found["shoal_node_tasks_running"]}
    assert running == {"rollout": 1.0}
    assigned = {s.labels["state"]: s.value for s in found["shoal_node_tasks_assigned"]}
    assert assigned == {"running": 1.0, "pending": 1.0}
    assert (
        "# HELP shoal_gpu_utilisation_ratio GPU utilisation 0..1, like DCGM_FI_DEV_GPU_UTIL" in text
    )
    assert "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL" in text
    assert "DCGM_FI_DEV_POWER_USAGE" in text


def test_a_gpu_nvml_and_dcgm_both_see_is_one_series_with_dcgms_utilisation() -> None:
    nvml = Report("nvml", True, gpus=(GpuSample(0, utilisation=0.1, xid_events=(79,)),))
    dcgm = Report("dcgm", True, gpus=(GpuSample(0, utilisation=0.9, xid_events=(79,)),))
    ptp = Report("ptp", True, metrics={"ptp_offset_ms": -0.5, "ptp_gm_present": 1.0})
    totals: dict[int, int] = {}
    add_xids(totals, [nvml, dcgm, ptp])
    gauges, counted = node_gauges(NODE, [nvml, dcgm, ptp], totals, [], [])
    found = families(Metrics().render(gauges, counted))
    assert by_gpu(found["shoal_gpu_utilisation_ratio"]) == {"0": 0.9}
    assert by_gpu(found["shoal_gpu_xid_errors"]) == {"0": 1.0}
    assert found["shoal_node_ptp_offset_seconds"][0].value == pytest.approx(-0.0005)


@given(st.lists(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=4), max_size=5))
def test_xid_totals_count_every_event_of_every_collection(
    collections: list[list[tuple[int, int]]],
) -> None:
    totals: dict[int, int] = {}
    for gpus in collections:
        samples = tuple(GpuSample(i, xid_events=(79,) * n) for i, n in dict(gpus).items())
        add_xids(totals, [Report("nvml", True, gpus=samples)])
    expected: dict[int, int] = {}
    for gpus in collections:
        for i, n in dict(gpus).items():
            expected[i] = expected.get(i, 0) + n
    assert totals == expected


@given(st.lists(st.floats(0, 1), min_size=0, max_size=6))
def test_the_heartbeat_health_lists_each_gpu_in_index_order(utils: list[float]) -> None:
    samples = tuple(GpuSample(i, utilisation=u) for i, u in reversed(list(enumerate(utils))))
    health = health_summary(NODE, [Report("nvml", True, gpus=samples)])
    assert [g["index"] for g in health["gpus"]] == list(range(len(utils)))
    assert [g["utilisation"] for g in health["gpus"]] == utils
    json.dumps(health, allow_nan=False)


optional = st.none() | st.floats(0, 1000, allow_nan=False)
gpu_samples = st.builds(
    GpuSample,
    index=st.integers(0, 15),
    utilisation=st.none() | st.floats(0, 1),
    memory_used_mb=st.none() | st.integers(0, 10**6),
    memory_total_mb=st.none() | st.integers(1, 10**6),
    temperature_c=optional,
    power_w=optional,
    ecc_corrected=st.none() | st.integers(0, 10**9),
    ecc_uncorrected=st.none() | st.integers(0, 10**9),
    xid_events=st.lists(st.sampled_from([13, 48, 79]), max_size=3).map(tuple),
)


@given(st.lists(gpu_samples, max_size=6, unique_by=lambda g: g.index))
def test_each_gpu_series_lists_exactly_the_gpus_that_report_it(samples: list[GpuSample]) -> None:
    reports = [Report("nvml", True, gpus=tuple(samples))]
    totals: dict[int, int] = {}
    add_xids(totals, reports)
    gauges, counted = node_gauges(NODE, reports, totals, [], [])
    found = families(Metrics().render(gauges, counted))
    expected = {str(g.index): g.utilisation for g in samples if g.utilisation is not None}
    assert by_gpu(found.get("shoal_gpu_utilisation_ratio", [])) == expected
    power = {str(g.index): g.power_w for g in samples if g.power_w is not None}
    assert by_gpu(found.get("shoal_gpu_power_watts", [])) == power
    xids = {str(g.index): float(len(g.xid_events)) for g in samples}
    assert by_gpu(found.get("shoal_gpu_xid_errors", [])) == xids


def test_unavailable_sources_give_no_gpu_entries() -> None:
    assert gpu_health([unavailable("nvml", "no NVIDIA driver")]) == []


# -- a real node daemon --------------------------------------------------------------------


@dataclass
class Daemon:
    process: subprocess.Popen[bytes]
    data_dir: Path
    log: Path

    def info(self) -> dict[str, Any]:
        path = self.data_dir / "node.json"

        def written() -> bool:
            assert self.process.poll() is None, self.log.read_text()
            return path.exists()

        eventually(written, "node.json written")
        return dict(json.loads(path.read_text()))


def node_argv(coordinators: str, data_dir: Path, token: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "shoal", "node", "--coordinators", coordinators,
        "--data-dir", str(data_dir), "--token-file", str(token), "--node-id", NODE,
        "--sim-gpus", "2", "--heartbeat", "0.2", "--health-period", "0.2", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Daemon]]:
    tmp = tmp_path_factory.mktemp("node-metrics")
    local = LocalCluster(tmp / "run")
    local.create(coordinator_specs(local.run_dir, 1))
    process: subprocess.Popen[bytes] | None = None
    try:
        local.start_all()
        local.wait_ready()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        }
        argv = node_argv(
            ",".join(local.api_urls()),
            tmp / "data",
            local.run_dir / "api-token",
            "--metrics",
            "127.0.0.1:0",
        )
        with open(tmp / "node.log", "wb") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        yield local, Daemon(process, tmp / "data", tmp / "node.log")
    finally:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        local.stop_all()


def scrape(url: str, token: str | None = None) -> tuple[str, dict[str, list[Sample]]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
        ctype = r.headers["Content-Type"]
        text = r.read().decode()
    assert "version=0.0.4" in ctype
    return text, families(text)


def scrape_until(url: str, ready: Any, token: str | None = None) -> dict[str, list[Sample]]:
    last = [""]

    def check() -> dict[str, list[Sample]] | None:
        last[0], found = scrape(url, token)
        return found if ready(found) else None

    return eventually(check, "the scrape ready", detail=lambda: f"last scrape:\n{last[0]}")


def _gpu_value(found: dict[str, list[Sample]], name: str, gpu: str) -> float | None:
    return by_gpu(found.get(name, [])).get(gpu)


@pytest.mark.timeout(120)
def test_a_node_daemon_serves_node_gpu_task_and_heartbeat_metrics(
    cluster: tuple[LocalCluster, Daemon],
) -> None:
    local, daemon = cluster
    url = daemon.info()["metrics"]
    assert url.startswith("http://127.0.0.1:")
    assert url.endswith("/metrics")
    sim = SimGpuBackend.attach(daemon.data_dir / "simgpu.json")
    sim.set_load(1, 0.6, memory_fraction=0.5)
    sim.raise_xid(0, 79, ecc_uncorrected=2)
    task = {"task_id": "metrics-echo", "kind": "rollout", "actor": "test_node_tasks:Echo"}

    async def place() -> None:
        async with CoordinatorClient(local.api_urls(), local.token) as client:
            await client.submit_job(
                spec={"test": True, "placement": "manual"}, tasks=[task], job_id="metrics-job"
            )
            await client.place_tasks({"metrics-echo": NODE})

    asyncio.run(place())
    found = scrape_until(
        url,
        lambda f: (
            _gpu_value(f, "shoal_gpu_xid_errors", "0") == 1.0
            and _gpu_value(f, "shoal_gpu_utilisation_ratio", "1") == 0.6
            and f.get("shoal_node_tasks_running")
        ),
    )
    assert found["shoal_node_heartbeats_sent"][0].value >= 1
    latency = {s.name: s.value for s in found["shoal_node_heartbeat_seconds"]}
    assert latency["shoal_node_heartbeat_seconds_count"] >= 1
    assert latency["shoal_node_heartbeat_seconds_sum"] > 0
    assert by_gpu(found["shoal_gpu_utilisation_ratio"]) == {"0": 0.0, "1": 0.6}
    assert by_gpu(found["shoal_gpu_ecc_uncorrected_errors"])["0"] == 2.0
    used = by_gpu(found["shoal_gpu_memory_used_bytes"])
    total = by_gpu(found["shoal_gpu_memory_total_bytes"])
    assert used["1"] == pytest.approx(total["1"] / 2, rel=0.01)
    assert {"shoal_gpu_temperature_celsius", "shoal_gpu_power_watts"} <= set(found)
    assert 0.0 <= found["shoal_node_cpu_ratio"][0].value <= 1.0
    assert found["shoal_node_memory_total_bytes"][0].value > 0
    assert {s.labels["kind"]: s.value for s in found["shoal_node_tasks_running"]} == {
        "rollout": 1.0
    }

    # the heartbeat carries each GPU, so the coordinator (and its dashboard) sees GPU 1 busy
    coordinator = scrape_until(
        local.api_urls()[0] + "/metrics",
        lambda f: _gpu_value(f, "shoal_gpu_utilisation_ratio", "1") == 0.6,
        local.token,
    )
    assert by_gpu(coordinator["shoal_gpu_utilisation_ratio"]) == {"0": 0.0, "1": 0.6}

    async def node_record() -> dict[str, Any]:
        async with CoordinatorClient(local.api_urls(), local.token) as client:
            return await client.node(NODE)

    heat = node_gpus(asyncio.run(node_record()))  # what the dashboard's heat map draws
    assert [(g["index"], g["util"]) for g in heat] == [(0, 0.0), (1, 0.6)]

    # with the only replica gone, failed heartbeats are counted by error
    local.stop("c1")
    found = scrape_until(url, lambda f: f.get("shoal_node_heartbeats_failed"))
    failed = found["shoal_node_heartbeats_failed"]
    assert sum(s.value for s in failed) >= 1
    assert all(s.labels["error"] for s in failed)


def _run_node(tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    token = tmp / "token"
    token.write_text("t" * 20)
    token.chmod(0o600)
    argv = node_argv(f"http://127.0.0.1:{free_port()}", tmp / "data", token, *extra)
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", ["nowhere", "127.0.0.1:99999", ":80"])
def test_a_malformed_metrics_address_is_one_line(tmp_path: Path, value: str) -> None:
    done = _run_node(tmp_path, "--metrics", value)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"shoal: error: --metrics={value!r} is invalid: use HOST:PORT with a port in 0..65535"
    ]


@pytest.mark.timeout(120)
def test_a_metrics_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _run_node(tmp_path, "--metrics", f"127.0.0.1:{port}")
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"shoal: error: --metrics=127.0.0.1:{port} cannot be bound")
    assert "Traceback" not in done.stderr
