"""NVML collector: its parsing, its unavailability here, and its real code paths (XID event
thread included) driven by the simulated GPU backend, in process and across processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.scheduler.balancer import balance
from shoal.scheduler.errors import HealthError
from shoal.scheduler.health.collector import GpuSample, Report, summarise
from shoal.scheduler.health.nvml import NvmlCollector, init_failure_reason, parse_sample
from shoal.scheduler.health.simgpu import SimGpuBackend, gpu_collector
from shoal.scheduler.health.xids import XidCount, XidLedger
from shoal.scheduler.model import BalancerState, LearnerGroup, RolloutActor
from shoal.scheduler.placement import place
from shoal.scheduler.topology import simulated_cluster
from tests.support.waiting import eventually

MIB = 1024 * 1024


def _nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def _collect_until(collector, check) -> list[Report]:
    """Collect repeatedly until `check(reports)` holds; XIDs arrive through a thread."""
    reports: list[Report] = []

    def met() -> bool:
        reports.append(collector.collect())
        return bool(check(reports))

    eventually(met, "the collected reports meet the condition", detail=lambda: str(reports[-1]))
    return reports


def _xids(reports: list[Report]) -> list[tuple[int, int]]:
    return [(g.index, x) for r in reports for g in r.gpus for x in g.xid_events]


@pytest.fixture
def sim_collector():
    collector = NvmlCollector(SimGpuBackend(4, nvlink_group=16), xid_poll_ms=50)
    try:
        yield collector
    finally:
        collector.close()


def test_real_nvml_reports_why_it_is_unavailable_or_reports_the_gpus():
    collector = NvmlCollector()
    try:
        report = collector.collect()
    finally:
        collector.close()
    if _nvml_works():
        assert report.available
        assert report.gpus
    else:
        assert not report.available
        assert report.reason.startswith("unavailable: no NVIDIA driver (NVMLError_")
        assert report.gpus == ()


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "no NVIDIA driver (NVMLError_LibraryNotFound)"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "no NVIDIA driver (NVMLError_DriverNotLoaded)"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "no permission to open the NVIDIA device files"),
        (pynvml.NVML_ERROR_UNKNOWN, "NVML failed to initialise (NVMLError_Unknown"),
    ],
)
def test_init_failures_are_named(code, words):
    assert init_failure_reason(pynvml.NVMLError(code)).startswith(words)


def test_parse_sample_converts_units_and_counts_new_ecc_errors():
    raw = {
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": "GPU-1234",
        "gpu_percent": 87,
        "memory_used_bytes": 40 * 1024 * MIB,
        "memory_total_bytes": 80 * 1024 * MIB,
        "temperature_c": 71,
        "power_mw": 512_345,
        "ecc_corrected": 12,
        "ecc_uncorrected": 3,
        "nvlink_states": [1] * 17 + [0],
    }
    s = parse_sample(5, raw, xids=XidCount(4, 79, (48, 79)), previous_uncorrected=1)
    assert s.index == 5
    assert s.name == "NVIDIA H100 80GB HBM3"
    assert s.utilisation == pytest.approx(0.87)
    assert (s.memory_used_mb, s.memory_total_mb) == (40 * 1024, 80 * 1024)
    assert s.memory_fraction == pytest.approx(0.5)
    assert s.power_w == pytest.approx(512.345)
    assert s.ecc_uncorrected_new == 2
    assert (s.nvlinks_up, s.nvlinks_total) == (17, 18)
    assert (s.xid_events, s.xid_total, s.xid_last) == ((48, 79), 4, 79)
    # first reading: nothing is "new"; a counter that went down was reset by the driver
    assert parse_sample(0, raw).ecc_uncorrected_new == 0
    assert parse_sample(0, raw, previous_uncorrected=9).ecc_uncorrected_new == 3


def test_parse_sample_keeps_unsupported_fields_as_none():
    s = parse_sample(0, {"gpu_percent": None, "power_mw": None, "nvlink_states": []})
    assert s.utilisation is None
    assert s.power_w is None
    assert s.memory_fraction is None
    assert (s.nvlinks_up, s.nvlinks_total, s.ecc_uncorrected_new) == (0, 0, 0)


def test_simulated_gpus_through_the_nvml_code_path(sim_collector):
    backend = sim_collector._nvml
    backend.set_load(1, 0.75, memory_fraction=0.5)
    report = sim_collector.collect()
    assert report.available
    assert report.reason == ""
    assert [g.index for g in report.gpus] == [0, 1, 2, 3]
    g1 = report.gpus[1]
    assert g1.utilisation == pytest.approx(0.75)
    assert g1.memory_fraction == pytest.approx(0.5)
    assert g1.temperature_c > report.gpus[0].temperature_c
    assert (g1.nvlinks_up, g1.nvlinks_total) == (15, 15)
    backend.set_nvlinks_down(2, 3)
    assert sim_collector.collect().gpus[2].nvlinks_up == 12


@pytest.mark.timeout(30)
def test_xid_event_arrives_through_the_event_thread(sim_collector):
    sim_collector._nvml.raise_xid(3, 79)
    reports = _collect_until(sim_collector, lambda rs: _xids(rs))
    assert _xids(reports) == [(3, 79)]
    after = sim_collector.collect().gpus[3]
    assert after.xid_events == ()  # delivered once
    assert (after.xid_total, after.xid_last) == (1, 79)  # and counted for good


@pytest.mark.timeout(30)
def test_a_burst_between_two_collections_is_counted_in_full(sim_collector):
    for code in (79, 48, 79, 13, 79):
        sim_collector._nvml.raise_xid(1, code)
    sim_collector._nvml.raise_xid(2, 31)
    reports = _collect_until(sim_collector, lambda rs: len(_xids(rs)) == 6)
    assert sorted(_xids(reports)) == sorted([(1, 79), (1, 48), (1, 79), (1, 13), (1, 79), (2, 31)])
    last = sim_collector.collect()
    assert [(g.xid_total, g.xid_last) for g in last.gpus] == [
        (0, None),
        (5, 79),
        (1, 31),
        (0, None),
    ]
    assert summarise("n", [last]).xid_total == 6
    assert sum(summarise("n", [r]).xid_errors for r in reports) == 6


@settings(deadline=None, max_examples=50)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("xid"), st.integers(0, 3), st.sampled_from([13, 31, 48, 79])),
            st.tuples(st.just("take"), st.just(0), st.just(0)),
        ),
        max_size=40,
    )
)
def test_the_ledger_hands_out_every_xid_once_and_its_totals_only_grow(steps) -> None:
    reservations = XidLedger()
    raised: dict[int, list[int]] = {}
    handed: dict[int, list[int]] = {}
    before = {g: 0 for g in range(4)}
    for kind, gpu, code in [*steps, ("take", 0, 0)]:
        if kind == "xid":
            reservations.record(gpu, code)
            raised.setdefault(gpu, []).append(code)
            continue
        for g, count in reservations.take(list(range(4))).items():
            handed.setdefault(g, []).extend(count.new)
            assert count.total >= before[g]
            assert count.total - before[g] == len(count.new)
            assert count.last == (raised[g][-1] if raised.get(g) else None)
            before[g] = count.total
    assert {g: v for g, v in handed.items() if v} == raised


@pytest.mark.timeout(60)
def test_chaos_process_raises_xid_on_a_running_collector_and_the_balancer_drains(tmp_path):
    state = tmp_path / "gpus.json"
    collector = gpu_collector(sim_gpus=8, nvlink_group=16, state_file=state)
    try:
        assert collector.collect().available
        code = (
            "import sys; from shoal.scheduler.health.simgpu import SimGpuBackend; "
            "SimGpuBackend.attach(sys.argv[1]).raise_xid(2, 48, ecc_uncorrected=1)"
        )
        subprocess.run([sys.executable, "-c", code, str(state)], check=True, timeout=30)
        reports = _collect_until(collector, lambda rs: _xids(rs))
    finally:
        collector.close()
    assert _xids(reports) == [(2, 48)]
    health = summarise("node-0", reports[-1:])
    assert (health.xid_errors, health.ecc_errors) == (1, 1)

    topo = simulated_cluster(2, 8, island_size=8, nodes_per_domain=2)
    plan = place(topo, (), [LearnerGroup("ppo", 1, 8)], [RolloutActor(f"a{i}") for i in range(4)])
    out = balance(topo, plan.placements, [health, summarise("node-1", [])], BalancerState(), 1.0)
    [drain] = [d for d in out.decisions if d.action == "drain"]
    assert drain.node == "node-0"
    assert "1 new XID error(s) and 1 new uncorrectable ECC error(s)" in drain.reason


def test_simulated_backend_refuses_bad_input(tmp_path):
    with pytest.raises(HealthError, match="--sim-gpus must be an int >= 0"):
        SimGpuBackend(-1)
    with pytest.raises(HealthError, match="NVLink group size must be an int >= 1"):
        SimGpuBackend(2, nvlink_group=0)
    backend = SimGpuBackend(2)
    with pytest.raises(HealthError, match=r"index 5 out of range 0\.\.1"):
        backend.raise_xid(5)
    with pytest.raises(HealthError, match=r"must be in 0\.\.1"):
        backend.set_load(0, 1.5)
    state = tmp_path / "s.json"
    SimGpuBackend(2, state_file=state)
    with pytest.raises(HealthError, match="describes 2 GPUs, not 4"):
        SimGpuBackend(4, state_file=state)
    state.write_text("{not json")
    with pytest.raises(HealthError, match="is unreadable"):
        SimGpuBackend(2, state_file=state)
    with pytest.raises(HealthError, match="is the node running with --sim-gpus"):
        SimGpuBackend.attach(tmp_path / "missing.json")


def test_summarise_folds_reports_into_node_health():
    gpu = Report(
        "nvml",
        True,
        gpus=(
            GpuSample(0, utilisation=0.5, memory_used_mb=10, memory_total_mb=100),
            GpuSample(1, utilisation=1.0, memory_used_mb=90, memory_total_mb=100, xid_events=(79,)),
        ),
    )
    host = Report("host", True, metrics={"cpu_fraction": 0.4, "memory_fraction": 0.3})
    clock = Report("clock", True, metrics={"offset_ms": -2.5, "latency_ms": 0.2})
    gone = Report("dcgm", False, "unavailable: DCGM is not installed")
    h = summarise("n", [gpu, host, clock, gone])
    assert h.gpu_util == pytest.approx(0.75)
    assert h.gpu_memory == pytest.approx(0.9)
    assert (h.cpu, h.memory, h.clock_offset_ms, h.latency_ms) == (0.4, 0.3, -2.5, 0.2)
    assert h.xid_errors == 1
    assert Report.from_dict(json.loads(json.dumps(gpu.to_dict()))) == gpu
