"""Liveness: the pure heartbeat table, and a real replica marking a silent node suspect then dead."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.raft.config import LivenessConfig
from shoal.raft.liveness import LivenessTable
from tests.support.waiting import eventually

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


def _summary(xid_new: int, xid_total: int, ecc_new: int = 0, ecc_total: int = 0) -> dict:
    return {
        "summary": {
            "gpu_util": 0.5,
            "xid_errors": xid_new,
            "xid_total": xid_total,
            "ecc_errors": ecc_new,
            "ecc_total": ecc_total,
        }
    }


@settings(deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(1, 3), st.booleans()),
        min_size=1,
        max_size=15,
    )
)
def test_every_error_of_every_collection_reaches_exactly_one_batch(
    collections: list[tuple[int, int, int, bool]],
) -> None:
    """A node collects (new XID and ECC errors each time), repeats each collection in one to
    three heartbeats, and the leader takes a batch at arbitrary points: summed over batches,
    every error counts once, and no batch counts a repeated collection again."""
    table = LivenessTable(CONFIG)
    xid_total = ecc_total = 0
    batches: list[dict] = []
    now = 0.0
    for xid, ecc, repeats, take_after in collections:
        xid_total += xid
        ecc_total += ecc
        for _ in range(repeats):
            now += 1.0
            table.heartbeat("n1", now, _summary(xid, xid_total, ecc, ecc_total))
        if take_after:
            batches += [r["health"]["summary"] for r in table.take_health()]
    batches += [r["health"]["summary"] for r in table.take_health()]
    assert sum(b["xid_errors"] for b in batches) == xid_total
    assert sum(b["ecc_errors"] for b in batches) == ecc_total
    assert batches[-1]["xid_total"] == xid_total


def test_a_burst_over_two_collections_is_added_up_not_maxed() -> None:
    table = LivenessTable(CONFIG)
    table.heartbeat("n1", 1.0, _summary(3, 3))
    table.heartbeat("n1", 2.0, _summary(2, 5))
    table.heartbeat("n1", 3.0, _summary(0, 5))
    (report,) = table.take_health()
    assert report["health"]["summary"]["xid_errors"] == 5
    table.heartbeat("n1", 4.0, _summary(0, 5))  # the same collection, into the next batch
    assert table.take_health()[0]["health"]["summary"]["xid_errors"] == 0
    table.heartbeat("n1", 5.0, _summary(1, 1))  # the daemon restarted: its count did too
    assert table.take_health()[0]["health"]["summary"]["xid_errors"] == 1


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

        def quiet() -> str:
            return str(replica.request("GET", "/v1/nodes/quiet")[1]["liveness"])

        eventually(lambda: quiet() == "dead", "the quiet node declared dead")
        # suspect came first: the events below show the order
        _, node = replica.request("GET", "/v1/nodes/quiet")
        assert node["health"] == {"ok": 1}
        replica.request("POST", "/v1/nodes/quiet/heartbeat", {})
        eventually(lambda: quiet() == "alive", "the quiet node alive again after a heartbeat")
        _, events = replica.request("GET", "/v1/events?since=0")
        kinds = [e["message"] for e in events["events"] if e["kind"] == "node_liveness"]
        assert kinds[:2] == ["node quiet alive -> suspect", "node quiet suspect -> dead"]
    finally:
        replica.close()
