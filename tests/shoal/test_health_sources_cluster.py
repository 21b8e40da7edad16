"""Which health collectors real node daemons built, end to end: a coordinator and two `shoal node`
processes, one whose host has DCGM and PTP (dcgmi and pmc stand-ins on its PATH, answering at
the --dcgm-host and --ptp-socket it was given), one whose host engine and ptp4l do not answer.
Their states reach the API, the dashboard's view and `shoal status`; DCGM's GPU utilisation is
the node's replicated `gpu_util`, the number the balancer reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shoal.local import LocalCluster, coordinator_specs, node_specs
from tests.scheduler.fake_sensors import fake_dcgmi, fake_pmc, set_dcgm
from tests.support.waiting import eventually

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

HOST_ENGINE = "127.0.0.1:5599"
PTP_SOCKET = "/run/shoal-test-ptp4l"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Path]]:
    tmp = tmp_path_factory.mktemp("sensors")
    with_sensors, without = tmp / "bin-n1", tmp / "bin-n2"
    fake_dcgmi(with_sensors, [37, 80], host=HOST_ENGINE)
    fake_pmc(with_sensors, offset_ns=1500, socket=PTP_SOCKET)
    fake_dcgmi(without, [0], host=HOST_ENGINE, up=False)
    fake_pmc(without, up=False)
    local = LocalCluster(tmp / "run")
    coordinators = coordinator_specs(local.run_dir, 1)
    urls = [s.api_url for s in coordinators if s.api_url]
    args = ("--heartbeat", "0.3", "--health-period", "0.5")
    args += ("--dcgm-host", HOST_ENGINE, "--ptp-socket", PTP_SOCKET)
    n1, n2 = node_specs(local.run_dir, urls, 2, 0, extra_args=args)
    nodes = [
        replace(spec, env={"PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"})
        for spec, tools in ((n1, with_sensors), (n2, without))
    ]
    local.create([*coordinators, *nodes])
    try:
        local.start_all()
        local.wait_ready()
        local.wait_nodes(2, timeout=120)
        yield local, with_sensors
    finally:
        local.stop_all()


def node_health(local: LocalCluster) -> dict[str, dict[str, Any]]:
    listed = local.get(f"{local.api_urls()[0]}/v1/nodes")["nodes"]
    return {n["id"]: n["health"] for n in listed}


def collectors_reported(local: LocalCluster) -> dict[str, dict[str, Any]] | None:
    health = node_health(local)
    return health if all(h.get("collectors") for h in health.values()) else None


def test_collector_presence_reaches_the_api_and_dashboard(
    cluster: tuple[LocalCluster, Path],
) -> None:
    local, _ = cluster
    health = eventually(lambda: collectors_reported(local), "both nodes report their collectors")
    n1, n2 = health["n1"]["collectors"], health["n2"]["collectors"]
    assert n1["dcgm"] == {"state": "up", "reason": ""}
    assert n1["ptp"] == {"state": "up", "reason": ""}
    assert n1["host"]["state"] == "up"
    assert n1["clock"] == {"state": "absent", "reason": "no --clock responder given"}
    assert n2["dcgm"]["state"] == "absent"
    assert (
        f"unable to establish a connection to the specified host: {HOST_ENGINE}"
        in (n2["dcgm"]["reason"])
    )
    assert n2["ptp"]["state"] == "absent"
    assert "is ptp4l running?" in n2["ptp"]["reason"]
    assert health["n1"]["gpu_util_source"] == "dcgm"
    view = local.get(f"{local.api_urls()[0]}/v1/dashboard")
    shown = {n["id"]: n for n in view["nodes"]}
    assert shown["n1"]["collectors"]["dcgm"]["state"] == "up"
    assert shown["n1"]["gpu_util_source"] == "dcgm"
    assert shown["n2"]["collectors"]["ptp"]["state"] == "absent"
    gpus = {n["id"]: n["resources"]["gpus"] for n in view["nodes"]}
    assert [g["index"] for g in gpus["n1"]] == [0, 1]  # DCGM's GPUs (no NVML driver here)


def test_dcgm_utilisation_is_the_replicated_gpu_util(cluster: tuple[LocalCluster, Path]) -> None:
    local, tools = cluster

    def util() -> float | None:
        summary = node_health(local)["n1"].get("summary") or {}
        return summary.get("gpu_util")

    assert eventually(lambda: util() == pytest.approx(0.585), "gpu_util = DCGM's mean 0.585")
    set_dcgm(tools, utilisation=[96, 100])
    assert eventually(lambda: util() == pytest.approx(0.98), "gpu_util follows DCGM to 0.98")


def test_shoal_status_prints_each_nodes_collectors(cluster: tuple[LocalCluster, Path]) -> None:
    local, _ = cluster
    eventually(lambda: collectors_reported(local), "both nodes report their collectors")
    argv = [sys.executable, "-m", "shoal", "status", "--run-dir", str(local.run_dir)]
    text = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout
    lines = text.splitlines()
    n1 = lines[lines.index(next(ln for ln in lines if ln.startswith("  n1 "))) + 1]
    n2 = lines[lines.index(next(ln for ln in lines if ln.startswith("  n2 "))) + 1]
    assert n1.startswith("    health: host up, nvml ")
    assert "dcgm up, ptp up, clock absent (no --clock responder given)" in n1
    assert n1.endswith("; GPU utilisation from dcgm")
    assert "dcgm absent (dcgmi failed (" in n2
    assert (
        "ptp absent (pmc failed (pmc got no TIME_STATUS_NP response; is ptp4l running?); "
        "PTP hardware clocks: "
    ) in n2
    as_json = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=60)
    rows = {n["id"]: n for n in json.loads(as_json.stdout)["nodes"]}
    assert rows["n1"]["collectors"]["dcgm"]["state"] == "up"
    assert rows["n2"]["collectors"]["dcgm"]["state"] == "absent"
