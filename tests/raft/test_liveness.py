"""Liveness: the pure heartbeat table, and a real replica marking a silent node suspect then dead."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.raft.config import LivenessConfig
from shoal.raft.liveness import LivenessTable

from .inprocess import InProcessReplica

CONFIG = LivenessConfig(suspect_after=3.0, dead_after=10.0)


@settings(deadline=None)
@given(st.lists(st.floats(0, 30), max_size=20), st.floats(0, 30))
def test_liveness_only_worsens_with_silence_and_follows_the_thresholds(
    gaps: list[float], last: float
) -> None:
    table = LivenessTable(CONFIG)
    now = 1000.0
    table.heartbeat("n1", now, None)
    for gap in gaps:
        now += gap
        table.heartbeat("n1", now, {"gap": gap})
    order = ["alive", "suspect", "dead"]
    seen = [table.expected("n1", now + t) for t in (0.0, last, last + 1.0, last + 20.0)]
    assert [order.index(s) for s in seen] == sorted(order.index(s) for s in seen)
    assert seen[0] == "alive"
    assert seen[-1] == "dead"
    assert table.changes({"n1": "alive"}, now + last) == (
        [] if last < 3.0 else [{"node_id": "n1", "liveness": "suspect" if last < 10.0 else "dead"}]
    )


def test_a_new_leader_gives_every_node_a_grace_period() -> None:
    table = LivenessTable(CONFIG)
    assert table.changes({"n1": "dead", "n2": "alive"}, 50.0) == [
        {"node_id": "n1", "liveness": "alive"}
    ]
    table.heartbeat("n2", 50.0, None)
    table.reset(100.0)
    assert table.changes({"n1": "alive", "n2": "alive"}, 102.0) == []


def test_health_is_batched_and_taken_once() -> None:
    table = LivenessTable(CONFIG)
    table.heartbeat("n2", 1.0, {"gpu_util": 0.5})
    table.heartbeat("n1", 2.0, {"gpu_util": 0.1})
    reports = table.take_health()
    assert [r["node_id"] for r in reports] == ["n1", "n2"]
    assert table.take_health() == []


@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=12))
def test_an_error_seen_in_any_heartbeat_of_a_batch_reaches_the_batch(
    counts: list[tuple[int, int]],
) -> None:
    table = LivenessTable(CONFIG)
    for n, (xid, ecc) in enumerate(counts):
        table.heartbeat("n1", float(n), {"gpu_util": 0.5, "xid_errors": xid, "ecc_errors": ecc})
    (report,) = table.take_health()
    assert report["health"]["xid_errors"] == max(xid for xid, _ in counts)
    assert report["health"]["ecc_errors"] == max(ecc for _, ecc in counts)
    table.heartbeat("n1", 99.0, {"gpu_util": 0.5, "xid_errors": 0, "ecc_errors": 0})
    assert table.take_health()[0]["health"]["xid_errors"] == 0


@pytest.mark.timeout(60)
def test_a_silent_node_turns_suspect_then_dead_and_recovers_on_heartbeat(tmp_path) -> None:
    replica = InProcessReplica(
        tmp_path,
        liveness=LivenessConfig(
            suspect_after=0.5, dead_after=2.0, check_period=0.05, health_period=0.1
        ),
    )
    try:
        replica.start()
        body = {"node_id": "quiet", "address": "127.0.0.1:1", "resources": {"cpus": 1, "memory": 1}}
        assert replica.request("POST", "/v1/nodes", body)[0] == 201
        assert replica.request("POST", "/v1/nodes/quiet/heartbeat", {"health": {"ok": 1}})[0] == 200
        seen = set()
        deadline = time.monotonic() + 20
        while "dead" not in seen and time.monotonic() < deadline:
            seen.add(replica.request("GET", "/v1/nodes/quiet")[1]["liveness"])
            time.sleep(0.02)
        assert "dead" in seen  # suspect came first: the events below show the order
        _, node = replica.request("GET", "/v1/nodes/quiet")
        assert node["health"] == {"ok": 1}
        replica.request("POST", "/v1/nodes/quiet/heartbeat", {})
        while replica.request("GET", "/v1/nodes/quiet")[1]["liveness"] != "alive":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        _, events = replica.request("GET", "/v1/events?since=0")
        kinds = [e["message"] for e in events["events"] if e["kind"] == "node_liveness"]
        assert kinds[:2] == ["node quiet alive -> suspect", "node quiet suspect -> dead"]
    finally:
        replica.close()
