"""Hostile and careless input to the admin API over real sockets, against a real coordinator:
a reused operation id is a 409 naming the header (never a 500, never a dropped write), a retry
answers the first result, and bodies too deep or too large are refused with a JSON error while
the replica goes on serving."""

from __future__ import annotations

import http.client
import json
import uuid
from typing import Any

import pytest

from .inprocess import TOKEN, InProcessReplica

pytestmark = pytest.mark.timeout(120)

OP = "X-Shoal-Op-Id"


def write(
    replica: InProcessReplica, method: str, path: str, body: Any, op_id: str
) -> tuple[int, Any]:
    return replica.request(method, path, body, headers={OP: op_id})


def job_ids(replica: InProcessReplica) -> set[str]:
    status, body = replica.request("GET", "/v1/jobs")
    assert status == 200
    return {job["id"] for job in body["jobs"]}


def messages(replica: InProcessReplica) -> list[str]:
    status, body = replica.request("GET", "/v1/events?limit=1000&since=0")
    assert status == 200
    return [e["message"] for e in body["events"]]


def assert_op_id_conflict(status: int, body: Any) -> None:
    assert status == 409, body
    assert body["error"] == "conflict"
    assert body["field"] == f"header.{OP}"
    assert OP in body["message"]
    assert "fresh" in body["message"]


def test_an_op_id_reused_on_another_route_is_a_409_and_applies_nothing(
    replica: InProcessReplica,
) -> None:
    op_id, name = f"op-{uuid.uuid4().hex}", f"job-{uuid.uuid4().hex[:8]}"
    status, _ = write(replica, "POST", "/v1/events", {"kind": "note", "message": name}, op_id)
    assert status == 201
    status, body = write(replica, "POST", "/v1/jobs", {"job_id": name}, op_id)
    assert_op_id_conflict(status, body)
    assert "add_event" in body["message"]
    assert name not in job_ids(replica)
    assert messages(replica).count(name) == 1
    status, body = write(replica, "POST", "/v1/jobs", {"job_id": name}, f"op-{uuid.uuid4().hex}")
    assert status == 201, body
    assert name in job_ids(replica)


def test_an_op_id_reused_with_another_body_is_a_409_and_nothing_is_lost(
    replica: InProcessReplica,
) -> None:
    op_id = f"op-{uuid.uuid4().hex}"
    first, second = (f"job-{uuid.uuid4().hex[:8]}" for _ in range(2))
    status, body = write(replica, "POST", "/v1/jobs", {"job_id": first}, op_id)
    assert status == 201
    assert body["id"] == first
    status, body = write(replica, "POST", "/v1/jobs", {"job_id": second}, op_id)
    assert_op_id_conflict(status, body)
    assert first in job_ids(replica)
    assert second not in job_ids(replica)
    status, body = write(replica, "POST", "/v1/jobs", {"job_id": second}, f"op-{uuid.uuid4().hex}")
    assert status == 201
    assert body["id"] == second


def test_cordon_and_uncordon_under_one_op_id_are_two_commands(replica: InProcessReplica) -> None:
    node = f"n-{uuid.uuid4().hex[:8]}"
    body = {"node_id": node, "address": "127.0.0.1:1", "resources": {"cpus": 1, "memory": 1}}
    assert replica.request("POST", "/v1/nodes", body)[0] == 201
    op_id = f"op-{uuid.uuid4().hex}"
    status, reply = write(replica, "POST", f"/v1/nodes/{node}/cordon", {}, op_id)
    assert status == 200
    assert reply["cordoned"] is True
    status, reply = write(replica, "POST", f"/v1/nodes/{node}/uncordon", {}, op_id)
    assert_op_id_conflict(status, reply)
    assert replica.request("GET", f"/v1/nodes/{node}")[1]["cordoned"] is True


def test_the_same_op_id_and_body_answers_the_first_result_once(replica: InProcessReplica) -> None:
    op_id = f"op-{uuid.uuid4().hex}"
    before = job_ids(replica)
    answers = [write(replica, "POST", "/v1/jobs", {"spec": {"x": 1}}, op_id) for _ in range(3)]
    assert answers[0][0] == 201
    assert answers[1] == answers[0] == answers[2]  # the job id the server made, too
    assert job_ids(replica) - before == {answers[0][1]["id"]}


def test_a_batch_retried_answers_the_first_results_and_a_changed_one_is_a_409(
    replica: InProcessReplica,
) -> None:
    op_id, tag = f"op-{uuid.uuid4().hex}", uuid.uuid4().hex
    commands = [
        {"op": "add_event", "args": {"kind": "note", "message": f"{tag}-{i}"}} for i in range(3)
    ]
    first = write(replica, "POST", "/v1/batch", {"commands": commands}, op_id)
    assert first[0] == 200
    assert len(first[1]["results"]) == 3
    assert write(replica, "POST", "/v1/batch", {"commands": commands}, op_id) == first
    status, body = write(replica, "POST", "/v1/batch", {"commands": commands[:2]}, op_id)
    assert_op_id_conflict(status, body)
    assert sorted(m for m in messages(replica) if m.startswith(tag)) == [
        f"{tag}-{i}" for i in range(3)
    ]


