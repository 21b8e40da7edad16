"""Faults through the chaos API on real processes: one coordinator replica started with
`[chaos] enabled = true` and two node daemons. A task killed through the API is restarted by
the leader; a paused one is stopped, then continued; an XID raised on a simulated GPU shows in
the node's replicated health; node-kill SIGKILLs the daemon once, and not again when it is back;
a node with no simulated GPUs refuses gpu-xid with a clear outcome."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from shoal.local import LocalCluster, coordinator_specs, node_specs
from shoal.raft.client import CoordinatorClient
from shoal.raft.errors import Conflict
from shoal.runtime import loop
from tests.support.waiting import eventually

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

HERE = Path(__file__).parent
T = TypeVar("T")
SETTINGS = """
[chaos]
enabled = true

[liveness]
suspect_after = 1.5
dead_after = 3.0
health_period = 0.5

[scheduler]
period = 0.2
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("faults")
    config = tmp / "coordinator.toml"
    config.write_text(SETTINGS)
    local = LocalCluster(tmp / "run")
    coordinators = coordinator_specs(local.run_dir, 1, ("--config", str(config)))
    urls = [s.api_url for s in coordinators if s.api_url]
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    fast = ("--heartbeat", "0.3", "--health-period", "0.3", "--stop-timeout", "5")
    with_gpus = node_specs(local.run_dir, urls, 1, 2, extra_args=fast)
    # n2 runs no simulated GPUs: gpu-xid must be refused there.
    without = node_specs(local.run_dir, urls, 2, 0, extra_args=fast)[1:]
    local.create([*coordinators, *(dataclasses.replace(s, env=env) for s in with_gpus + without)])
    try:
        local.start_all()
        local.wait_ready()
        local.wait_nodes(2)
        yield local
    finally:
        local.stop_all()


def call(local: LocalCluster, fn: Callable[[CoordinatorClient], Any]) -> Any:
    async def body() -> Any:
        async with CoordinatorClient(local.api_urls(), local.token, timeout=15.0) as client:
            return await fn(client)

    return loop.run(body())


def inject(local: LocalCluster, kind: str, target: str, **params: Any) -> dict[str, Any]:
    return dict(call(local, lambda c: c.inject_fault(kind, target, **params)))


def outcome(local: LocalCluster, fault_id: str, states: tuple[str, ...]) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        fault = call(local, lambda c: c.fault(fault_id))
        return fault if fault["state"] in states else None

    return eventually(check, f"fault {fault_id} {states}")


def task(local: LocalCluster, task_id: str) -> dict[str, Any]:
    return dict(call(local, lambda c: c.request("GET", f"/v1/tasks/{task_id}")))


def start_sleeper(local: LocalCluster, name: str, tmp: Path) -> tuple[int, int]:
    """A process task in a job the leader places and restarts: (generation, pid) once up."""
    base = tmp / name
    spec = {
        "task_id": name,
        "kind": "rollout-worker",
        "actor": "test_node_tasks:sleeper",
        "args": {"argv": [str(base)]},
    }
    call(local, lambda c: c.submit_job(spec={"placement": "auto"}, tasks=[spec], job_id=name))

    def up() -> tuple[int, int] | None:
        """Running, and its current incarnation wrote its pid (the balancer may have moved it
        meanwhile: then the newer generation's file is the one to wait for)."""
        t = task(local, name)
        pid_file = Path(f"{base}.g{t['generation']}.pid")
        if t["state"] != "running" or not pid_file.exists() or not pid_file.read_text():
            return None
        return t["generation"], int(pid_file.read_text())

    return eventually(up, f"task {name} running with its pid file")


def proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_task_killed_through_the_api_is_restarted_by_the_leader(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    generation, pid = start_sleeper(cluster, "victim", tmp_path)
    fault = inject(cluster, "task-kill", "victim")
    assert fault["generation"] == generation
    done = outcome(cluster, fault["id"], ("injected", "failed"))
    assert done["state"] == "injected", done
    assert f"SIGKILL sent to task victim (pid {pid})" in done["message"]
    eventually(lambda: proc_state(pid) in ("gone", "Z"), "the killed task gone")
    again = eventually(
        lambda: (
            (t := task(cluster, "victim"))["generation"] > generation
            and t["state"] == "running"
            and t
        ),
        "the task running again",
    )
    assert again["restarts"] >= 1
    healed = outcome(cluster, fault["id"], ("healed",))
    assert healed["recovery_s"] > 0
    assert "1 task(s) running again" in healed["message"]
    call(cluster, lambda c: c.stop_job("victim"))


def test_a_task_paused_through_the_api_is_continued_after_its_duration(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    generation, pid = start_sleeper(cluster, "sleepy", tmp_path)
    fault = inject(cluster, "task-pause", "sleepy", duration_s=6.0)
    outcome(cluster, fault["id"], ("injected", "healed", "failed"))
    assert proc_state(pid) == "T"
    healed = outcome(cluster, fault["id"], ("healed", "failed"))
    assert healed["state"] == "healed", healed
    assert proc_state(pid) in ("S", "R")
    assert task(cluster, "sleepy")["generation"] == generation
    call(cluster, lambda c: c.stop_job("sleepy"))


def test_gpu_xid_is_refused_for_a_node_that_registered_no_gpus(cluster: LocalCluster) -> None:
    with pytest.raises(Conflict, match="node 'n2' registered no GPUs, not GPU 0"):
        inject(cluster, "gpu-xid", "n2", gpu=0)


def test_node_kill_kills_the_daemon_once_and_heals_when_its_task_runs_elsewhere(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    # With n1 cordoned the leader places the task on n2; uncordoned, n1 takes it back.
    call(cluster, lambda c: c.cordon("n1"))
    try:
        generation, _ = start_sleeper(cluster, "stranded", tmp_path)
    finally:
        call(cluster, lambda c: c.uncordon("n1"))
    assert task(cluster, "stranded")["node"] == "n2"
    pid = cluster.pid("n2")
    assert pid is not None
    fault = inject(cluster, "node-kill", "n2")
    assert fault["tasks"] == {"stranded": generation}
    eventually(lambda: cluster.pid("n2") is None, "n2 gone")
    done = outcome(cluster, fault["id"], ("injected", "healed"))
    assert f"daemon pid {pid}) SIGKILLed itself" in done["message"]
    assert "SIGKILL" in (Path(cluster.run_dir) / "data" / "n2" / "chaos-faults.json").read_text()
    healed = outcome(cluster, fault["id"], ("healed",))
    moved = task(cluster, "stranded")
    assert (moved["node"], moved["state"]) == ("n1", "running")
    assert moved["generation"] > generation
    assert healed["recovery_s"] > 0
    assert call(cluster, lambda c: c.node("n2"))["liveness"] == "dead"
    call(cluster, lambda c: c.stop_job("stranded"))

    cluster.start("n2")
    eventually(lambda: call(cluster, lambda c: c.node("n2"))["liveness"] == "alive", "n2 back", 40)
    time.sleep(2.0)  # several heartbeats: the ledger keeps the fault from running again
    assert cluster.pid("n2") is not None
    assert call(cluster, lambda c: c.fault(fault["id"]))["state"] == "healed"


def test_the_cli_kills_a_task_and_waits_until_it_runs_again(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    generation, _ = start_sleeper(cluster, "cli-victim", tmp_path)
    argv = [
        sys.executable, "-m", "shoal", "chaos", "inject", "task-kill", "--target", "cli-victim",
        "--run-dir", str(cluster.run_dir), "--wait", "60",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "injected: SIGKILL sent to task cli-victim" in done.stdout
    assert re.search(r"healed: 1 task\(s\) running again [\d.]+ s after", done.stdout)
    assert task(cluster, "cli-victim")["generation"] > generation
    call(cluster, lambda c: c.stop_job("cli-victim"))


def test_an_xid_raised_through_the_api_shows_in_the_replicated_health(
    cluster: LocalCluster,
) -> None:
    fault = inject(cluster, "gpu-xid", "n1", gpu=1, xid=48)
    done = outcome(cluster, fault["id"], ("injected", "failed"))
    assert done["state"] == "injected", done
    assert "XID 48 raised on simulated GPU 1 of node n1" in done["message"]

    def xids() -> int:
        node = call(cluster, lambda c: c.request("GET", "/v1/nodes/n1?consistent=true"))
        return int(node["health"].get("summary", {}).get("xid_total", 0))

    assert eventually(xids, "the XID in n1's replicated health") >= 1


def test_the_cli_injects_through_the_api_and_prints_the_outcome(cluster: LocalCluster) -> None:
    argv = [
        sys.executable, "-m", "shoal", "chaos", "inject", "gpu-xid", "--target", "n1",
        "--gpu", "0", "--xid", "79",
        "--coordinator", ",".join(cluster.api_urls()),
        "--token-file", str(cluster.run_dir / "api-token"),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"fault \w+: gpu-xid of n1 on node n1 requested", done.stdout)
    assert "injected: XID 79 raised on simulated GPU 0 of node n1" in done.stdout
    done = subprocess.run(
        [*argv[:7], "no-such-node", *argv[8:]], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip() == ("shoal: error: no node 'no-such-node'; see GET /v1/nodes")
