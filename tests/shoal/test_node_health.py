"""The node's health path with real collectors: host counters, simulated GPUs whose state file
another process can change, the clock offset against a real UDP responder, and which of DCGM
and PTP the node builds (real dcgmi/pmc stand-ins on PATH where this host has neither)."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from shoal.node import Collectors, HealthMonitor, NodeConfig, build_collectors, gpu_topology
from shoal.scheduler.health.clock import PtpCollector, serve_clock
from shoal.scheduler.health.nvml import NvmlCollector
from shoal.scheduler.health.simgpu import SimGpuBackend
from tests.scheduler.fake_sensors import fake_dcgmi, fake_pmc, set_dcgm
from tests.support.waiting import eventually_async

pytestmark = pytest.mark.timeout(60)


def test_health_has_host_gpus_clock_and_sees_an_injected_xid(tmp_path: Path) -> None:
    async def go() -> tuple[dict[str, object], dict[str, object], list[dict[str, object]]]:
        server = await serve_clock()
        config = NodeConfig(
            coordinators=("http://127.0.0.1:1",),
            data_dir=tmp_path,
            token="t",
            sim_gpus=3,
            island_size=2,
            clock=f"127.0.0.1:{server.port}",
        )
        monitor = HealthMonitor("n1", build_collectors(config))
        try:
            reports = await monitor.collect()
            first = monitor.latest()
            # a chaos process would do this against a running node's data dir
            SimGpuBackend.attach(tmp_path / "simgpu.json").raise_xid(1, 79)

            async def seen() -> bool:  # the XID watcher thread picks it up within its poll
                await monitor.collect()
                return bool(monitor.latest()["summary"]["xid_errors"])

            await eventually_async(seen, "the XID in the health summary")
            return first, monitor.latest(), gpu_topology(reports, "n1", 2, "default", True)
        finally:
            await asyncio.to_thread(monitor.close)
            server.close()

    first, after_xid, gpus = asyncio.run(go())
    assert first["unavailable"] == {}
    summary = first["summary"]
    assert isinstance(summary, dict)
    assert 0.0 <= summary["memory"] <= 1.0
    assert abs(summary["clock_offset_ms"]) < 1000.0
    assert summary["xid_errors"] == 0
    later = after_xid["summary"]
    assert isinstance(later, dict)
    assert later["xid_errors"] == 1
    assert [g["island"] for g in gpus] == ["n1/nvl0", "n1/nvl0", "n1/nvl1"]


def test_missing_sources_are_reported_not_raised(tmp_path: Path) -> None:
    config = NodeConfig(
        coordinators=("http://127.0.0.1:1",),
        data_dir=tmp_path,
        token="t",
        clock="127.0.0.1:9",  # nothing answers there
    )

    async def go() -> dict[str, object]:
        monitor = HealthMonitor("n1", build_collectors(config))
        try:
            await monitor.collect()
            return monitor.latest()
        finally:
            await asyncio.to_thread(monitor.close)

    health = asyncio.run(go())
    unavailable = health["unavailable"]
    assert isinstance(unavailable, dict)
    assert "clock" in unavailable
    assert "no clock reply" in unavailable["clock"]


def node_config(tmp_path: Path, **overrides: Any) -> NodeConfig:
    (tmp_path / "data").mkdir(exist_ok=True)
    values: dict[str, Any] = {
        "coordinators": ("http://127.0.0.1:1",),
        "data_dir": tmp_path / "data",
        "token": "t",
    }
    return NodeConfig(**{**values, **overrides})


def collect_once(collectors: Collectors) -> tuple[HealthMonitor, dict[str, Any]]:
    monitor = HealthMonitor("n1", collectors)

    async def go() -> dict[str, Any]:
        await monitor.collect()
        return monitor.latest()

    return monitor, asyncio.run(go())


def names(collectors: Collectors) -> list[str]:
    return [c.name for c in collectors.built]


@pytest.mark.skipif(
    bool(shutil.which("dcgmi") or importlib.util.find_spec("pydcgm")),
    reason="DCGM is installed here",
)
@pytest.mark.skipif(PtpCollector().collect().available, reason="ptp4l runs here")
def test_without_dcgm_and_ptp_they_are_absent_with_one_log_line_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shoal.node")
    collectors = build_collectors(node_config(tmp_path))
    monitor, health = collect_once(collectors)
    monitor.close()
    assert names(collectors) == ["host", "nvml"]
    states = health["collectors"]
    assert states["dcgm"] == {
        "state": "absent",
        "reason": "DCGM is not installed (no pydcgm module, no dcgmi on PATH)",
    }
    assert states["ptp"]["state"] == "absent"
    assert states["ptp"]["reason"].startswith(
        "pmc failed (pmc got no TIME_STATUS_NP response; is ptp4l running?); "
        if shutil.which("pmc")
        else "ptp4l is not running here (no pmc on PATH); "
    )
    assert "PTP hardware clocks: " in states["ptp"]["reason"]
    assert states["clock"] == {"state": "absent", "reason": "no --clock responder given"}
    assert states["host"]["state"] == "up"
    lines = [r.getMessage() for r in caplog.records]
    assert len([m for m in lines if m.startswith("dcgm collector absent: ")]) == 1
    assert len([m for m in lines if m.startswith("ptp collector absent: ")]) == 1


@pytest.mark.skipif(NvmlCollector().collect().available, reason="a real GPU is here")
def test_dcgm_and_ptp_are_built_where_they_answer_and_dcgm_feeds_gpu_util(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """dcgmi and pmc found on PATH, answering at the host engine and socket the node was told:
    both built, and the node's GPUs and utilisation are DCGM's."""
    tools = tmp_path / "bin"
    fake_dcgmi(tools, [37, 80], host="10.1.2.3:5555")
    fake_pmc(tools, offset_ns=900, socket="/run/ptp4l-eth1")
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    caplog.set_level(logging.INFO, logger="shoal.node")
    config = node_config(tmp_path, dcgm_host="10.1.2.3:5555", ptp_socket="/run/ptp4l-eth1")
    collectors = build_collectors(config)
    monitor, health = collect_once(collectors)
    try:
        assert names(collectors) == ["host", "nvml", "dcgm", "ptp"]
        assert health["collectors"]["dcgm"] == {"state": "up", "reason": ""}
        assert health["collectors"]["ptp"] == {"state": "up", "reason": ""}
        assert health["summary"]["gpu_util"] == pytest.approx(0.585)
        assert health["gpu_util_source"] == "dcgm"
        assert [g["index"] for g in gpu_topology(monitor.reports, "n1", 16, "d", False)] == [0, 1]
        set_dcgm(tools, utilisation=[90, 100])
        asyncio.run(monitor.collect())
        assert monitor.latest()["summary"]["gpu_util"] == pytest.approx(0.95)
    finally:
        monitor.close()
    assert "dcgm collector built" in [r.getMessage() for r in caplog.records]


def test_dcgm_is_absent_where_its_host_engine_does_not_answer_or_gpus_are_simulated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = tmp_path / "bin"
    fake_dcgmi(tools, [37], host="127.0.0.1", up=False)
    fake_pmc(tools, up=False)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    refused = build_collectors(node_config(tmp_path))
    try:
        assert names(refused) == ["host", "nvml"]
        assert "Unable to connect to host engine" in refused.absent["dcgm"]
        assert "is ptp4l running?" in refused.absent["ptp"]
    finally:
        HealthMonitor("n1", refused).close()
    set_dcgm(tools, up=True)
    simulated = build_collectors(node_config(tmp_path, sim_gpus=2))
    monitor, health = collect_once(simulated)
    monitor.close()
    assert "dcgm" not in names(simulated)
    assert health["collectors"]["dcgm"]["reason"].startswith("the node simulates its GPUs")
    assert health["gpu_util_source"] == "nvml"
