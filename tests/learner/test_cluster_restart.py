"""The leader restarts what a fault killed, with real processes: a `shoal up` cluster (one
coordinator replica, one node daemon), `shoal train` as a job on it, a learner rank SIGKILLed
mid-run -> its whole group restarts at new generations and resumes from the checkpoint; and a
task that fails every time -> its job fails once the restart intensity is spent."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shoal.local import LocalCluster
from shoal.raft.client import CoordinatorClient
from tests.support.processes import child_process, eventually_while_running
from tests.support.waiting import eventually_async

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture
def cluster(start_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    return start_cluster()


def _api(local: LocalCluster) -> dict[str, Any]:
    async def read() -> dict[str, Any]:
        async with CoordinatorClient(local.api_urls(), local.token) as client:
            return {
                "jobs": await client.jobs(),
                "tasks": await client.tasks(),
                "events": (await client.events(limit=1000))["events"],
            }

    return asyncio.run(read())


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def _status(run_dir: Path, rank: int) -> dict[str, Any]:
    try:
        return dict(json.loads((run_dir / f"status-{rank}.json").read_text()))
    except (OSError, ValueError):
        return {}


def _learner_starts(run_dir: Path) -> list[dict[str, Any]]:
    return [
        e for e in _events(run_dir) if e.get("event") == "start" and e.get("process") == "learner"
    ]


@pytest.mark.parametrize(
    ("victim", "sig", "whys", "sharding"),
    [
        (1, signal.SIGKILL, ("task {job}-learner-1 failed: killed by SIGKILL",), "replicate"),
        # Mid-FSDP2 step: rank 1 dies inside the update's collectives, rank 0 is left in them.
        (1, signal.SIGKILL, ("task {job}-learner-1 failed: killed by SIGKILL",), "fsdp"),
        # As when rank 0's node daemon dies (its children get SIGTERM): rank 0 stops cleanly
        # while its job runs, rank 1 stops with it but was not asked to (status 3); whichever
        # report reaches the leader first names the group's restart.
        (
            0,
            signal.SIGTERM,
            (
                "task {job}-learner-0 stopped: exited with status 0",
                "task {job}-learner-1 failed: exited with status 3",
            ),
            "replicate",
        ),
    ],
    ids=["sigkill-rank1", "sigkill-rank1-fsdp", "sigterm-rank0"],
)
def test_a_killed_learner_rank_restarts_its_group_from_the_checkpoint(
    cluster: LocalCluster,
    tmp_path: Path,
    victim: int,
    sig: signal.Signals,
    whys: tuple[str, ...],
    sharding: str,
) -> None:
    run_dir = tmp_path / "run"
    argv = [
        sys.executable, "-m", "shoal", "train", "cartpole", "--cluster", str(cluster.run_dir),
        "--run-dir", str(run_dir), "--ranks", "2", "--workers", "2", "--time-limit", "200",
        "--target-return", "100000", "--checkpoint-interval", "1", "--quiet", "--json",
        "--no-eval", "--sharding", sharding,
    ]  # fmt: skip
    with child_process(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        checkpoints = run_dir / "checkpoints"
        first = eventually_while_running(
            proc,
            lambda: (
                len(_learner_starts(run_dir)) == 2
                and any(e.get("event") == "checkpoint" for e in _events(run_dir))
                and any(checkpoints.glob("ckpt-*.json"))  # complete: its manifest is written last
            ),
            "both ranks running and a checkpoint",
            200,
        )
        assert first
        old = {e["rank"]: e for e in _learner_starts(run_dir)}
        eventually_while_running(
            proc,
            lambda: all(_status(run_dir, r).get("version", 0) > 0 for r in (0, 1)),
            "both ranks training",
            200,
        )
        assert _status(run_dir, 0)["parallel"] == sharding
        os.kill(old[victim]["pid"], sig)
        killed_at = time.time()
        new = eventually_while_running(
            proc,
            lambda: [e for e in _learner_starts(run_dir) if e["time"] > killed_at] or None,
            "the group's new incarnation",
            200,
        )
        eventually_while_running(
            proc,
            lambda: (
                {e["rank"] for e in _learner_starts(run_dir) if e["time"] > killed_at} == {0, 1}
            ),
            "both new ranks",
            200,
        )
        proc.send_signal(signal.SIGINT)  # an orderly stop, as Ctrl-C
        out, err = proc.communicate(timeout=120)
    assert new
    summary = json.loads(out.strip().splitlines()[-1])
    job_id = summary["job_id"]
    assert summary["restarts"] >= 1, err[-2000:]

    seen = _api(cluster)
    restarts = [
        e for e in seen["events"] if e["kind"] == "restart" and e["fields"].get("job") == job_id
    ]
    assert restarts
    assert any(why.format(job=job_id) in restarts[0]["message"] for why in whys)
    assert "restart 1 of 5 in 600 s" in restarts[0]["message"]
    assert sorted(restarts[0]["fields"]["tasks"]) == [f"{job_id}-learner-0", f"{job_id}-learner-1"]
    tasks = {t["id"]: t for t in seen["tasks"] if t["job_id"] == job_id}
    ranks = [tasks[f"{job_id}-learner-{r}"] for r in range(2)]
    assert all(t["generation"] >= 3 and t["restarts"] >= 1 for t in ranks)  # placed, restarted
    assert ranks[0]["generation"] == ranks[1]["generation"]
    job = next(j for j in seen["jobs"] if j["id"] == job_id)
    assert job["state"] == "stopped"
    assert job["restarts"] == summary["restarts"]
    # The new incarnation resumed from a checkpoint the old one wrote, as new processes.
    after = [e for e in _learner_starts(run_dir) if e["time"] > killed_at]
    assert all(e["resumed_from"] for e in after)
    assert {e["pid"] for e in after}.isdisjoint(e["pid"] for e in old.values())
    assert {e["incarnation"] for e in after}.isdisjoint(e["incarnation"] for e in old.values())
    assert all(e["step"] > 0 for e in after)
    # Stopped with the job (its rollout workers with it), the new group still agreed to stop
    # and rank 0 wrote the final checkpoint.
    started = min(e["time"] for e in after)
    stops = [e for e in _events(run_dir) if e.get("event") == "stop" and e["time"] > started]
    assert len(stops) == 1
    assert stops[0]["step"] >= after[0]["step"]


def test_a_task_failing_every_time_fails_its_job_after_max_restarts(
    cluster: LocalCluster,
) -> None:
    # `python -m shoal.tasks shoal.tasks:main` with no arguments prints its usage, exits 2.
    task = {
        "task_id": "crash-0",
        "kind": "rollout-worker",
        "actor": "shoal.tasks:main",
        "args": {"argv": []},
    }
    spec = {"placement": "auto", "restart": {"max_restarts": 2, "window_s": 600}}

    async def scenario() -> dict[str, Any]:
        async with CoordinatorClient(cluster.api_urls(), cluster.token) as client:
            await client.submit_job(job_id="crash", spec=spec, tasks=[task])

            async def ended() -> dict[str, Any] | None:
                job = await client.job("crash")
                return None if job["state"] == "running" else job

            return await eventually_async(ended, "the job ended", 90)

    job = asyncio.run(scenario())
    assert job["state"] == "failed"
    assert job["message"].startswith("task crash-0 failed: exited with status 2")
    assert job["message"].endswith("gave up after 2 restarts in 600 s")
    assert job["restarts"] == 2
    [crash] = job["tasks"]
    assert crash["restarts"] == 2
    assert crash["state"] == "failed"
    seen = _api(cluster)
    restarts = [e["message"] for e in seen["events"] if e["kind"] == "restart"]
    assert [m.rsplit("; ", 1)[-1] for m in restarts] == [
        "restart 1 of 2 in 600 s",
        "restart 2 of 2 in 600 s",
    ]
    assert any(e["kind"] == "job_failed" for e in seen["events"])
