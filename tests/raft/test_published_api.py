"""Published task state, GPUs and pending reasons through the admin API of three real replica
processes, over real sockets: a node publishes for its task's generation and every node of the
job gets it in its heartbeat's peers and readers in the job view; a stale generation is a 409;
hostile bodies are refused with a JSON error while the replica serves on; GPUs the leader gave
stay the same across a leader failover; a request no island could hold shows why it waits."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from shoal.local import LocalCluster
from shoal.raft.client import CoordinatorClient
from shoal.raft.errors import Conflict, NotFound
from tests.support.waiting import eventually

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ACTOR = "shoal.tasks:main"
HEARTBEAT_S = 0.3


def token(cluster: LocalCluster, role: str) -> str:
    name = {"operator": "api-token", "node": "node-token", "read": "read-token"}[role]
    return (cluster.run_dir / name).read_text().strip()


def call(
    url: str,
    auth: str,
    method: str,
    path: str,
    body: Any = None,
    raw: bytes | None = None,
) -> tuple[int, Any]:
    """One request over a fresh socket; the answer's status and JSON body."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {
        "Authorization": f"Bearer {auth}",
        "Content-Type": "application/json",
        "X-Shoal-Op-Id": uuid.uuid4().hex,
    }
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def leader(cluster: LocalCluster) -> str:
    """The API URL of the leader the running replicas agree on, once it is one of them."""
    alive = [s for s in cluster.specs() if cluster.pid(s.name)]
    urls = {s.api_url for s in alive}

    def live_leader() -> str | None:
        url = cluster.wait_ready([s.name for s in alive])
        return url if url in urls else None

    return eventually(live_leader, "a leader among the running replicas")


def follower(cluster: LocalCluster) -> str:
    url = leader(cluster)
    return next(u for u in cluster.api_urls() if u != url)


def leader_name(cluster: LocalCluster) -> str:
    url = cluster.wait_ready()
    return next(s.name for s in cluster.specs() if s.api_url == url)


def register(cluster: LocalCluster, node_id: str, gpus: int, cpus: float) -> None:
    body = {
        "node_id": node_id,
        "address": f"shoal://127.0.0.1:{9000 + len(node_id)}",
        "resources": {
            "cpus": cpus,
            "memory": 1 << 34,
            "gpus": [
                {"index": i, "uuid": f"{node_id}-{i}", "island": f"{node_id}/nvl"}
                for i in range(gpus)
            ],
        },
    }
    status, answer = call(leader(cluster), token(cluster, "node"), "POST", "/v1/nodes", body)
    assert status == 201, answer


def heartbeat(cluster: LocalCluster, node_id: str) -> dict[str, Any]:
    path = f"/v1/nodes/{node_id}/heartbeat"
    status, reply = call(follower(cluster), token(cluster, "node"), "POST", path, {})
    assert status == 200, reply
    return dict(reply)


@contextlib.contextmanager
def heartbeating(cluster: LocalCluster, node_id: str) -> Iterator[None]:
    """Keep `node_id` alive from a thread (any replica that answers), stopped on exit."""
    stop = threading.Event()
    path = f"/v1/nodes/{node_id}/heartbeat"

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            for url in cluster.api_urls():
                with contextlib.suppress(OSError, ValueError):
                    if call(url, token(cluster, "node"), "POST", path, {})[0] == 200:
                        break

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def job(cluster: LocalCluster, job_id: str) -> dict[str, Any]:
    status, view = call(leader(cluster), token(cluster, "read"), "GET", f"/v1/jobs/{job_id}")
    assert status == 200, view
    return {t["id"]: t for t in view["tasks"]}


def submit(cluster: LocalCluster, job_id: str, mode: str, tasks: list[dict[str, Any]]) -> None:
    body = {"job_id": job_id, "spec": {"placement": mode}, "tasks": tasks}
    status, answer = call(leader(cluster), cluster.token, "POST", "/v1/jobs", body)
    assert status == 201, answer


def task(task_id: str, kind: str = "learner-rank", cpus: float = 1, gpus: int = 0) -> Any:
    resources = {"cpus": cpus, "gpus": gpus}
    return {"task_id": task_id, "kind": kind, "actor": ACTOR, "resources": resources}


def node_client(cluster: LocalCluster) -> CoordinatorClient:
    return CoordinatorClient(cluster.api_urls(), token(cluster, "node"), timeout=20.0)


