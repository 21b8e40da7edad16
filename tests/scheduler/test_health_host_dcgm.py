"""Host counters from /proc, and DCGM's text output parsed from samples in its documented format."""

from __future__ import annotations

import shutil

import pytest

from shoal.scheduler.errors import HealthError
from shoal.scheduler.health.collector import summarise
from shoal.scheduler.health.dcgm import (
    GPU_UTIL,
    XID_ERRORS,
    DcgmCollector,
    parse_dmon,
    parse_health,
    report_from,
)
from shoal.scheduler.health.host import (
    CpuTimes,
    HostCollector,
    cpu_fraction,
    parse_meminfo,
    parse_proc_stat,
)
from shoal.scheduler.health.xids import XidLedger
from tests.scheduler.fake_sensors import fake_dcgmi, set_dcgm

PROC_STAT = """\
cpu  4705 356 584 3699 23 23 0 0 0 0
cpu0 1393280 32966 572056 13343292 6130 0 17875 0 23933 0
intr 114930548 113199788 3 0 5 263 0 4 [... lots more numbers ...]
ctxt 1990473
"""

MEMINFO = """\
MemTotal:       16344972 kB
MemFree:          424788 kB
MemAvailable:    8172972 kB
Buffers:          219456 kB
HugePages_Total:       0
"""

DMON = """\
#Entity   GPUTL  XIDER
ID
GPU 0     37     0
GPU 1     N/A    0
GPU 2     100    79
Switch 0  0      0
"""

HEALTHY = """\
+---------------------------+----------------------------------------------------------+
| Health Monitor Report                                                                |
+===========================+==========================================================+
| Overall Health            | Healthy                                                  |
+---------------------------+----------------------------------------------------------+
"""

WARNING = """\
+---------------------------+----------------------------------------------------------+
| Health Monitor Report                                                                |
+===========================+==========================================================+
| Overall Health            | Warning                                                  |
| GPU ID: 0                 | Warning                                                  |
|                           | PCIe system: Warning - Detected more than 8 PCIe         |
|                           | replays per minute for GPU 0: 13                         |
| GPU ID: 3                 | Failure                                                  |
|                           | Memory system: Failure - A double-bit ECC error was      |
|                           | detected on GPU 3                                        |
+---------------------------+----------------------------------------------------------+
"""


def test_parse_proc_stat_counts_iowait_as_idle():
    times = parse_proc_stat(PROC_STAT)
    assert times == CpuTimes(busy=4705 + 356 + 584 + 23, total=4705 + 356 + 584 + 3699 + 23 + 23)


def test_cpu_fraction_between_two_readings():
    assert cpu_fraction(CpuTimes(100, 1000), CpuTimes(400, 2000)) == pytest.approx(0.3)
    assert cpu_fraction(CpuTimes(100, 1000), CpuTimes(100, 1000)) == 0.0


def test_parse_meminfo():
    assert parse_meminfo(MEMINFO) == (16344972, 8172972)


def test_malformed_proc_files_are_named():
    with pytest.raises(HealthError, match="no aggregate 'cpu' line"):
        parse_proc_stat("intr 1 2 3\n")
    with pytest.raises(HealthError, match="lacks MemTotal or MemAvailable"):
        parse_meminfo("MemTotal: 10 kB\n")


def test_host_collector_reads_this_machine():
    collector = HostCollector()
    collector.collect()
    report = collector.collect()
    m = report.metrics
    assert report.available
    assert 0.0 <= m["cpu_fraction"] <= 1.0
    assert 0.0 < m["memory_fraction"] < 1.0
    assert m["memory_total_mb"] > m["memory_available_mb"] > 0
    assert 0.0 <= m["disk_fraction"] <= 1.0
    assert m["load1"] >= 0.0


def test_host_collector_reports_unreadable_proc(tmp_path):
    (tmp_path / "stat").write_text("garbage\n")
    (tmp_path / "meminfo").write_text(MEMINFO)
    report = HostCollector(proc=tmp_path).collect()
    assert not report.available
    assert "no aggregate 'cpu' line" in report.reason
    assert not HostCollector(proc=tmp_path / "nowhere").collect().available


def test_parse_dmon_keeps_gpus_and_marks_missing_values():
    values = parse_dmon(DMON)
    assert values == {
        0: {203: 37.0, 230: 0.0},
        1: {203: None, 230: 0.0},
        2: {203: 100.0, 230: 79.0},
    }


