"""Two sources of one GPU (NVML and DCGM) count once, with DCGM's utilisation: what the balancer
judges. And the collectors' states as a node sends them and as readers take them back
(hostile input: property tests over arbitrary JSON)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.scheduler.balancer import balance
from shoal.scheduler.health.collector import (
    GpuSample,
    Report,
    merge_gpus,
    summarise,
    unavailable,
    utilisation_source,
)
from shoal.scheduler.health.presence import (
    MAX_COLLECTORS,
    MAX_REASON,
    STATES,
    collector_states,
    describe,
    printable,
    read_states,
)
from shoal.scheduler.model import BalancerState, Placement
from shoal.scheduler.topology import simulated_cluster
from tests.support.strategies import json_values


def nvml(*utils: float | None, xids: tuple[int, ...] = ()) -> Report:
    gpus = tuple(
        GpuSample(i, uuid=f"GPU-{i}", utilisation=u, memory_used_mb=40, memory_total_mb=80,
                  xid_events=xids if i == 0 else (), xid_total=len(xids) if i == 0 else 0)
        for i, u in enumerate(utils)
    )  # fmt: skip
    return Report("nvml", True, gpus=gpus)


def dcgm(*utils: float | None, xids: tuple[int, ...] = ()) -> Report:
    gpus = tuple(
        GpuSample(i, utilisation=u, xid_events=xids if i == 0 else ()) for i, u in enumerate(utils)
    )
    return Report("dcgm", True, gpus=gpus)


def test_dcgm_utilisation_wins_and_nvml_keeps_the_rest() -> None:
    merged = merge_gpus([nvml(0.1, 0.2, xids=(79,)), dcgm(0.9, None, xids=(79,))])
    assert [g.utilisation for g in merged] == [0.9, 0.2]  # GPU 1: DCGM has no value yet
    assert [g.uuid for g in merged] == ["GPU-0", "GPU-1"]
    assert [g.memory_fraction for g in merged] == [0.5, 0.5]
    assert [g.xid_events for g in merged] == [(79,), ()]  # one XID, not one per source


def test_the_order_of_the_reports_does_not_matter() -> None:
    a = merge_gpus([nvml(0.1, 0.2), dcgm(0.9, 0.8)])
    b = merge_gpus([dcgm(0.9, 0.8), nvml(0.1, 0.2)])
    assert a == b


def test_a_gpu_only_dcgm_sees_is_kept_and_unavailable_reports_are_not() -> None:
    merged = merge_gpus([unavailable("nvml", "no driver"), dcgm(0.3, 0.5)])
    assert [(g.index, g.utilisation) for g in merged] == [(0, 0.3), (1, 0.5)]
    down_dcgm = Report("dcgm", False, "unavailable: x", gpus=(GpuSample(0, utilisation=1.0),))
    assert [g.utilisation for g in merge_gpus([nvml(0.1), down_dcgm])] == [0.1]


@given(
    st.lists(st.one_of(st.none(), st.floats(0, 1)), max_size=6),
    st.lists(st.one_of(st.none(), st.floats(0, 1)), max_size=6),
)
def test_each_gpu_once_with_dcgms_value_where_it_has_one(
    nv: list[float | None], dc: list[float | None]
) -> None:
    merged = merge_gpus([nvml(*nv), dcgm(*dc)])
    assert [g.index for g in merged] == list(range(max(len(nv), len(dc))))
    for g in merged:
        from_dcgm = dc[g.index] if g.index < len(dc) else None
        from_nvml = nv[g.index] if g.index < len(nv) else None
        assert g.utilisation == (from_dcgm if from_dcgm is not None else from_nvml)


def test_utilisation_source_names_dcgm_when_it_measured() -> None:
    assert utilisation_source([nvml(0.1), dcgm(0.9)]) == "dcgm"
    assert utilisation_source([nvml(0.1), dcgm(None)]) == "nvml"
    assert utilisation_source([nvml(0.1), unavailable("dcgm", "x")]) == "nvml"
    assert utilisation_source([Report("host", True)]) is None


def test_the_balancer_judges_dcgms_utilisation() -> None:
    """NVML says idle, DCGM says busy: the node's gpu_util is DCGM's and the balancer relieves
    the node on it, the same way it would on NVML's number alone."""
    topo = simulated_cluster(2, 2, island_size=2, nodes_per_domain=2)
    busy, idle = (n.name for n in topo.nodes)
    placements = [Placement(f"a{i}", busy, "rollout", cpus=1.0) for i in range(4)]
    health = [
        summarise(busy, [nvml(0.05, 0.05), dcgm(0.97, 0.95)]),
        summarise(idle, [nvml(0.05, 0.05)]),
    ]
    assert health[0].gpu_util == pytest.approx(0.96)
    state = BalancerState()
    for now in (1.0, 2.0):  # overloaded from the second report on (enter_after = 2)
        plan = balance(topo, placements, health, state, now)
        state = plan.state
    assert {m.source for m in plan.migrations} == {busy}
    assert any("gpu_util" in d.reason for d in plan.decisions if d.node == busy)
    nvml_only = [summarise(busy, [nvml(0.05, 0.05)]), health[1]]
    calm = balance(topo, placements, nvml_only, BalancerState(), 1.0)
    assert not balance(topo, placements, nvml_only, calm.state, 2.0).migrations


def test_collector_states_list_built_then_absent() -> None:
    reports = [Report("host", True), unavailable("nvml", "no NVIDIA driver")]
    states = collector_states(reports, {"dcgm": "DCGM is not installed"})
    assert states == {
        "host": {"state": "up", "reason": ""},
        "nvml": {"state": "down", "reason": "unavailable: no NVIDIA driver"},
        "dcgm": {"state": "absent", "reason": "DCGM is not installed"},
    }
    assert read_states({"collectors": states}) == states
    assert describe(states) == (
        "host up, nvml down (no NVIDIA driver), dcgm absent (DCGM is not installed)"
    )
    assert describe({}) == "not reported"


def test_reasons_are_one_printable_line_of_bounded_length() -> None:
    assert printable("a\x1b[2Jb\nc\u202ed") == "a?[2Jb c?d"
    assert len(printable("x" * 10_000)) == MAX_REASON
    health = {"collectors": {"ptp": {"state": "absent", "reason": "\x07" + "y" * 5000}}}
    reason = read_states(health)["ptp"]["reason"]
    assert reason.startswith("?y")
    assert len(reason) == MAX_REASON


JSON = json_values(max_text=20, max_leaves=30)
ENTRY = st.fixed_dictionaries(
    {"state": st.sampled_from([*STATES, "weird"]) | JSON},
    optional={"reason": st.text(max_size=400) | JSON},
)


@given(
    st.one_of(
        JSON,
        st.builds(lambda c: {"collectors": c}, JSON),
        st.builds(
            lambda c: {"collectors": c},
            st.dictionaries(st.text(max_size=40), ENTRY | JSON, max_size=3 * MAX_COLLECTORS),
        ),
    )
)
@settings(max_examples=300)
def test_any_health_object_reads_as_bounded_valid_states(health: Any) -> None:
    states = read_states(health)
    assert len(states) <= MAX_COLLECTORS
    for name, entry in states.items():
        assert name.isascii()
        assert len(name) <= 32
        assert entry["state"] in STATES
        assert len(entry["reason"]) <= MAX_REASON
        assert entry["reason"].isprintable()
    describe(states)
