"""`shoal train` through a real local cluster: one coordinator replica and one node daemon as
real processes; the run is a coordinator job whose tasks the leader places and the node runs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shoal.cli import main
from shoal.cluster_train import started_pids
from shoal.local import LocalCluster
from shoal.raft.client import CoordinatorClient
from tests.support.processes import pid_alive
from tests.support.waiting import eventually

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalCluster]:
    """`shoal up --replicas 1 --nodes 1`, found by `shoal train` as `shoal status` finds it."""
    run_dir = tmp_path / "cluster"
    monkeypatch.setenv("SHOAL_RUN_DIR", str(run_dir))
    local = LocalCluster(run_dir)
    try:
        assert main(["up", "--replicas", "1", "--nodes", "1", "--timeout", "60"]) == 0
        yield local
    finally:
        if (run_dir / "cluster.json").exists():
            local.stop_all()
    assert all(local.pid(s.name) is None for s in local.specs())


def _api(local: LocalCluster) -> dict[str, Any]:
    async def read() -> dict[str, Any]:
        async with CoordinatorClient(local.api_urls(), local.token) as client:
            return {
                "jobs": await client.jobs(),
                "tasks": await client.tasks(),
                "events": (await client.events(limit=1000))["events"],
                "checkpoints": await client.checkpoints(),
            }

    return asyncio.run(read())


def test_train_runs_as_a_placed_job_and_stops_it(
    cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    argv = [
        "train", "cartpole", "--run-dir", str(run_dir),
        "--time-limit", "40", "--target-return", "60", "--workers", "1", "--quiet", "--json",
        "--checkpoint-interval", "2",
    ]  # fmt: skip
    code = main(argv)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code in (0, 1)
    assert summary["env_steps"] > 0
    assert summary["solved"] or summary["final_return"] is not None
    job_id = summary["job_id"]
    assert job_id
    assert summary["checkpoint"]
    assert summary["eval_mean_return"] is not None

    seen = _api(cluster)
    job = next(j for j in seen["jobs"] if j["id"] == job_id)
    assert job["state"] == "stopped"
    assert job["spec"]["placement"] == "auto"
    assert job["spec"]["restart"] == {"max_restarts": 5, "window_s": 600.0}
    assert summary["cluster"] == {"coordinators": cluster.api_urls(), "embedded": False}
    tasks = {t["id"]: t for t in seen["tasks"] if t["job_id"] == job_id}
    assert set(tasks) == {f"{job_id}-learner-0", f"{job_id}-rollout-0"}
    assert all(t["node"] == "n1" and t["state"] == "stopped" for t in tasks.values())
    placed = {e["fields"].get("task") for e in seen["events"] if e["kind"] == "placement"}
    assert set(tasks) <= placed
    recorded = [c for c in seen["checkpoints"] if c["job_id"] == job_id]
    assert recorded
    assert recorded[-1]["path"] == summary["checkpoint"]
    # Rank 0 posts every few seconds and once more when it stops.
    metrics = [e["fields"] for e in seen["events"] if e["kind"] == "job_metrics"]
    assert metrics
    assert all(f["job"] == job_id for f in metrics)
    assert metrics[-1]["step"] > 0
    assert {"loss_total", "loss_policy", "loss_value", "sps"} <= set(metrics[-1])
    # The node ran the rank and the worker, and both exited before `shoal train` returned.
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "stop" for e in events)
    pids = started_pids([json.dumps(e) for e in events], job_id)
    assert len(pids) == 2
    # the node reaps its exited children a moment later
    eventually(lambda: not any(pid_alive(pid) for pid in pids), "the node's children reaped")
