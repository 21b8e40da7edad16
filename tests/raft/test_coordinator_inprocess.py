"""The coordinator's bridge between pysyncobj's thread and asyncio, on one in-process replica."""

from __future__ import annotations

import pytest

from .inprocess import InProcessReplica

pytestmark = pytest.mark.timeout(60)


def test_the_only_replica_leads_and_announces_itself(replica: InProcessReplica) -> None:
    status, cluster = replica.request("GET", "/v1/cluster")
    assert status == 200
    assert cluster["state"] == "leader"
    assert cluster["leader_api"] == replica.url
    assert cluster["digest"] is None
    _, with_digest = replica.request("GET", "/v1/cluster?digest=true")
    assert len(with_digest["digest"]) == 64
    status, events = replica.request("GET", "/v1/events?since=0")
    assert any(e["kind"] == "leader" for e in events["events"])


def test_a_write_is_applied_once_per_operation_id(replica: InProcessReplica) -> None:
    body = {"kind": "note", "message": "once"}
    first = replica.request("POST", "/v1/events", body, headers={"X-Shoal-Op-Id": "op-once"})
    again = replica.request("POST", "/v1/events", body, headers={"X-Shoal-Op-Id": "op-once"})
    assert first == again
    _, events = replica.request("GET", "/v1/events?since=0")
    assert [e["message"] for e in events["events"]].count("once") == 1


def test_reads_carry_the_commit_index_and_consistent_reads_advance_it(
    replica: InProcessReplica,
) -> None:
    replica.request("GET", "/v1/nodes")
    before = int(replica.last_headers["X-Shoal-Commit-Index"])
    replica.request("GET", "/v1/nodes?consistent=true")
    replica.request("GET", "/v1/nodes")
    after = int(replica.last_headers["X-Shoal-Commit-Index"])
    assert after > before


def test_many_concurrent_writes_all_commit(replica: InProcessReplica) -> None:
    commands = [
        {"op": "add_event", "args": {"kind": "bulk", "message": str(i)}} for i in range(200)
    ]
    status, result = replica.request("POST", "/v1/batch", {"commands": commands})
    assert status == 200
    assert len(result["results"]) == 200
    assert all(r["ok"] for r in result["results"])


def test_a_restarted_replica_recovers_its_state_from_the_journal(tmp_path) -> None:
    first = InProcessReplica(tmp_path)
    try:
        first.start()
        for i in range(5):
            first.request("POST", "/v1/events", {"kind": "note", "message": f"m{i}"})
        _, before = first.request("GET", "/v1/events?since=0&consistent=true")
    finally:
        first.close()
    second = InProcessReplica(tmp_path)
    second.config = first.config
    try:
        second.start()
        _, after = second.request("GET", "/v1/events?since=0&consistent=true")
    finally:
        second.close()
    notes = [e["message"] for e in after["events"] if e["kind"] == "note"]
    assert notes == [f"m{i}" for i in range(5)]
    assert after["events"][: len(before["events"])] == before["events"]
