"""The PTP collector against a real ptp4l, and the node building it.

A grandmaster and a slave ptp4l on the two ends of a veth pair inside a private network namespace
(`unshare --net`, so the host's interfaces are untouched) talk PTP over Ethernet with software
timestamps; the slave runs free (`free_running 1`) and the master only serves time, so neither
adjusts the host's clock. The collector reads the slave through its Unix socket as on a real PTP
host. Skips where linuxptp (`apt install linuxptp`), unshare or root are missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.node import HealthMonitor, NodeConfig, build_collectors
from shoal.scheduler.health.clock import PtpCollector
from shoal.scheduler.health.collector import Report
from tests.support.waiting import eventually

PTP4L, PMC, UNSHARE = shutil.which("ptp4l"), shutil.which("pmc"), shutil.which("unshare")

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not (PTP4L and PMC and UNSHARE) or os.geteuid() != 0,
        reason="needs linuxptp's ptp4l and pmc (apt install linuxptp), unshare and root",
    ),
]


@pytest.fixture
def ptp4l(tmp_path: Path) -> Iterator[str]:
    """The slave ptp4l's socket, once both run; both are stopped afterwards."""
    socket = tmp_path / "ptp4l-slave"
    script = f"""
        ip link set lo up
        ip link add veth0 type veth peer name veth1
        ip link set veth0 up && ip link set veth1 up
        {PTP4L} -2 -S -q -m -i veth0 --uds_address={tmp_path}/ptp4l-master \
            --logAnnounceInterval=-2 --announceReceiptTimeout=2 &
        exec {PTP4L} -2 -S -q -m -s -i veth1 --free_running=1 --uds_address={socket}
    """
    with open(tmp_path / "ptp4l.log", "wb") as log:
        process = subprocess.Popen(
            [str(UNSHARE), "--net", "sh", "-c", script],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        yield str(socket)
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        process.wait(timeout=30)


def synchronised(collector: PtpCollector) -> Report | None:
    """The collector's report once the slave follows a grandmaster, else None."""
    report = collector.collect()
    return report if report.available and report.metrics["ptp_gm_present"] == 1.0 else None


def test_the_collector_reads_a_real_ptp4l_slaves_offset(ptp4l: str) -> None:
    report = eventually(lambda: synchronised(PtpCollector(uds=ptp4l)), "the slave sees its master")
    # One host's clock on both ends: the offset is measurement noise, far below a second.
    assert abs(report.metrics["ptp_offset_ms"]) < 1000.0
    assert PtpCollector(uds=f"{ptp4l}-nobody").collect().reason == (
        "unavailable: pmc failed (pmc got no TIME_STATUS_NP response; is ptp4l running?)"
    )


def test_the_node_builds_the_ptp_collector_where_ptp4l_answers(ptp4l: str, tmp_path: Path) -> None:
    eventually(lambda: synchronised(PtpCollector(uds=ptp4l)), "the slave sees its master")
    (tmp_path / "data").mkdir()
    config = NodeConfig(
        coordinators=("http://127.0.0.1:1",),
        data_dir=tmp_path / "data",
        token="t",
        ptp_socket=ptp4l,
    )
    collectors = build_collectors(config)
    try:
        assert "ptp" in [c.name for c in collectors.built]
        assert "ptp" not in collectors.absent
    finally:
        HealthMonitor("n1", collectors).close()
