"""Node<->coordinator link proxies (chaos/node_mesh.py) on real sockets, the pure parts of what a
node fault's record says (chaos/nodefate.py, the report's tasks-elsewhere summary), and reading
a job's tasks when no replica answers (chaos/job_faults.py)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import ClientError, ClientSession, ClientTimeout, web
from hypothesis import given
from hypothesis import strategies as st

from shoal.chaos import job_faults
from shoal.chaos.errors import ChaosError, FaultError
from shoal.chaos.job_faults import JobFaults
from shoal.chaos.job_process import ClusterJob, JobConfig
from shoal.chaos.node_mesh import NodeMesh, api_address, coordinator_urls, plan_links
from shoal.chaos.nodefate import TASKS_ELSEWHERE_TARGET_S, NodeFate, moved
from shoal.chaos.report import FaultRecord, RunReport, render_text
from shoal.chaos.traffic import NetFaults
from shoal.chaos.workload import make_client


@dataclass(frozen=True)
class Replica:
    """What NodeMesh reads of a coordinator spec."""

    name: str
    api_url: str | None
    kind: str = "coordinator"
    raft: str | None = None
    raft_bind: str | None = None


@given(
    st.lists(st.sampled_from([f"n{i}" for i in range(1, 9)]), unique=True, max_size=6),
    st.lists(st.sampled_from([f"c{i}" for i in range(1, 8)]), unique=True, min_size=1),
)
def test_every_node_gets_its_own_port_per_replica_in_replica_order(
    nodes: list[str], replicas: list[str]
) -> None:
    counter = itertools.count(20000)
    links = plan_links(nodes, replicas, lambda: next(counter))
    ports = [p for per_node in links.values() for p in per_node.values()]
    assert len(ports) == len(set(ports)) == len(nodes) * len(replicas)
    for node in nodes:
        assert list(links[node]) == replicas
        urls = coordinator_urls(links, node).split(",")
        assert urls == [f"http://127.0.0.1:{links[node][r]}" for r in replicas]
        on_hosts = coordinator_urls(links, node, "10.4.5.1", "https").split(",")
        assert on_hosts == [f"https://10.4.5.1:{links[node][r]}" for r in replicas]


def test_a_proxy_goes_before_an_http_or_https_api() -> None:
    assert api_address("https://10.4.5.1:7001") == ("10.4.5.1", 7001)
    assert api_address("http://127.0.0.1:80/") == ("127.0.0.1", 80)
    for bad in ("https://10.4.5.1", "nonsense", "http://:80"):
        with pytest.raises(ChaosError, match="names no host and port"):
            api_address(bad)


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[str]:
    """A plain HTTP server standing where a replica's API would: the proxies only move bytes."""

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/healthz", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def meshed() -> AsyncIterator[tuple[NodeMesh, dict[str, str]]]:
    """Nodes n1 and n2 each with a proxy (on a free port) to one replica c1."""
    async with serving() as api:
        mesh = NodeMesh(plan_links(["n1", "n2"], ["c1"], lambda: 0))
        try:
            await mesh.start([Replica("c1", api)])
            urls = {n: f"http://127.0.0.1:{mesh.proxies[n]['c1'].port}" for n in ("n1", "n2")}
            yield mesh, urls
        finally:
            await mesh.close()


async def _get(url: str) -> str:
    async with (
        ClientSession(timeout=ClientTimeout(total=2)) as session,
        session.get(f"{url}/healthz") as reply,
    ):
        return await reply.text()


@pytest.mark.timeout(30)
def test_a_partition_cuts_one_node_only_until_healed() -> None:
    async def body() -> None:
        async with meshed() as (mesh, urls):
            assert await _get(urls["n1"]) == "ok"
            detail = mesh.degrade("n1", NetFaults(partition="refuse"))
            assert "n1's links to ['c1']" in detail
            with pytest.raises((ClientError, OSError)):
                await _get(urls["n1"])
            assert await _get(urls["n2"]) == "ok"
            mesh.heal("n1")
            assert await _get(urls["n1"]) == "ok"

    asyncio.run(body())


@pytest.mark.timeout(30)
def test_a_reset_cuts_open_connections() -> None:
    async def body() -> None:
        async with meshed() as (mesh, urls):
            port = mesh.proxies["n2"]["c1"].port
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
            assert mesh.reset("n2") == "reset 1 of n2's connections to the coordinators"
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                await reader.readuntil(b"never")
            writer.close()
            assert await _get(urls["n2"]) == "ok"

    asyncio.run(body())


