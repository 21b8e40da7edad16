"""The scheduler loop inside a real coordinator (pysyncobj + aiohttp in this process): a job of
a thousand tasks is placed in batches under the command size limit, each with its event."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.raft.config import LivenessConfig, SchedulingConfig
from tests.raft.inprocess import InProcessReplica

TASKS = 1000


@pytest.fixture
def replica(tmp_path: Path) -> Iterator[InProcessReplica]:
    r = InProcessReplica(
        tmp_path,
        scheduling=SchedulingConfig(period=0.1),
        liveness=LivenessConfig(suspect_after=60.0, dead_after=120.0),
    )
    try:
        r.start()
        yield r
    finally:
        r.close()


@pytest.mark.timeout(60)
def test_a_large_job_is_placed_in_batches_each_task_once(replica: InProcessReplica) -> None:
    for name in ("a", "b"):
        node = {
            "node_id": name,
            "address": f"shoal://{name}:1",
            "resources": {"cpus": 512, "memory": 0},
        }
        status, _ = replica.request("POST", "/v1/nodes", node)
        assert status == 201
    tasks = [
        {"task_id": f"t{i}", "kind": "rollout", "actor": "a.b:C", "resources": {"cpus": 0.5}}
        for i in range(TASKS)
    ]
    status, _ = replica.request(
        "POST", "/v1/jobs", {"job_id": "big", "spec": {"placement": "auto"}, "tasks": tasks}
    )
    assert status == 201
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline:
        _, body = replica.request("GET", "/v1/tasks?job=big")
        if all(t["node"] for t in body["tasks"]):
            break
        time.sleep(0.2)
    placed = body["tasks"]
    assert all(t["node"] for t in placed)
    assert all(t["generation"] == 1 for t in placed)
    per_node = {n: sum(t["node"] == n for t in placed) for n in ("a", "b")}
    assert per_node == {"a": TASKS // 2, "b": TASKS // 2}
    deadline = time.monotonic() + 30
    while sorted(placement_events(replica)) != sorted(t["id"] for t in placed):
        assert time.monotonic() < deadline, "the placement events never all arrived"
        time.sleep(0.2)


def placement_events(replica: InProcessReplica) -> list[str]:
    """The task of every `placement` event, read page by page (the placements commit first,
    their events in the following batches)."""
    seen: list[str] = []
    since = 0
    while True:
        _, page = replica.request("GET", f"/v1/events?limit=1000&since={since}")
        if not page["events"]:
            return seen
        seen += [e["fields"]["task"] for e in page["events"] if e["kind"] == "placement"]
        since = page["events"][-1]["seq"]


def test_the_schedloop_bench_gives_rows_beside_their_baselines() -> None:
    from shoal.bench.schedloop import run

    rows = run(quick=True)
    assert [r.unit for r in rows] == ["ms", "ms"]
    assert all(r.shoal > 0 and r.baseline and r.baseline > 0 for r in rows)
    assert all(r.baseline_name for r in rows)
