"""The scheduler loop inside a real coordinator (pysyncobj + aiohttp in this process): a job of
a thousand tasks is placed in batches under the command size limit, each with its event."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shoal.raft.config import LivenessConfig, SchedulingConfig
from tests.raft.inprocess import InProcessReplica
from tests.support.waiting import eventually

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

    def all_placed() -> list[dict[str, Any]] | None:
        tasks: list[dict[str, Any]] = replica.request("GET", "/v1/tasks?job=big")[1]["tasks"]
        return tasks if all(t["node"] for t in tasks) else None

    placed = eventually(all_placed, "every task of job big placed", timeout=45)
    assert all(t["node"] for t in placed)
    assert all(t["generation"] == 1 for t in placed)
    per_node = {n: sum(t["node"] == n for t in placed) for n in ("a", "b")}
    assert per_node == {"a": TASKS // 2, "b": TASKS // 2}
    want = sorted(t["id"] for t in placed)
    eventually(lambda: sorted(placement_events(replica)) == want, "every placement event arrived")


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