def test_parse_dmon_rejects_malformed_output():
    with pytest.raises(HealthError, match="no '#Entity' header"):
        parse_dmon("Error: unable to connect to host engine\n")
    with pytest.raises(HealthError, match="has 1 values for 2 fields"):
        parse_dmon("#Entity GPUTL XIDER\nGPU 0 37\n")
    with pytest.raises(HealthError, match="'abc' is not a number"):
        parse_dmon("#Entity GPUTL XIDER\nGPU 0 abc 0\n")


def test_parse_health_reads_verdicts_and_wrapped_messages():
    assert parse_health(HEALTHY).healthy
    check = parse_health(WARNING)
    assert not check.healthy
    assert check.overall == "Warning"
    assert check.gpus[0] == (
        "Warning",
        ("PCIe system: Warning - Detected more than 8 PCIe replays per minute for GPU 0: 13",),
    )
    assert check.gpus[3][0] == "Failure"
    assert check.gpus[3][1] == (
        "Memory system: Failure - A double-bit ECC error was detected on GPU 3",
    )
    with pytest.raises(HealthError, match="no 'Overall Health' row"):
        parse_health("Error: no watches\n")


def test_report_from_dcgm_values_and_health():
    xids = XidLedger()
    report = report_from("dcgm", parse_dmon(DMON), parse_health(WARNING), xids)
    assert [g.utilisation for g in report.gpus] == [0.37, None, 1.0]
    # The first sample is the baseline: an XID from before the node started is not new.
    assert [g.xid_events for g in report.gpus] == [(), (), ()]
    assert [(g.xid_total, g.xid_last) for g in report.gpus] == [(0, None), (0, None), (0, 79)]
    assert report.metrics["dcgm_healthy"] == 0.0
    assert report.reason.startswith("DCGM health Warning: GPU 0: Warning (PCIe system")


def test_dcgm_counts_each_change_of_the_last_xid_field_once():
    xids = XidLedger()
    samples = [(0, 0), (0, 0), (79, 0), (79, 0), (48, 0), (48, 13), (48, 13), (79, 13)]
    reports = []
    for gpu0, gpu1 in samples:
        values = {0: {GPU_UTIL: 50.0, XID_ERRORS: float(gpu0)}, 1: {XID_ERRORS: float(gpu1)}}
        reports.append(report_from("dcgm", values, None, xids))
    assert [r.gpus[0].xid_events for r in reports] == [(), (), (79,), (), (48,), (), (), (79,)]
    assert [r.gpus[1].xid_events for r in reports] == [(), (), (), (), (), (13,), (), ()]
    last = summarise("n", reports[-1:])
    assert (last.xid_total, last.xid_errors) == (4, 1)
    assert [(g.xid_total, g.xid_last) for g in reports[-1].gpus] == [(3, 79), (1, 13)]


@pytest.mark.skipif(shutil.which("dcgmi") is not None, reason="DCGM is installed here")
def test_dcgm_collector_says_dcgm_is_missing():
    collector = DcgmCollector()
    try:
        report = collector.collect()
    finally:
        collector.close()
    assert not report.available
    assert report.reason == (
        "unavailable: DCGM is not installed (no pydcgm module, no dcgmi on PATH)"
    )


def test_dcgmi_is_asked_at_the_host_engine_it_was_given(tmp_path):
    """The CLI path through a real child process: `--host` reaches dcgmi, its output is parsed
    as DCGM prints it, and a host engine that does not answer is an unavailable report."""
    dcgmi = fake_dcgmi(tmp_path, [37, 80], host="10.0.0.7:5555")
    collector = DcgmCollector(dcgmi=str(dcgmi), host="10.0.0.7:5555")
    try:
        report = collector.collect()
        assert report.available
        assert [g.utilisation for g in report.gpus] == [0.37, 0.8]
        assert report.metrics["dcgm_healthy"] == 1.0
        set_dcgm(tmp_path, utilisation=[5, 6])
        assert [g.utilisation for g in collector.collect().gpus] == [0.05, 0.06]
        set_dcgm(tmp_path, up=False)
        down = collector.collect()
    finally:
        collector.close()
    assert not down.available
    assert "Unable to connect to host engine" in down.reason
    elsewhere = DcgmCollector(dcgmi=str(dcgmi)).collect()  # the default, 127.0.0.1
    assert not elsewhere.available
