"""Clock offset: the four-timestamp maths, a real UDP exchange on 127.0.0.1, and ptp4l's pmc."""

from __future__ import annotations

import asyncio
import shutil
import socket
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.scheduler.errors import HealthError
from shoal.scheduler.health.clock import (
    CHAOS_CLOCK_ENV,
    ClockCollector,
    ClockSample,
    OffsetClock,
    PtpCollector,
    best,
    chaos_clock,
    measure,
    offset_delay,
    parse_pmc_time_status,
    ptp_devices,
    serve_clock,
)
from tests.scheduler.fake_sensors import fake_pmc

PMC = """\
sending: GET TIME_STATUS_NP
\t90e2ba.fffe.20c7f8-0 seq 0 RESPONSE MANAGEMENT TIME_STATUS_NP
\t\tmaster_offset              -1327
\t\tingress_time               1453386409735441914
\t\tcumulativeScaledRateOffset +0.000000000
\t\tscaledLastGmPhaseChange    0
\t\tgmTimeBaseIndicator        0
\t\tlastGmPhaseChange          0x0000'0000000000000000.0000
\t\tgmPresent                  true
\t\tgmIdentity                 001b21.fffe.6fa06b
"""

micros = st.integers(0, 5_000_000)


@given(
    t0=st.integers(0, 10**15),
    theta=st.integers(-(10**8), 10**8),
    out=micros,
    back=micros,
    work=micros,
)
def test_true_offset_lies_within_the_reported_bound(t0, theta, out, back, work):
    """Timestamps built in whole microseconds (exact), converted to seconds once."""
    t1 = t0 + out + theta  # server clock = client clock + theta
    t2 = t1 + work
    t3 = t2 - theta + back
    s = offset_delay(t0 / 1e6, t1 / 1e6, t2 / 1e6, t3 / 1e6)
    assert s.delay_s == pytest.approx((out + back) / 1e6, abs=1e-3)
    assert abs(s.offset_s - theta / 1e6) <= s.error_s + 1e-3


def test_symmetric_paths_give_the_exact_offset():
    s = offset_delay(10.0, 12.5, 12.6, 10.3)
    assert s.offset_s == pytest.approx(2.4)
    assert s.delay_s == pytest.approx(0.2)
    assert s.error_s == pytest.approx(0.1)


def test_best_picks_the_least_delay_and_bad_stamps_are_refused():
    assert best([ClockSample(1.0, 0.3), ClockSample(2.0, 0.1)]) == ClockSample(2.0, 0.1)
    with pytest.raises(HealthError, match="no clock samples"):
        best([])
    with pytest.raises(HealthError, match="reply stamped before its request"):
        offset_delay(5.0, 0.0, 0.0, 4.0)
    with pytest.raises(HealthError, match="server replied before receiving"):
        offset_delay(0.0, 2.0, 1.0, 4.0)


async def _skewed_exchange():
    server = await serve_clock(clock=lambda: time.time() + 0.25)
    try:
        s = await asyncio.to_thread(measure, "127.0.0.1", server.port, 8, 2.0)
        report = await asyncio.to_thread(ClockCollector("127.0.0.1", server.port).collect)
    finally:
        server.close()
    return s, report


@pytest.mark.timeout(30)
def test_udp_exchange_measures_a_skewed_server_clock():
    s, report = asyncio.run(_skewed_exchange())
    assert abs(s.offset_s - 0.25) <= s.error_s + 0.01
    assert report.available
    m = report.metrics
    assert abs(m["offset_ms"] - 250.0) <= m["error_ms"] + 1.0
    assert report.metrics["delay_ms"] >= 0.0


async def _exchange_after_garbage():
    server = await serve_clock()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.sendto(b"garbage", ("127.0.0.1", server.port))
            sock.sendto(b"SHCK" + b"\x00" * 40, ("127.0.0.1", server.port))
        s = await asyncio.to_thread(measure, "127.0.0.1", server.port, 3, 2.0)
        return s, server.bad_packets
    finally:
        server.close()


@pytest.mark.timeout(30)
def test_responder_survives_malformed_datagrams():
    s, bad = asyncio.run(_exchange_after_garbage())
    assert bad == 2
    assert abs(s.offset_s) <= s.error_s + 0.01


