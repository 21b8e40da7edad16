"""The node's health path with real collectors: host counters, simulated GPUs whose state file
another process can change, and the clock offset against a real UDP responder."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from shoal.node import HealthMonitor, NodeConfig, build_collectors, gpu_topology
from shoal.scheduler.health.clock import serve_clock
from shoal.scheduler.health.simgpu import SimGpuBackend

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
            for _ in range(100):  # the XID watcher thread picks the event up within its poll
                await monitor.collect()
                if monitor.latest()["summary"]["xid_errors"]:
                    break
                await asyncio.sleep(0.05)
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