@pytest.fixture(scope="module")
def published(cluster: LocalCluster) -> dict[str, Any]:
    """Job `pub`, placed by hand: its learner on `pa` (GPUs 1 and 2), its rollout on `pb`."""
    register(cluster, "pa", gpus=4, cpus=2)
    register(cluster, "pb", gpus=0, cpus=2)
    submit(cluster, "pub", "manual", [task("pub-learner", gpus=2), task("pub-rollout", "rollout")])
    rows = [
        {"task_id": "pub-learner", "node_id": "pa", "gpus": [1, 2]},
        {"task_id": "pub-rollout", "node_id": "pb"},
    ]
    status, answer = call(
        leader(cluster), cluster.token, "POST", "/v1/placements", {"placements": rows}
    )
    assert status == 200, answer
    state = {"transport": "10.1.0.2:4100", "rendezvous": "10.1.0.2:29500", "rank": 0}

    async def publish() -> dict[str, Any]:
        async with node_client(cluster) as c:
            generation = job(cluster, "pub")["pub-learner"]["generation"]
            return await c.publish_task_state("pub-learner", generation, state)

    answer = asyncio.run(publish())
    assert answer == {"task_id": "pub-learner", "generation": 1, "published": state}
    return state


def test_a_published_state_is_in_the_job_view_and_in_every_job_nodes_peers(
    cluster: LocalCluster, published: dict[str, Any]
) -> None:
    learner = job(cluster, "pub")["pub-learner"]
    assert (learner["published"], learner["gpus"], learner["node"]) == (published, [1, 2], "pa")
    peer = {
        "id": "pub-learner",
        "generation": 1,
        "node": "pa",
        "state": "pending",
        "published": published,
    }
    on_b = heartbeat(cluster, "pb")  # sent to a follower, which forwards to the leader
    assert on_b["peers"] == {"pub": [peer]}
    assert [t["gpus"] for t in on_b["tasks"]] == [[]]
    on_a = heartbeat(cluster, "pa")
    assert on_a["peers"] == {"pub": [peer]}
    assert [(t["id"], t["gpus"], t["published"]) for t in on_a["tasks"]] == [
        ("pub-learner", [1, 2], published)
    ]


def test_a_stale_generation_is_a_409_and_an_unknown_task_a_404(
    cluster: LocalCluster, published: dict[str, Any]
) -> None:
    rows = [{"task_id": "pub-rollout", "node_id": "pa"}]  # placed anew: generation 2
    status, _ = call(leader(cluster), cluster.token, "POST", "/v1/placements", {"placements": rows})
    assert status == 200

    async def attempts() -> tuple[Conflict, NotFound]:
        async with node_client(cluster) as c:
            with pytest.raises(Conflict) as stale:
                await c.publish_task_state("pub-rollout", 1, {"late": True})
            with pytest.raises(NotFound) as unknown:
                await c.publish_task_state("nobody", 1, {})
            return stale.value, unknown.value

    stale, unknown = asyncio.run(attempts())
    assert "generation 1, but the task is at generation 2" in str(stale)
    assert stale.field == "generation"
    assert "nobody" in str(unknown)
    status, body = call(
        follower(cluster), token(cluster, "node"), "PUT", "/v1/tasks/pub-rollout/published",
        {"generation": 1, "state": {}},
    )  # fmt: skip
    assert (status, body["error"]) == (409, "conflict")
    assert job(cluster, "pub")["pub-rollout"]["published"] == {}