@pytest.mark.parametrize(
    ("op", "args"),
    [
        ("announce_leader", {"replica_id": "evil", "raft": "x:1", "api": "http://x:1", "term": 99}),
        ("set_liveness", {"changes": [{"node_id": "n1", "liveness": "dead"}]}),
        ("inject_fault", {"fault_id": "f1", "kind": "node-kill", "target": "n1"}),
    ],
)
def test_a_batch_cannot_carry_what_only_the_leader_or_chaos_proposes(
    replica: InProcessReplica, op: str, args: dict[str, Any]
) -> None:
    before = replica.request("GET", "/v1/cluster")[1]["leader_api"]
    status, body = replica.request("POST", "/v1/batch", {"commands": [{"op": op, "args": args}]})
    assert status == 422, body
    assert body["field"] == "body.commands[0].op"
    assert replica.request("GET", "/v1/cluster")[1]["leader_api"] == before


def raw_post(replica: InProcessReplica, path: str, data: bytes) -> tuple[int, Any]:
    """A POST whose body is sent as given, in chunks (no Content-Length to go by)."""
    host, port = replica.config.api.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        chunks = (data[i : i + (1 << 16)] for i in range(0, len(data), 1 << 16))
        conn.request(
            "POST",
            path,
            body=chunks,
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            encode_chunked=True,
        )
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.parametrize("opener", [b"[", b'{"a":'])
def test_a_body_nested_100000_deep_is_a_400_and_the_replica_serves_on(
    replica: InProcessReplica, opener: bytes
) -> None:
    for path in ("/v1/events", "/v1/jobs", "/v1/batch", "/v1/nodes/n1/heartbeat"):
        status, body = replica.request("POST", path, raw=opener * 100_000)
        assert status == 400, (path, body)
        assert body["field"] == "body"
        assert "deeper than" in body["message"]
    status, body = raw_post(replica, "/v1/events", opener * 100_000)
    assert status == 400
    assert "deeper than" in body["message"]
    note = {"kind": "note", "message": "after the deep body"}
    assert replica.request("POST", "/v1/events", note)[0] == 201
    assert replica.request("GET", "/healthz", token=None)[0] == 200


def test_a_body_over_the_limit_is_a_413_with_a_json_error(replica: InProcessReplica) -> None:
    big = b'{"kind": "note", "message": "' + b"x" * (5 << 20) + b'"}'
    status, body = replica.request("POST", "/v1/events", raw=big)
    assert status == 413
    assert body["error"] == "too_large"
    assert body["field"] == "body"
    status, body = raw_post(replica, "/v1/events", big)
    assert status == 413
    assert body["error"] == "too_large"
    assert replica.request("GET", "/healthz", token=None)[0] == 200


def test_a_missing_body_is_refused_where_fields_are_required(replica: InProcessReplica) -> None:
    status, body = replica.request("POST", "/v1/events", raw=b"")
    assert status == 422
    assert body["field"] == "body"
    assert "kind" in body["message"]
    status, body = replica.request("POST", "/v1/checkpoints", raw=b"  ")
    assert status == 422
    assert body["field"] == "body"
    assert "sha256" in body["message"]
    status, body = replica.request("POST", "/v1/nodes/nobody/cordon", raw=b"")
    assert status == 404, body  # no field is required: an empty body stands for {}


@pytest.mark.parametrize("value", ["", "-leading-dash", "x" * 129, "sp ace"])
def test_a_malformed_op_id_header_is_a_422_naming_it(replica: InProcessReplica, value: str) -> None:
    status, body = write(replica, "POST", "/v1/events", {"kind": "k", "message": "m"}, value)
    assert status == 422, body
    assert body["field"] == f"header.{OP}"


def test_an_integral_float_is_taken_as_the_integer_it_is(replica: InProcessReplica) -> None:
    node = f"n-{uuid.uuid4().hex[:8]}"
    raw = json.dumps(
        {"node_id": node, "address": "a:1", "resources": {"cpus": 2.0, "memory": 1024.0}}
    ).encode()
    status, body = replica.request("POST", "/v1/nodes", raw=raw)
    assert status == 201, body
    assert body["resources"]["memory"] == 1024
    status, view = replica.request("GET", f"/v1/nodes/{node}")
    assert status == 200
    assert type(view["resources"]["memory"]) is int  # parsed back from the reply: 1024, not 1024.0
    status, body = replica.request("GET", "/v1/events?limit=1.0&since=0.0")
    assert status == 200, body