@pytest.mark.timeout(30)
def test_unknown_nodes_and_replicas_are_refused() -> None:
    async def body() -> None:
        async with serving() as api:
            mesh = NodeMesh({"n1": {"c9": 0}})
            try:
                with pytest.raises(ChaosError, match="replicas \\['c9'\\]; known: \\['c1'\\]"):
                    await mesh.start([Replica("c1", api)])
            finally:
                await mesh.close()
            with pytest.raises(FaultError, match="no coordinator-link proxies for node 'n7'"):
                mesh.heal("n7")

    asyncio.run(body())


_task = st.fixed_dictionaries(
    {
        "id": st.sampled_from(["t1", "t2", "t3"]),
        "node": st.sampled_from(["n1", "n2", None]),
        "state": st.sampled_from(["pending", "running", "failed"]),
        "generation": st.integers(1, 3),
    }
)


@given(
    st.lists(_task, max_size=6),
    st.dictionaries(st.sampled_from(["t1", "t2", "t3"]), st.integers(1, 3)),
)
def test_moved_means_every_task_runs_again_where_it_was_replaced(
    tasks: list[dict[str, object]], before: dict[str, int]
) -> None:
    """Running on another node, or on n1 again at a newer generation (re-placed there);
    never the copy n1 had, nor one that is not running."""
    latest = {t["id"]: t for t in tasks}
    expected = all(
        i in latest
        and latest[i]["state"] == "running"
        and (
            latest[i]["node"] == "n2"
            or (latest[i]["node"] == "n1" and int(str(latest[i]["generation"])) > generation)
        )
        for i, generation in before.items()
    )
    assert moved(sorted(before.items()), "n1", tasks) is expected


def test_a_fate_is_done_once_the_node_is_back_and_its_tasks_settled() -> None:
    fate = NodeFate("n1", [("t1", 1)])
    for state in ("alive", "alive", "suspect", "dead"):
        fate.saw(state)
    assert fate.liveness == ["alive", "suspect", "dead"]
    assert not fate.done(healed=True)
    fate.elsewhere_s = 6.5
    assert not fate.done(healed=True)  # still dead
    fate.saw("alive")
    assert fate.done(healed=True)
    assert not fate.done(healed=False)
    assert "re-placed and running after 6.50 s (target 10 s)" in fate.describe()
    stayed = NodeFate("n2", [("t2", 4)], ["alive", "suspect", "alive"])
    assert stayed.done(healed=True)
    assert "never declared dead" in stayed.describe()


def test_the_report_gives_tasks_elsewhere_against_its_target() -> None:
    killed = FaultRecord("node-kill", "learners", ["n1"], injected_at=3.0, recovered=True)
    killed.recovery_s, killed.tasks_elsewhere_s = 12.0, 7.25
    killed.tasks_elsewhere_target_s = TASKS_ELSEWHERE_TARGET_S
    report = RunReport("s", "/tmp/x", [killed], {}, 0)
    summary = report.to_dict()["tasks_elsewhere"]
    assert summary == {"measured": 1, "max_s": 7.25, "target_s": 10.0, "met": True}
    text = render_text(report)
    assert "tasks running elsewhere after 7.25 s (target 10 s)" in text
    assert "1 measured, max 7.25 s (within the target 10 s)" in text
    none = RunReport("s", "/tmp/x", [], {}, 0).to_dict()["tasks_elsewhere"]
    assert none == {"measured": 0, "max_s": None, "target_s": None, "met": None}


@pytest.mark.timeout(60)
def test_reading_the_jobs_tasks_gives_up_with_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No replica answers (nothing listens on the port): the read is retried, then the fault
    is not injected with the reason, never a hang or a bare OSError."""
    monkeypatch.setattr(job_faults, "READ_RETRY_S", 0.5)
    job = ClusterJob(JobConfig(), tmp_path, 60.0)
    job.run_dir.mkdir()
    (job.run_dir / "events.jsonl").write_text(json.dumps({"event": "submitted", "job": "j1"}))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    faults = JobFaults(job, lambda: make_client([dead], "token"), lambda: ["n1"])
    with pytest.raises(FaultError, match=r"the job.s tasks could not be read for 0\.5 s"):
        asyncio.run(faults.tasks_on("n1"))
    never = JobFaults(ClusterJob(JobConfig(), tmp_path / "x", 60.0), faults._client, list)
    with pytest.raises(FaultError, match="never submitted"):
        asyncio.run(never.learner_nodes())
