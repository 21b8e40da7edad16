"""Real processes on 127.0.0.1: a coordinator and five node daemons with eight simulated GPUs
each, scheduled by the leader's loop. In order: a job's tasks are placed and run; one node's
GPU load is raised through its sim GPU state file and a task migrates with the reason; a node
is killed with SIGKILL and its tasks run elsewhere; an XID raised on a node cordons it and
moves its tasks. A leader killed mid-round hands over without placing twice. Plus
`shoal up --nodes 4 --sim-gpus 8` and `shoal status` through the CLI.

Node health includes the host's real CPU fraction (all nodes share this host), so a busy
machine can delay a migration: the waits are generous, nothing asserts on a timing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from shoal.local import LocalCluster, LocalClusterError, coordinator_specs, node_specs
from shoal.scheduler.health.simgpu import SimGpuBackend
from tests.support.admin import post_json
from tests.support.waiting import eventually

pytestmark = [pytest.mark.slow]

T = TypeVar("T")
ACTOR = "shoal.runtime.actor:Actor"
NODES = 5
ROLLOUTS = 10


class Cluster:
    def __init__(self, local: LocalCluster, api: str) -> None:
        self.local, self.api = local, api

    def get(self, path: str) -> Any:
        return self.local.get(f"{self.api}{path}")

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return post_json(self.local, f"{self.api}{path}", body)

    def tasks(self, job: str) -> dict[str, dict[str, Any]]:
        return {t["id"]: t for t in self.get(f"/v1/tasks?job={job}")["tasks"]}

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.get("/v1/events?limit=1000")["events"] if e["kind"] == kind]

    def migrations(self, phase: str | None) -> list[dict[str, Any]]:
        """The scheduler's migration decisions (phase None), or the state machine's events of
        one make-before-break phase ("started", "promoted", "abandoned")."""
        return [e for e in self.events("migration") if e["fields"].get("phase") == phase]

    def sim(self, node: str) -> SimGpuBackend:
        return SimGpuBackend.attach(self.local.run_dir / "data" / node / "simgpu.json")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, cluster: Cluster) -> T:
    """`eventually`, failing with the tails of the coordinator's and n1's logs."""

    def logs() -> str:
        return "\n".join(f"--- {n}\n{cluster.local.tail(n, 20)}" for n in ("c1", "n1"))

    return eventually(probe, what, timeout, detail=logs)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    run_dir = tmp_path_factory.mktemp("sched")
    local = LocalCluster(run_dir)
    coordinators = coordinator_specs(
        local.run_dir, 1, ("--suspect-after", "1", "--dead-after", "3")
    )
    nodes = node_specs(
        local.run_dir,
        [s.api_url for s in coordinators if s.api_url],
        NODES,
        8,
        8,
        # Health every 2.5 s: an XID counts in one summary only, and the leader replicates the
        # latest summary every 2 s, so a shorter period could let the XID slip between batches.
        ("--heartbeat", "0.3", "--health-period", "2.5", "--stop-timeout", "5"),
    )
    local.create(coordinators + nodes)
    try:
        local.start_all()
        api = local.wait_ready(timeout=60)
        local.wait_nodes(NODES, timeout=60)
        yield Cluster(local, api)
    finally:
        local.stop_all()


def running_on(tasks: dict[str, dict[str, Any]]) -> dict[str, str] | None:
    """task -> node when every task runs, else None."""
    if all(t["state"] == "running" and t["node"] for t in tasks.values()):
        return {t["id"]: t["node"] for t in tasks.values()}
    return None


def moved_to(tasks: dict[str, dict[str, Any]], task: str, target: str) -> dict[str, str] | None:
    """task -> node once every task runs and `task` runs on `target` (a make-before-break move
    leaves the task running on its source until the target's copy runs)."""
    where = running_on(tasks)
    return where if where is not None and where[task] == target else None


@pytest.fixture(scope="module")
def job(cluster: Cluster) -> dict[str, str]:
    """A job of ROLLOUTS rollout actors (1 GPU each), submitted once; task -> node once running."""
    tasks = [
        {
            "task_id": f"r{i}",
            "kind": "rollout",
            "actor": ACTOR,
            "resources": {"cpus": 0.25, "gpus": 1},
        }
        for i in range(ROLLOUTS)
    ]
    cluster.post("/v1/jobs", {"job_id": "job", "spec": {"placement": "auto"}, "tasks": tasks})
    return wait_for("every task running", lambda: running_on(cluster.tasks("job")), 60, cluster)


@pytest.mark.timeout(120)
def test_submitted_tasks_are_placed_spread_and_running(
    cluster: Cluster, job: dict[str, str]
) -> None:
    where = job
    per_node = {n: list(where.values()).count(n) for n in set(where.values())}
    assert per_node == {f"n{i}": 2 for i in range(1, NODES + 1)}
    placed = cluster.events("placement")
    assert {e["fields"]["task"] for e in placed} == set(where)
    assert all("least loaded ready node" in e["message"] for e in placed)


@pytest.mark.timeout(120)
def test_an_overloaded_node_sheds_a_task_with_the_reason(
    cluster: Cluster, job: dict[str, str]
) -> None:
    before = cluster.tasks("job")
    sim = cluster.sim("n1")
    started = time.monotonic()
    for gpu in range(8):
        sim.set_load(gpu, 1.0, 0.95)
    try:
        moved = wait_for(
            "a migration off n1",
            lambda: [e for e in cluster.migrations(None) if e["fields"]["source"] == "n1"],
            90,
            cluster,
        )
        decided = time.monotonic() - started
    finally:
        for gpu in range(8):
            sim.set_load(gpu, 0.0, 0.0)
    task, target = moved[0]["fields"]["task"], moved[0]["fields"]["target"]
    assert before[task]["node"] == "n1"
    assert "relieve n1" in moved[0]["message"]
    overloaded = [e for e in cluster.events("balance") if e["fields"]["action"] == "overloaded"]
    assert any(e["fields"]["node"] == "n1" and "gpu_util" in e["message"] for e in overloaded)
    after = wait_for(
        "the moved task running on its target",
        lambda: moved_to(cluster.tasks("job"), task, target),
        30,
        cluster,
    )
    assert after[task] == target
    assert cluster.tasks("job")[task]["generation"] == before[task]["generation"] + 1
    # make-before-break: the copy on the target ran before the one on n1 was let go
    started = [e for e in cluster.migrations("started") if e["fields"]["task"] == task]
    promoted = [e for e in cluster.migrations("promoted") if e["fields"]["task"] == task]
    assert started[0]["message"] == f"task {task}: started incoming copy on {target}"
    assert promoted[0]["seq"] > started[0]["seq"]
    print(f"\nmigration decided {decided:.1f} s after n1's GPUs went to 100%")


@pytest.mark.timeout(120)
def test_a_killed_node_goes_dead_and_its_tasks_run_elsewhere(
    cluster: Cluster, job: dict[str, str]
) -> None:
    victim = "n3"
    before = cluster.tasks("job")
    lost = {t for t, rec in before.items() if rec["node"] == victim}
    assert lost
    started = time.monotonic()
    cluster.local.signal(victim, signal.SIGKILL)

    def replaced() -> bool:
        tasks = cluster.tasks("job")
        return all(tasks[t]["node"] != victim and tasks[t]["state"] == "running" for t in lost)

    wait_for("the victim's tasks running elsewhere", replaced, 60, cluster)
    took = time.monotonic() - started
    liveness = [
        e for e in cluster.get("/v1/events?limit=1000")["events"] if e["kind"] == "node_liveness"
    ]
    changes = [e["fields"]["new"] for e in liveness if e["fields"]["node"] == victim]
    assert changes[-2:] == ["suspect", "dead"]
    replace = [e for e in cluster.events("replace") if e["fields"]["task"] in lost]
    assert {e["fields"]["task"] for e in replace} == lost
    assert all(f"was on dead node {victim}" in e["message"] for e in replace)
    print(f"\nkill -9 of {victim} to its tasks running elsewhere: {took:.1f} s")


@pytest.mark.timeout(120)
def test_an_xid_cordons_the_node_and_moves_its_tasks(cluster: Cluster, job: dict[str, str]) -> None:
    node = "n4"
    before = cluster.tasks("job")
    on_node = {t for t, rec in before.items() if rec["node"] == node}
    assert on_node
    cluster.sim(node).raise_xid(2, 79)
    cordon = wait_for(
        "the cordon event",
        lambda: [e for e in cluster.events("cordon") if e["fields"]["node"] == node],
        60,
        cluster,
    )
    assert "XID" in cordon[0]["message"]
    record = cluster.get(f"/v1/nodes/{node}")
    assert record["cordoned"]
    assert record["draining"]

    def moved() -> bool:
        tasks = cluster.tasks("job")
        return all(tasks[t]["node"] != node and tasks[t]["state"] == "running" for t in on_node)

    wait_for(f"{node}'s tasks running elsewhere", moved, 90, cluster)
    reasons = [e["message"] for e in cluster.migrations(None) if e["fields"]["source"] == node]
    assert reasons
    assert all(f"drain {node}" in r and "XID" in r for r in reasons)


@pytest.mark.timeout(120)
def test_shoal_up_with_nodes_and_status_show_nodes_gpus_and_islands(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "SHOAL_RUN_DIR": str(run_dir)}

    def shoal(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "shoal", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )

    try:
        up = shoal("up", "--replicas", "1", "--nodes", "4", "--sim-gpus", "8", "--timeout", "60")
        assert up.returncode == 0, up.stderr
        assert "4 nodes, 32 GPUs in 4 NVLink islands" in up.stdout
        status = shoal("status", "--json")
        assert status.returncode == 0, status.stderr
        nodes = json.loads(status.stdout)["nodes"]
        assert sorted(n["id"] for n in nodes) == ["n1", "n2", "n3", "n4"]
        assert sum(n["gpus"] for n in nodes) == 32
        assert all(n["islands"] == {f"{n['id']}/nvl0": 8} for n in nodes)
        table = shoal("status")
        assert "nodes 4, GPUs 32" in table.stdout
        assert "n1/nvl0 (8)" in table.stdout
        bad = shoal("up", "--nodes", "-1")
        assert bad.returncode != 0
        assert "--nodes=-1" in bad.stderr
    finally:
        down = shoal("down")
        assert down.returncode == 0, down.stderr


@pytest.fixture
def replicated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Three replicas and two nodes with four GPUs each."""
    local = LocalCluster(tmp_path_factory.mktemp("failover"))
    coordinators = coordinator_specs(local.run_dir, 3)
    urls = [s.api_url for s in coordinators if s.api_url]
    local.create(coordinators + node_specs(local.run_dir, urls, 2, 4, 4, ("--heartbeat", "0.3")))
    try:
        local.start_all()
        api = local.wait_ready(timeout=60)
        local.wait_nodes(2, timeout=60)
        yield Cluster(local, api)
    finally:
        local.stop_all()


@pytest.mark.timeout(150)
def test_a_new_leader_takes_over_scheduling_without_placing_twice(replicated: Cluster) -> None:
    """The leader is killed right after the submit, while its loop may be mid-round."""
    local = replicated.local
    old = next(s for s in local.specs() if s.api_url == replicated.api)
    tasks = [
        {"task_id": f"f{i}", "kind": "rollout", "actor": ACTOR, "resources": {"cpus": 0.1}}
        for i in range(6)
    ]
    body = {"job_id": "fo", "spec": {"placement": "auto"}, "tasks": tasks}
    replicated.post("/v1/jobs", body)
    local.signal(old.name, signal.SIGKILL)
    survivors = [s.name for s in local.specs() if s.kind == "coordinator" and s != old]
    replicated.api = wait_for(
        "a new leader", lambda: _leader_of(local, survivors, old.api_url), 60, replicated
    )
    assert replicated.api != old.api_url
    where = wait_for(
        "every task running", lambda: running_on(replicated.tasks("fo")), 60, replicated
    )
    assert sorted(where) == [f"f{i}" for i in range(6)]
    assert all(t["generation"] == 1 for t in replicated.tasks("fo").values())
    assert set(where.values()) == {"n1", "n2"}


def _leader_of(local: LocalCluster, names: list[str], old: str | None) -> str | None:
    """The API of a leader other than `old` that `names` agree on, or None while electing."""
    try:
        api = local.wait_ready(names, timeout=2)
    except LocalClusterError:
        return None
    return None if api == old else api
