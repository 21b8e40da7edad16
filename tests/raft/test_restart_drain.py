"""Real processes on 127.0.0.1: a coordinator and two node daemons run a job of rollout actors
(in-process) and a learner-like process task; one node daemon gets SIGTERM, drains (its tasks
report "stopped: node nX drained") and exits, and the leader runs those tasks again on the
other node without counting the restarts against the job's intensity. The same with `shoal
train cartpole` (2 learner ranks, 2 rollout workers) on a 2-node `shoal up` cluster: the node of
its learner group drains, the group runs again, as one, on the other node.

This module is also the process task: `main(argv)` sleeps until its node stops it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from shoal.cli import main as cli_main
from shoal.local import LocalCluster, coordinator_specs, node_specs
from tests.support.waiting import eventually

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
ENTRY = "tests.raft.test_restart_drain:main"


def main(argv: list[str]) -> int:
    """The learner-like task: it runs until SIGTERM (the default action ends it)."""
    while True:
        time.sleep(3600)


class Api:
    def __init__(self, local: LocalCluster, url: str) -> None:
        self.local, self.url = local, url

    def get(self, path: str) -> Any:
        return self.local.get(f"{self.url}{path}")

    def submit(self, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            f"{self.url}/v1/jobs",
            data=json.dumps(body).encode(),
            headers={
                "Authorization": f"Bearer {self.local.token}",
                "Content-Type": "application/json",
            },
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=5) as resp:
            return json.loads(resp.read())

    def tasks(self) -> dict[str, dict[str, Any]]:
        return {t["id"]: t for t in self.get("/v1/tasks?job=job")["tasks"]}


def wait_for(what: str, probe: Callable[[], T | None], local: LocalCluster) -> T:
    """`eventually`, with the tails of the cluster's logs on failure."""

    def logs() -> str:
        return "\n".join(f"--- {n}\n{local.tail(n, 20)}" for n in ("c1", "n1", "n2"))

    return eventually(probe, what, timeout=60, detail=logs)


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Api]:
    # The node daemons check, and their children import, this module by its path from ROOT.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    local = LocalCluster(tmp_path)
    coordinators = coordinator_specs(tmp_path, 1, ("--suspect-after", "1", "--dead-after", "3"))
    urls = [s.api_url for s in coordinators if s.api_url]
    nodes = node_specs(tmp_path, urls, 2, 1, 1, ("--heartbeat", "0.3", "--stop-timeout", "5"))
    local.create(coordinators + nodes)
    try:
        local.start_all()
        url = local.wait_ready(timeout=60)
        local.wait_nodes(2, timeout=60)
        yield Api(local, url)
    finally:
        local.stop_all()


def running(tasks: dict[str, dict[str, Any]], avoid: str = "") -> dict[str, dict[str, Any]]:
    if all(t["state"] == "running" and t["node"] not in (None, avoid) for t in tasks.values()):
        return tasks
    return {}


@pytest.mark.timeout(150)
def test_a_drained_nodes_tasks_run_again_on_the_other_node_uncounted(api: Api) -> None:
    rollouts = [
        {"task_id": f"r{i}", "kind": "rollout", "actor": "shoal.runtime.actor:Actor"}
        for i in range(2)
    ]
    learner = {
        "task_id": "l0",
        "kind": "learner-rank",
        "actor": ENTRY,
        "resources": {"gpus": 1},
    }
    spec = {"placement": "auto", "restart": {"max_restarts": 0, "window_s": 600}}
    api.submit({"job_id": "job", "spec": spec, "tasks": [*rollouts, learner]})
    before = wait_for("every task running", lambda: running(api.tasks()), api.local)
    drained = before["l0"]["node"]
    on_it = sorted(t for t, info in before.items() if info["node"] == drained)
    api.local.signal(drained, signal.SIGTERM)
    after = wait_for(
        f"the tasks of {drained} running elsewhere",
        lambda: running(api.tasks(), avoid=drained),
        api.local,
    )
    for task_id in on_it:
        assert after[task_id]["generation"] > before[task_id]["generation"]
    job = api.get("/v1/jobs/job")
    assert job["state"] == "running"  # max_restarts 0: a counted restart would have failed it
    assert job["restart_times"] == []
    events = [e for e in api.get("/v1/events?limit=1000")["events"] if e["kind"] == "restart"]
    restarted = sorted(t for e in events for t in e["fields"]["tasks"])
    assert restarted == on_it
    assert all(e["fields"]["counted"] is False for e in events)
    assert all(f"node {drained} drained" in e["message"] for e in events)


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def _ranks(run_dir: Path, since: float = 0.0) -> dict[int, dict[str, Any]]:
    starts = [e for e in _events(run_dir) if e.get("event") == "start"]
    return {e["rank"]: e for e in starts if e.get("process") == "learner" and e["time"] > since}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_shoal_train_goes_on_when_the_node_of_its_learner_group_drains(tmp_path: Path) -> None:
    cluster_dir, run_dir = tmp_path / "cluster", tmp_path / "run"
    local = LocalCluster(cluster_dir)
    argv = [
        sys.executable, "-m", "shoal", "train", "cartpole", "--cluster", str(cluster_dir),
        "--run-dir", str(run_dir), "--ranks", "2", "--workers", "2", "--time-limit", "200",
        "--target-return", "100000", "--checkpoint-interval", "1", "--quiet", "--json",
        "--no-eval",
    ]  # fmt: skip
    try:
        up = ["up", "--replicas", "1", "--nodes", "2", "--timeout", "60", "--run-dir"]
        assert cli_main([*up, str(cluster_dir)]) == 0
        api = Api(local, local.wait_ready())
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for("both ranks running", lambda: len(_ranks(run_dir)) == 2, local)
            ranks = [t for t in api.get("/v1/tasks")["tasks"] if t["kind"] == "learner-rank"]
            [drained] = {t["node"] for t in ranks}  # one gang, on one node
            drained_at = time.time()
            local.signal(drained, signal.SIGTERM)
            wait_for("a new group", lambda: len(_ranks(run_dir, drained_at)) == 2, local)
            proc.send_signal(signal.SIGINT)  # an orderly stop, as Ctrl-C
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        summary = json.loads(out.strip().splitlines()[-1])
        job_id = summary["job_id"]
        # The drain restarts the group, or, once a checkpoint is recorded, the balancer may move
        # it off the draining node first (a move, not a restart): either way the group went.
        moved = [
            e
            for e in api.get("/v1/events?limit=1000")["events"]
            if e["kind"] in ("restart", "migration", "replace")
            and e["fields"].get("job", job_id) == job_id
        ]
        assert summary["restarts"] >= 1 or moved, err[-2000:]
        job = api.get(f"/v1/jobs/{job_id}")
        assert job["restart_times"] == []  # the node went away: nothing counted
        after = [t for t in job["tasks"] if t["kind"] == "learner-rank"]
        assert all(t["node"] != drained for t in after)
    finally:
        if (cluster_dir / "cluster.json").exists():
            local.stop_all()