HOSTILE: dict[str, tuple[bytes, int, str, str]] = {
    "over 4 KiB": (
        json.dumps({"generation": 1, "state": {f"k{i}": "v" * 1000 for i in range(5)}}).encode(),
        422,
        "body.state",
        "more than 4096",
    ),
    "33 keys": (
        json.dumps({"generation": 1, "state": {f"k{i}": i for i in range(33)}}).encode(),
        422,
        "body.state",
        "at most 32 keys",
    ),
    "a nested value": (
        b'{"generation": 1, "state": {"a": {"b": 1}}}',
        422,
        "body.state.a",
        "must be string or number or boolean or null",
    ),
    "a list for state": (b'{"generation": 1, "state": [1, 2]}', 422, "body.state", "object"),
    "a long key": (
        json.dumps({"generation": 1, "state": {"k" * 65: 1}}).encode(),
        422,
        "body.state." + "k" * 65,
        "as a key",
    ),
    "a text generation": (b'{"generation": "1", "state": {}}', 422, "body.generation", "integer"),
    "no state": (b'{"generation": 1}', 422, "body.state", "required"),
    "100,000 levels": (b'{"a":' * 100_000, 400, "body", "deeper than"),
    "not JSON": (b"{generation: 1", 400, "body", ""),
    "5 MiB": (b'{"generation": 1, "state": {"a": "' + b"x" * (5 << 20) + b'"}}', 413, "body", ""),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_publication_is_refused_by_name_and_the_replica_serves_on(
    cluster: LocalCluster, published: dict[str, Any], case: str
) -> None:
    raw, status, field, needle = HOSTILE[case]
    url = follower(cluster)
    path = "/v1/tasks/pub-learner/published"
    got, body = call(url, token(cluster, "node"), "PUT", path, raw=raw)
    assert (got, body["field"]) == (status, field), body
    assert needle in body["message"]
    assert job(cluster, "pub")["pub-learner"]["published"] == published
    assert call(url, "", "GET", "/healthz")[0] == 200
    again = {"generation": 1, "state": published}
    assert call(url, token(cluster, "node"), "PUT", path, again)[0] == 200


def test_the_read_token_cannot_publish(cluster: LocalCluster, published: dict[str, Any]) -> None:
    body = {"generation": 1, "state": {"x": 1}}
    path = "/v1/tasks/pub-learner/published"
    status, answer = call(leader(cluster), token(cluster, "read"), "PUT", path, body)
    assert (status, answer["error"]) == (403, "forbidden")
    assert "node role" in answer["message"]


def test_gpus_the_leader_gave_stay_the_same_after_a_leader_failover(cluster: LocalCluster) -> None:
    """Two groups take GPUs 0-1 and 2-3 of `pg`; one stops, the leader is killed; the new
    leader places a third group on exactly the freed GPUs and leaves the other's alone."""
    register(cluster, "pg", gpus=4, cpus=64)
    old = leader_name(cluster)
    try:
        with heartbeating(cluster, "pg"):
            for name in ("g1", "g2"):
                submit(cluster, name, "auto", [task(f"{name}-l0", cpus=8, gpus=2)])
            eventually(lambda: _placed(cluster, "g1") and _placed(cluster, "g2"), "both placed")
            g1, g2 = _placed(cluster, "g1"), _placed(cluster, "g2")
            assert g1 is not None
            assert g2 is not None
            assert sorted(g1["gpus"] + g2["gpus"]) == [0, 1, 2, 3]
            status, _ = call(leader(cluster), cluster.token, "POST", "/v1/jobs/g1/stop", {})
            assert status == 200
            cluster.kill(old)
            submit(cluster, "g3", "auto", [task("g3-l0", cpus=8, gpus=2)])
            g3 = eventually(lambda: _placed(cluster, "g3"), "g3 placed by the new leader")
            assert g3["gpus"] == g1["gpus"]
            after = job(cluster, "g2")["g2-l0"]
            assert (after["gpus"], after["generation"]) == (g2["gpus"], g2["generation"])
    finally:
        if cluster.pid(old) is None:
            cluster.start(old)
        cluster.wait_ready()


def _placed(cluster: LocalCluster, job_id: str) -> dict[str, Any] | None:
    """The job's one task once it holds its GPUs on `pg`, else None."""
    with contextlib.suppress(OSError, AssertionError):
        (only,) = job(cluster, job_id).values()
        if only["node"] == "pg" and only["gpus"]:
            return dict(only)
    return None


def test_a_group_no_island_could_hold_waits_with_the_reason_in_the_job_view(
    cluster: LocalCluster,
) -> None:
    read = token(cluster, "read")
    status, page = call(leader(cluster), read, "GET", "/v1/events?limit=1")
    assert status == 200
    since = page["last_seq"]
    submit(cluster, "huge", "auto", [task("huge-l0", gpus=64), task("huge-l1", gpus=64)])

    def reasons() -> list[str] | None:
        tasks = job(cluster, "huge").values()
        found = [t["pending_reason"] for t in tasks if t["state"] == "pending"]
        return found if len(found) == 2 and all(found) else None

    for reason in eventually(reasons, "both ranks of huge show why they wait"):
        assert "learner group 'huge' needs 128 GPUs (2 ranks × 64" in reason
        assert "the largest NVLink island holds" in reason
        assert "ask for fewer GPUs" in reason
    status, page = call(leader(cluster), read, "GET", f"/v1/events?since={since}")
    assert status == 200
    refused = [e for e in page["events"] if e["kind"] == "refused" and e["fields"]["job"] == "huge"]
    assert sorted(e["fields"]["task"] for e in refused) == ["huge-l0", "huge-l1"]
    status, _ = call(leader(cluster), cluster.token, "POST", "/v1/jobs/huge/stop", {})
    assert status == 200
    assert all(t["pending_reason"] == "" for t in job(cluster, "huge").values())
