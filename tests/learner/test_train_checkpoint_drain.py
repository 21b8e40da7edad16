"""A run records each new complete checkpoint with the coordinator as it appears, so the
balancer knows its learner group's checkpoint boundaries: after the learners' node is set
draining through the API, the group moves to the other node and training goes on. Real
processes: `shoal up --replicas 1 --nodes 2`, `shoal train` as a job on it."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shoal.local import LocalCluster
from shoal.raft.client import CoordinatorClient
from tests.support.processes import child_process, eventually_while_running

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture
def cluster(start_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    return start_cluster(nodes=2)


def _ask(local: LocalCluster, fn: Callable[[CoordinatorClient], Any]) -> Any:
    async def go() -> Any:
        async with CoordinatorClient(local.api_urls(), local.token) as client:
            return await fn(client)

    return asyncio.run(go())


def _job_id(run_dir: Path) -> str | None:
    events = run_dir / "events.jsonl"
    for line in events.read_text().splitlines() if events.exists() else []:
        if '"submitted"' in line:
            return str(json.loads(line)["job"])
    return None


def _version(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "status-0.json").read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def test_recorded_checkpoints_let_a_draining_node_hand_its_learners_over(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    argv = [
        sys.executable, "-m", "shoal", "train", "cartpole", "--cluster", str(cluster.run_dir),
        "--run-dir", str(run_dir), "--workers", "1", "--time-limit", "200",
        "--target-return", "100000", "--checkpoint-interval", "1", "--quiet", "--json",
        "--no-eval",
    ]  # fmt: skip
    with child_process(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        job = eventually_while_running(proc, lambda: _job_id(run_dir), "the job", 60)
        recorded = eventually_while_running(
            proc,
            lambda: (lambda cps: cps if len(cps) >= 2 else None)(
                _ask(cluster, lambda c: c.checkpoints(job=job))
            ),
            "several checkpoints recorded during the run",
            150,
        )
        assert all(c["complete"] for c in recorded)
        rank = f"{job}-learner-0"
        task = _ask(cluster, lambda c: c.request("GET", f"/v1/tasks/{rank}"))
        source = task["node"]
        _ask(cluster, lambda c: c.drain(source))
        moved = eventually_while_running(
            proc,
            lambda: (lambda t: t if t["node"] != source and t["state"] == "running" else None)(
                _ask(cluster, lambda c: c.request("GET", f"/v1/tasks/{rank}"))
            ),
            "the learner rank running on the other node",
            90,
        )
        assert moved["generation"] > task["generation"]
        before = _version(run_dir)
        eventually_while_running(
            proc, lambda: _version(run_dir) > before + 2, "training on the new node", 90
        )
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode in (0, 1), err[-2000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["job_id"] == job
    events = _ask(cluster, lambda c: c.events(limit=1000))["events"]
    migrations = [e for e in events if e["kind"] == "migration" and e["fields"]["task"] == rank]
    assert migrations
    assert migrations[0]["fields"]["source"] == source
