"""XID accounting end to end: a real node daemon with simulated GPUs heartbeats a real
coordinator whose settings file tolerates 2 new XIDs per health batch. XIDs raised on the node
reach the replicated summary as a running total, a few within tolerance leave the node alone,
and a burst beyond it — however the node's collections split it — cordons the node."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any, TypeVar

import pytest

from shoal.local import LocalCluster, coordinator_specs, node_specs
from shoal.scheduler.health.simgpu import SimGpuBackend
from tests.support.waiting import eventually

T = TypeVar("T")
SETTINGS = """\
[balancer]
max_xid_errors = 2
[liveness]
health_period = 1.0
[scheduler]
period = 0.2
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_xids_are_totalled_and_only_a_burst_beyond_the_tolerance_cordons(tmp_path: Path) -> None:
    config = tmp_path / "coordinator.toml"
    config.write_text(SETTINGS)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    local = LocalCluster(run_dir)
    coordinators = coordinator_specs(run_dir, 1, ("--config", str(config)))
    urls = [s.api_url for s in coordinators if s.api_url]
    extra = ("--heartbeat", "0.2", "--health-period", "0.3")
    local.create(coordinators + node_specs(run_dir, urls, 1, 2, extra_args=extra))
    try:
        local.start_all()
        leader = local.wait_ready()
        local.wait_nodes(1)

        def node() -> dict[str, Any]:
            request = urllib.request.Request(
                f"{leader}/v1/nodes/n1", headers={"Authorization": f"Bearer {local.token}"}
            )
            with urllib.request.urlopen(request, timeout=5) as answer:
                return dict(json.loads(answer.read()))

        def xid_total() -> int:
            return int(node()["health"].get("summary", {}).get("xid_total", -1))

        eventually(lambda: xid_total() == 0, "a first health summary", 60)
        gpus = SimGpuBackend.attach(run_dir / "data" / "n1" / "simgpu.json")
        gpus.raise_xid(0, 13)
        gpus.raise_xid(1, 31)
        eventually(lambda: xid_total() == 2, "two XIDs in the replicated total", 60)
        # A scheduling round has seen that batch (period 0.2 s, batches every 1 s) and left
        # the node alone: 2 new XIDs are within the tolerance.
        eventually(
            lambda: node()["health"]["summary"]["xid_errors"] == 0, "the next health batch", 60
        )
        assert not node()["cordoned"]
        for code in (79, 48, 79, 79, 79):  # 5 > 2 in at most two batches: one holds >= 3
            gpus.raise_xid(1, code)
        eventually(lambda: xid_total() == 7, "seven XIDs in the replicated total", 60)
        eventually(lambda: node()["cordoned"], "the cordon", 60)
        assert node()["draining"]
    finally:
        local.stop_all()