@pytest.mark.timeout(30)
def test_no_responder_is_a_clear_error():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound but never answering
        with pytest.raises(HealthError, match=f"no clock reply from 127.0.0.1:{port} in 2 tries"):
            measure("127.0.0.1", port, samples=2, timeout_s=0.2)
        report = ClockCollector("127.0.0.1", port, samples=1, timeout_s=0.2).collect()
    assert not report.available
    assert "is the coordinator's clock responder running?" in report.reason
    with pytest.raises(HealthError, match="samples must be >= 1"):
        measure("127.0.0.1", port, samples=0)


def test_parse_pmc_time_status():
    assert parse_pmc_time_status(PMC) == (-1327.0, True)
    with pytest.raises(HealthError, match="no TIME_STATUS_NP response"):
        parse_pmc_time_status("sending: GET TIME_STATUS_NP\n")
    with pytest.raises(HealthError, match="lacks master_offset"):
        parse_pmc_time_status("RESPONSE MANAGEMENT TIME_STATUS_NP\n")


@pytest.mark.skipif(shutil.which("pmc") is not None, reason="linuxptp is installed here")
def test_ptp_collector_without_linuxptp():
    report = PtpCollector().collect()
    assert not report.available
    assert report.reason == "unavailable: ptp4l is not running here (no pmc on PATH)"


@given(offset=st.floats(-1e6, 1e6, allow_nan=False))
def test_offset_clock_adds_the_file_offset(tmp_path_factory, offset):
    path = tmp_path_factory.mktemp("clock") / "offset"
    path.write_text(repr(offset))
    clock = OffsetClock(path, refresh=0.0)
    assert clock.offset() == offset
    before = time.time()
    stamped = clock()
    assert before + offset - 1.0 <= stamped <= time.time() + offset + 1.0


def test_offset_clock_reads_a_missing_or_garbled_file_as_true_time(tmp_path):
    clock = OffsetClock(tmp_path / "none", refresh=0.0)
    assert clock.offset() == 0.0
    (tmp_path / "none").write_text("two seconds")
    assert clock.offset() == 0.0
    (tmp_path / "none").write_text("2.5")
    assert clock.offset() == 2.5


def test_offset_clock_rereads_only_after_refresh(tmp_path):
    path = tmp_path / "offset"
    path.write_text("1.0")
    clock = OffsetClock(path, refresh=3600.0)
    assert clock.offset() == 1.0
    path.write_text("5.0")
    assert clock.offset() == 1.0  # cached: stamping an exchange costs no file read


def test_chaos_clock_is_true_time_unless_the_hook_is_set(tmp_path):
    assert chaos_clock({}) is time.time
    assert chaos_clock({CHAOS_CLOCK_ENV: ""}) is time.time
    hooked = chaos_clock({CHAOS_CLOCK_ENV: str(tmp_path / "offset")})
    assert isinstance(hooked, OffsetClock)
    assert hooked.path == Path(tmp_path / "offset")


async def _collect_with_a_skewed_client(offset_file: Path):
    server = await serve_clock()
    try:
        collector = ClockCollector("127.0.0.1", server.port, clock=OffsetClock(offset_file))
        return await asyncio.to_thread(collector.collect)
    finally:
        server.close()


@pytest.mark.timeout(30)
def test_collector_stamps_its_side_with_the_given_clock(tmp_path):
    """A client clock 2.5 s ahead: the server's clock minus the client's is -2.5 s."""
    (tmp_path / "offset").write_text("2.5")
    report = asyncio.run(_collect_with_a_skewed_client(tmp_path / "offset"))
    assert report.available
    m = report.metrics
    assert abs(m["offset_ms"] + 2500.0) <= m["error_ms"] + 1.0


def test_ptp_collector_reads_ptp4l_on_the_socket_it_was_given(tmp_path):
    """pmc as a real child process: `-s` names ptp4l's socket; without a ptp4l answering
    there, pmc prints only its request and the report says ptp4l is not running."""
    pmc = fake_pmc(tmp_path, offset_ns=-2500, socket="/run/ptp4l-eth1")
    report = PtpCollector(pmc=str(pmc), uds="/run/ptp4l-eth1").collect()
    assert report.available
    assert report.metrics == {"ptp_offset_ms": -0.0025, "ptp_gm_present": 1.0}
    default = PtpCollector(pmc=str(pmc)).collect()
    assert not default.available
    assert "is ptp4l running?" in default.reason


def test_ptp_devices_lists_the_hardware_clocks(tmp_path):
    for name in ("ptp0", "ptp1", "ptpx", "pts"):
        (tmp_path / name).touch()
    assert ptp_devices(tmp_path) == [str(tmp_path / "ptp0"), str(tmp_path / "ptp1")]
    assert ptp_devices(tmp_path / "missing") == []
