"""Roles on the admin API, over real sockets against a real replica: the operator token may do
everything, the node credential only what node daemons and their tasks call (never submit a
job), the read-only token only GETs; and the allow-list of task entry points."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shoal.errors import ConfigError
from shoal.local import LocalCluster, coordinator_specs, node_specs
from shoal.raft.config import ApiSection, CoordinatorConfig
from shoal.raft.entry_points import allowed

from .inprocess import SECRET, TOKEN, InProcessReplica

NODE = "node-credential-0123456789"
READ = "read-only-token-0123456789"
NODE_BODY = {"node_id": "n1", "address": "127.0.0.1:1", "resources": {"cpus": 1, "memory": 1}}


def job(job_id: str, actor: str = "shoal.tasks:main") -> dict[str, Any]:
    return {"job_id": job_id, "tasks": [{"task_id": f"{job_id}-t", "kind": "x", "actor": actor}]}


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessReplica]:
    rep = InProcessReplica(
        tmp_path_factory.mktemp("roles"),
        node_token=NODE,
        read_token=READ,
        task_entry_points=("mylab.",),
    )
    try:
        rep.start()
        yield rep
    finally:
        rep.close()


def test_the_node_credential_registers_and_heartbeats_but_cannot_submit(
    replica: InProcessReplica,
) -> None:
    assert replica.request("POST", "/v1/nodes", NODE_BODY, token=NODE)[0] == 201
    assert replica.request("POST", "/v1/nodes/n1/heartbeat", {}, token=NODE)[0] == 200
    assert replica.request("GET", "/v1/nodes/n1", token=NODE)[0] == 200
    status, body = replica.request("POST", "/v1/jobs", job("by-node"), token=NODE)
    assert status == 403
    assert body["error"] == "forbidden"
    assert "needs the operator role" in body["message"]
    assert "node token" in body["message"]
    assert "--token-file" in body["message"]
    assert replica.request("POST", "/v1/nodes/n1/cordon", {}, token=NODE)[0] == 403
    assert replica.request("GET", "/v1/jobs/by-node", token=TOKEN)[0] == 404


def test_the_read_token_reads_but_writes_nothing(replica: InProcessReplica) -> None:
    assert replica.request("GET", "/v1/nodes", token=READ)[0] == 200
    assert replica.request("GET", "/metrics", token=READ)[0] == 200
    status, body = replica.request("POST", "/v1/nodes", {**NODE_BODY, "node_id": "r"}, token=READ)
    assert status == 403
    assert "needs the node role" in body["message"]
    status, body = replica.request("POST", "/v1/jobs", job("by-reader"), token=READ)
    assert status == 403
    assert "needs the operator role" in body["message"]
    assert replica.request("GET", "/v1/nodes/r", token=TOKEN)[0] == 404


def test_the_operator_token_does_everything(replica: InProcessReplica) -> None:
    assert replica.request("POST", "/v1/nodes", {**NODE_BODY, "node_id": "op"})[0] == 201
    assert replica.request("POST", "/v1/nodes/op/heartbeat", {})[0] == 200
    assert replica.request("POST", "/v1/nodes/op/cordon", {})[0] == 200
    assert replica.request("POST", "/v1/jobs", job("by-operator"))[0] == 201
    assert replica.request("POST", "/v1/jobs/by-operator/stop", {})[0] == 200


def test_the_read_role_sees_secret_environment_values_redacted(replica: InProcessReplica) -> None:
    env = {"SHOAL_NODE_TOKEN": "n0de", "hf_secret_key": "hf", "PATH": "/bin", "SEED": "3"}
    spec = {"task_id": "env-t", "kind": "x", "actor": "shoal.tasks:main", "args": {"env": env}}
    assert replica.request("POST", "/v1/jobs", {"job_id": "env", "tasks": [spec]})[0] == 201
    shown = {**env, "SHOAL_NODE_TOKEN": "<redacted>", "hf_secret_key": "<redacted>"}
    for who, expected in ((READ, shown), (NODE, env), (TOKEN, env)):
        views = [
            replica.request("GET", "/v1/jobs/env", token=who)[1]["tasks"][0],
            replica.request("GET", "/v1/tasks?job=env", token=who)[1]["tasks"][0],
            replica.request("GET", "/v1/tasks/env-t", token=who)[1],
            next(
                t
                for j in replica.request("GET", "/v1/dashboard", token=who)[1]["jobs"]
                for t in j["tasks"]
                if t["id"] == "env-t"
            ),
        ]
        assert [v["args"]["env"] for v in views] == [expected] * 4


@pytest.mark.parametrize("token", ["wrong-token-0123456789", "", TOKEN + "x", NODE[:-1]])
def test_a_wrong_token_is_refused_and_the_replica_still_serves(
    replica: InProcessReplica, token: str
) -> None:
    status, body = replica.request("GET", "/v1/nodes", token=token)
    assert status == 403
    assert "wrong bearer token" in body["message"]
    assert replica.request("GET", "/v1/nodes", token=None)[0] == 401
    assert replica.request("GET", "/healthz", token=None)[0] == 200
    assert replica.request("GET", "/v1/nodes", token=READ)[0] == 200


def test_an_entry_point_outside_the_allow_list_is_refused(replica: InProcessReplica) -> None:
    status, body = replica.request("POST", "/v1/jobs", job("evil", "os.system:x"))
    assert status == 403
    assert body["field"] == "body.tasks[0].actor"
    assert "'os.system:x'" in body["message"]
    assert "task_entry_points" in body["message"]
    assert replica.request("GET", "/v1/jobs/evil")[0] == 404
    assert replica.request("POST", "/v1/jobs", job("mine", "mylab.tasks:Run"))[0] == 201
    batch = {"commands": [{"op": "submit_job", "args": job("evil2", "subprocess:call")}]}
    status, body = replica.request("POST", "/v1/batch", batch)
    assert status == 403
    assert body["field"] == "body.commands[0].args.tasks[0].actor"
    status, body = replica.request(
        "POST", "/v1/jobs/mine/tasks", {"tasks": [job("x", "subprocess:call")["tasks"][0]]}
    )
    assert status == 403
    assert replica.request("GET", "/v1/jobs/evil2")[0] == 404


def test_the_openapi_document_names_each_routes_role(replica: InProcessReplica) -> None:
    status, doc = replica.request("GET", "/openapi.json", token=READ)
    assert status == 200
    roles = {
        (method.upper(), path): op["x-shoal-role"]
        for path, ops in doc["paths"].items()
        for method, op in ops.items()
    }
    assert roles[("GET", "/healthz")] == "none"
    assert roles[("POST", "/v1/jobs")] == "operator"
    assert roles[("POST", "/v1/nodes/{node_id}/heartbeat")] == "node"
    assert roles[("GET", "/v1/jobs")] == "read"
    assert all(
        r == "read" for (m, p), r in roles.items() if m == "GET" and p not in ("/", "/healthz")
    )
    assert "Role: operator" in doc["paths"]["/v1/jobs"]["post"]["description"]


def test_each_role_needs_its_own_token(tmp_path: Path) -> None:
    base = {
        "replica_id": "c1",
        "raft": "127.0.0.1:1",
        "peers": (),
        "api": "127.0.0.1:2",
        "data_dir": tmp_path,
        "secret": SECRET,
        "token": TOKEN,
    }
    with pytest.raises(ConfigError, match="--node-token-file holds the same token as --token"):
        CoordinatorConfig(**base, node_token=TOKEN)
    with pytest.raises(ConfigError, match="in --read-token-file is empty"):
        CoordinatorConfig(**base, read_token="")
    with pytest.raises(ConfigError, match="task_entry_points"):
        ApiSection(task_entry_points=("",))


def test_the_allow_list_admits_shoal_and_listed_prefixes_only() -> None:
    assert allowed("shoal.learner.rollout:RolloutActor", ())
    assert allowed("anything:Goes", None)
    assert allowed("mylab.x:A", ("mylab.",))
    assert not allowed("subprocess:call", ())
    assert not allowed("shoalx.evil:A", ("mylab.",))


@pytest.mark.timeout(120)
def test_a_local_cluster_registers_nodes_with_the_node_credential(tmp_path: Path) -> None:
    local = LocalCluster(tmp_path)
    coordinators = coordinator_specs(tmp_path, 1)
    urls = [s.api_url for s in coordinators if s.api_url]
    nodes = node_specs(tmp_path, urls, 1, 0)
    local.create(coordinators + nodes)
    try:
        for name in ("api-token", "node-token", "read-token"):
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
        assert str(tmp_path / "node-token") in nodes[0].argv
        assert str(tmp_path / "api-token") not in nodes[0].argv
        local.start_all()
        local.wait_ready(timeout=60)
        local.wait_nodes(1, timeout=60)
    finally:
        local.stop_all()
