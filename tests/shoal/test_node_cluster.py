"""Real processes on 127.0.0.1: three coordinator replicas and three node daemons.

A node registers its simulated GPUs and heartbeats; tasks placed through the API start (actors
in the node, learner ranks as children) and report their states; bad tasks fail with a reason
while the node stays up; the node follows a new leader; kill -9 makes it suspect then dead;
SIGTERM drains it and it exits 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from shoal.local import LocalCluster, coordinator_specs
from shoal.raft.client import CoordinatorClient
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import TransportConfig, attach
from tests.support.processes import end_group, kill_quietly
from tests.support.waiting import eventually, eventually_async

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

HERE = Path(__file__).parent
T = TypeVar("T")
NODES = ("n1", "n2", "n3")


@dataclass
class Node:
    name: str
    data_dir: Path
    log: Path
    process: subprocess.Popen[bytes]

    def info(self) -> dict[str, Any]:
        return dict(json.loads((self.data_dir / "node.json").read_text()))

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


@dataclass
class Cluster:
    local: LocalCluster
    nodes: dict[str, Node]
    tmp: Path

    def client(self, timeout: float = 15.0) -> CoordinatorClient:
        return CoordinatorClient(
            self.local.api_urls(), self.local.token, timeout=timeout, request_timeout=2.0
        )


def start_node(local: LocalCluster, name: str, tmp: Path) -> Node:
    data_dir = tmp / name
    log = tmp / f"{name}.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [
        sys.executable, "-m", "shoal", "node",
        "--coordinators", ",".join(local.api_urls()),
        "--data-dir", str(data_dir), "--token-file", str(local.run_dir / "api-token"),
        "--node-id", name, "--sim-gpus", "4", "--island-size", "2", "--domain", "rdma0",
        "--heartbeat", "0.3", "--health-period", "0.5", "--stop-timeout", "5",
    ]  # fmt: skip
    with open(log, "ab") as out:
        process = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # so the fixture ends its whole group
        )
    return Node(name, data_dir, log, process)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("nodes")
    local = LocalCluster(tmp / "run")
    local.create(
        coordinator_specs(local.run_dir, 3, ("--suspect-after", "1.5", "--dead-after", "3.5"))
    )
    nodes: dict[str, Node] = {}
    try:
        local.start_all()
        local.wait_ready()
        for name in NODES:
            nodes[name] = start_node(local, name, tmp)
        cluster = Cluster(local, nodes, tmp)
        run(cluster, all_alive)
        yield cluster
    finally:
        for node in nodes.values():
            end_group(node.process)
        local.stop_all()
        for pid_file in tmp.glob("*.pid"):  # task children of nodes that were killed
            kill_quietly(int(pid_file.read_text()))


@pytest.fixture(autouse=True)
def show_node_logs_on_failure(cluster: Cluster) -> Iterator[None]:
    try:
        yield
    except BaseException:
        for node in cluster.nodes.values():
            print(f"--- {node.name} ---\n{node.tail()}")
        raise


def run(cluster: Cluster, body: Callable[[CoordinatorClient], Awaitable[T]]) -> T:
    async def go() -> T:
        async with cluster.client() as client:
            return await body(client)

    return asyncio.run(go())


def sleeper_task(task_id: str, base: Path) -> dict[str, Any]:
    """A learner rank that runs until SIGTERM (test_node_tasks.sleeper), marking `base`."""
    return {
        "task_id": task_id,
        "kind": "learner-rank",
        "actor": "test_node_tasks:sleeper",
        "args": {"argv": [str(base)]},
    }


async def task_in(client: CoordinatorClient, task_id: str, *states: str) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        task = (await client.request("GET", f"/v1/tasks/{task_id}")) or {}
        return task if task.get("state") in states else None

    return await eventually_async(check, f"task {task_id} in {states}")


async def alive(client: CoordinatorClient, node: str) -> bool:
    """Eventually alive: on a loaded machine a heartbeat may be late now and then."""

    async def check() -> bool:
        return bool((await client.node(node))["liveness"] == "alive")

    return await eventually_async(check, f"node {node} alive")


async def all_alive(client: CoordinatorClient) -> None:
    """Every node registered and alive: each test may place on any node and read its record,
    whichever test runs first (or alone)."""

    async def check() -> bool:
        known = {n["id"]: n["liveness"] for n in await client.nodes()}
        return all(known.get(name) == "alive" for name in NODES)

    await eventually_async(check, f"nodes {NODES} registered and alive")


async def submit_and_place(
    client: CoordinatorClient, job_id: str, node: str, tasks: list[dict[str, Any]]
) -> None:
    await client.submit_job(spec={"test": True, "placement": "manual"}, tasks=tasks, job_id=job_id)
    await client.place_tasks({t["task_id"]: node for t in tasks})


def wait_for_file(path: Path) -> str:
    return eventually(lambda: path.exists() and path.read_text(), f"{path} written")


def test_a_node_with_a_wrong_token_exits_with_one_line(cluster: Cluster) -> None:
    token = cluster.tmp / "wrong-token"
    token.write_text("not-the-token")
    token.chmod(0o600)
    argv = [
        sys.executable, "-m", "shoal", "node",
        "--coordinators", ",".join(cluster.local.api_urls()),
        "--data-dir", str(cluster.tmp / "intruder"), "--token-file", str(token),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("shoal: error: ")
    assert "token" in last


def test_nodes_register_their_gpus_and_heartbeat_health(cluster: Cluster) -> None:
    async def body(client: CoordinatorClient) -> dict[str, Any]:
        async def registered() -> dict[str, Any] | None:
            nodes = {n["id"]: n for n in await client.nodes()}
            if all(n in nodes and nodes[n]["health"] for n in NODES):
                return nodes
            return None

        return await eventually_async(registered, "the node registered")

    nodes = run(cluster, body)
    n1 = nodes["n1"]
    assert n1["liveness"] == "alive"
    assert n1["address"] == cluster.nodes["n1"].info()["address"]
    assert n1["address"].startswith("shoal://127.0.0.1:")
    islands = {g["index"]: g["island"] for g in n1["resources"]["gpus"]}
    assert islands == {0: "n1/nvl0", 1: "n1/nvl0", 2: "n1/nvl1", 3: "n1/nvl1"}
    assert {g["domain"] for g in n1["resources"]["gpus"]} == {"rdma0"}
    assert n1["resources"]["cpus"] >= 1
    assert n1["resources"]["memory"] > 0
    assert n1["health"]["summary"]["node"] == "n1"
    assert "nvml" not in n1["health"]["unavailable"]


def test_an_assigned_actor_runs_in_the_node_and_answers(cluster: Cluster) -> None:
    task = {
        "task_id": "echo-1",
        "kind": "rollout",
        "actor": "test_node_tasks:Echo",
        "args": {"greeting": "hi"},
    }

    async def body(client: CoordinatorClient) -> str:
        await submit_and_place(client, "job-echo", "n1", [task])
        running = await task_in(client, "echo-1", "running", "failed")
        assert running["state"] == "running", running
        async with ActorSystem("probe") as system:
            transport = await attach(system, TransportConfig(token=cluster.local.token))
            try:
                ref = transport.ref(f"{cluster.nodes['n1'].info()['address']}/echo-1")
                return str(await ref.ask.hello("from the test"))
            finally:
                await transport.close()

    assert run(cluster, body) == "hi from the test"


def test_a_slow_starting_actor_does_not_hold_up_the_heartbeats(cluster: Cluster) -> None:
    task = {
        "task_id": "slow-1",
        "kind": "rollout",
        "actor": "test_node_tasks:SlowStart",
        "args": {"seconds": 3.0},  # longer than --suspect-after (1.5 s)
    }

    async def body(client: CoordinatorClient) -> list[str]:
        since = int((await client.events(since=0, limit=1))["last_seq"])
        await submit_and_place(client, "job-slow", "n1", [task])
        await task_in(client, "slow-1", "running")
        events = (await client.events(since=since))["events"]
        return [e["message"] for e in events if e["kind"] == "node_liveness"]

    assert not [m for m in run(cluster, body) if m.startswith("node n1 ")]


def test_bad_tasks_fail_with_a_reason_and_the_node_stays_up(cluster: Cluster) -> None:
    tasks = [
        {"task_id": "bad-module", "kind": "rollout", "actor": "no_such_module_xyz:Thing"},
        {"task_id": "bad-class", "kind": "rollout", "actor": "test_node_tasks:NotAnActor"},
        {
            "task_id": "bad-args",
            "kind": "rollout",
            "actor": "test_node_tasks:Echo",
            "args": {"colour": "red"},
        },
        {
            "task_id": "bad-rank",
            "kind": "learner-rank",
            "actor": "test_node_tasks:fail_fast",
            "args": {"argv": ["--world", "0"]},
        },
    ]
    expected = {
        "bad-module": "cannot import module 'no_such_module_xyz'",
        "bad-class": "not a shoal.runtime.Actor subclass",
        "bad-args": "the task args ['colour'] do not fit test_node_tasks:Echo",
        "bad-rank": "exited with status 3: bad rank config: --world 0",
    }

    async def body(client: CoordinatorClient) -> dict[str, str]:
        await submit_and_place(client, "job-bad", "n1", tasks)
        return {t: (await task_in(client, t, "failed"))["message"] for t in expected}

    messages = run(cluster, body)
    for task_id, fragment in expected.items():
        assert fragment in messages[task_id]
    assert cluster.nodes["n1"].process.poll() is None
    assert run(cluster, lambda c: alive(c, "n1"))


def test_a_learner_rank_gets_sigterm_when_its_job_stops(cluster: Cluster) -> None:
    base = cluster.tmp / "rank-stop"
    marker = Path(f"{base}.g1")
    task = sleeper_task("rank-stop", base)

    async def body(client: CoordinatorClient) -> None:
        await submit_and_place(client, "job-rank", "n1", [task])
        await task_in(client, "rank-stop", "running")
        await asyncio.to_thread(wait_for_file, Path(f"{marker}.pid"))
        await client.stop_job("job-rank")

    run(cluster, body)
    assert wait_for_file(marker).startswith("terminated")


def test_a_moved_rank_stops_on_its_old_node_and_starts_on_the_new_one(cluster: Cluster) -> None:
    base = cluster.tmp / "moved"
    task = sleeper_task("rank-moved", base)

    async def body(client: CoordinatorClient) -> dict[str, Any]:
        await submit_and_place(client, "job-moved", "n1", [task])
        await task_in(client, "rank-moved", "running")
        await asyncio.to_thread(wait_for_file, Path(f"{base}.g1.pid"))
        await client.place_tasks({"rank-moved": "n2"})  # generation 2
        await asyncio.to_thread(wait_for_file, Path(f"{base}.g2.pid"))
        return await task_in(client, "rank-moved", "running")

    moved = run(cluster, body)
    assert moved["node"] == "n2"
    assert moved["generation"] == 2
    assert wait_for_file(Path(f"{base}.g1")).startswith("terminated")  # the old rank's checkpoint


def test_a_migration_starts_the_new_copy_before_it_stops_the_old_one(cluster: Cluster) -> None:
    base = cluster.tmp / "mbb"
    task = sleeper_task("rank-mbb", base)
    migrate = {"op": "migrate_task", "args": {"task_id": "rank-mbb", "node_id": "n2"}}

    async def body(client: CoordinatorClient) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        await submit_and_place(client, "job-mbb", "n1", [task])
        await task_in(client, "rank-mbb", "running")
        await asyncio.to_thread(wait_for_file, Path(f"{base}.g1.pid"))
        since = int((await client.events(since=0, limit=1))["last_seq"])
        assert (await client.batch([migrate]))[0]["ok"]
        await asyncio.to_thread(wait_for_file, Path(f"{base}.g2.pid"))

        async def promoted() -> dict[str, Any] | None:
            # looked at BEFORE the consistent read, so a stop seen here preceded that read
            old_stopped = await asyncio.to_thread(Path(f"{base}.g1").exists)
            params = {"consistent": True}
            task = dict(await client.request("GET", "/v1/tasks/rank-mbb", params=params))
            if task["node"] == "n1":
                assert not old_stopped, "the old copy stopped before the new one ran"
                return None
            return task

        moved = await eventually_async(promoted, "a task promoted")
        await asyncio.to_thread(wait_for_file, Path(f"{base}.g1"))

        async def logged() -> list[dict[str, Any]] | None:
            events = (await client.events(since=since))["events"]
            mine = [e for e in events if e["kind"] == "migration"]
            return mine if len(mine) >= 2 else None

        return moved, await eventually_async(logged, "the move logged")

    moved, events = run(cluster, body)
    assert (moved["generation"], moved["incoming"]) == (2, None)
    assert [e["fields"]["phase"] for e in events] == ["started", "promoted"]
    assert events[0]["message"] == "task rank-mbb: started incoming copy on n2"
    assert not Path(f"{base}.g2").exists()  # the new copy still runs


def test_a_report_made_while_every_coordinator_is_down_arrives_later(cluster: Cluster) -> None:
    base = cluster.tmp / "outage"
    task = sleeper_task("rank-outage", base)

    async def place(client: CoordinatorClient) -> None:
        await submit_and_place(client, "job-outage", "n1", [task])
        await task_in(client, "rank-outage", "running")

    run(cluster, place)
    pid = int(wait_for_file(Path(f"{base}.g1.pid")))
    local = cluster.local
    names = [s.name for s in local.specs()]
    try:
        for name in names:
            local.kill(name)
        os.kill(pid, signal.SIGTERM)  # the rank ends while nobody can hear about it
        log = cluster.nodes["n1"].log
        lines = (
            "cannot report task rank-outage stopped yet",
            "heartbeat of n1 failed: coordinators",
        )
        eventually(
            lambda: all(line in log.read_text() for line in lines),
            f"n1 logged {lines}",
        )
        assert cluster.nodes["n1"].process.poll() is None
    finally:
        for name in names:
            if local.pid(name) is None:
                local.start(name)
        local.wait_ready()

    stopped = run(cluster, lambda c: task_in(c, "rank-outage", "stopped"))
    assert stopped["message"] == "exited with status 0"


def test_the_node_follows_a_new_leader(cluster: Cluster) -> None:
    local = cluster.local
    leader_url = local.wait_ready()
    leader = next(s.name for s in local.specs() if s.api_url == leader_url)
    local.kill(leader)
    task = {"task_id": "after-failover", "kind": "rollout", "actor": "test_node_tasks:Echo"}
    try:

        async def body(client: CoordinatorClient) -> dict[str, Any]:
            await submit_and_place(client, "job-failover", "n1", [task])
            return await task_in(client, "after-failover", "running")

        assert run(cluster, body)["state"] == "running"
        assert run(cluster, lambda c: alive(c, "n1"))
    finally:
        local.start(leader)
        local.wait_ready()


def test_kill_9_makes_the_node_suspect_then_dead(cluster: Cluster) -> None:
    base = cluster.tmp / "orphan"
    marker = Path(f"{base}.g1")
    task = sleeper_task("rank-orphan", base)

    async def place(client: CoordinatorClient) -> int:
        await submit_and_place(client, "job-orphan", "n2", [task])
        await task_in(client, "rank-orphan", "running")
        return int((await client.events(since=0, limit=1))["last_seq"])

    since = run(cluster, place)
    wait_for_file(Path(f"{marker}.pid"))
    node = cluster.nodes["n2"]
    node.process.send_signal(signal.SIGKILL)
    node.process.wait(timeout=10)

    async def liveness_changes(client: CoordinatorClient) -> list[tuple[str, str]]:
        async def dead() -> list[tuple[str, str]] | None:
            events = (await client.events(since=since))["events"]
            changes = [
                (e["fields"]["old"], e["fields"]["new"])
                for e in events
                if e["kind"] == "node_liveness" and e["fields"]["node"] == "n2"
            ]
            return changes if ("suspect", "dead") in changes else None

        return await eventually_async(dead, "the node declared dead")

    changes = run(cluster, liveness_changes)
    assert changes[-2:] == [("alive", "suspect"), ("suspect", "dead")]
    # The rank does not outlive its node: it got SIGTERM (checkpoint and exit) when the node died.
    assert wait_for_file(marker).startswith("terminated")


def test_sigterm_drains_the_node_and_exits_zero(cluster: Cluster) -> None:
    base = cluster.tmp / "drained-rank"
    marker = Path(f"{base}.g1")
    tasks = [
        {"task_id": "drain-echo", "kind": "rollout", "actor": "test_node_tasks:Echo"},
        sleeper_task("drain-rank", base),
    ]

    async def place(client: CoordinatorClient) -> None:
        await submit_and_place(client, "job-drain", "n3", tasks)
        for t in tasks:
            await task_in(client, t["task_id"], "running")

    run(cluster, place)
    wait_for_file(Path(f"{marker}.pid"))
    node = cluster.nodes["n3"]
    node.process.send_signal(signal.SIGTERM)
    assert node.process.wait(timeout=60) == 0
    assert wait_for_file(marker).startswith("terminated")

    async def after(client: CoordinatorClient) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        await client.cluster(consistent=True)
        return await client.node("n3"), [
            await task_in(client, t["task_id"], "stopped") for t in tasks
        ]

    record, stopped = run(cluster, after)
    assert record["draining"] is True
    assert record["cordoned"] is True
    assert all(t["message"] == "node n3 drained" for t in stopped)

    # Back after a drain: same id from the data dir, takes tasks again.
    cluster.nodes["n3"] = start_node(cluster.local, "n3", cluster.tmp)

    async def back(client: CoordinatorClient) -> dict[str, Any]:
        async def uncordoned() -> dict[str, Any] | None:
            record = await client.node("n3")
            return None if record["cordoned"] else record

        return await eventually_async(uncordoned, "the node uncordoned")

    record = run(cluster, back)
    assert record["draining"] is False
    assert record["address"] == cluster.nodes["n3"].info()["address"]
