"""The chaos API on a real in-process replica: absent (a 404 that says how to enable it) unless
the config enables it; then validated, token-checked, recorded and listed, and handed to the
target node in its heartbeat reply until the node reports the outcome."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.commands.coordinator import load_settings
from shoal.errors import ConfigError
from shoal.raft.chaos_api import CHAOS_ROUTES
from shoal.raft.config import ChaosSection
from shoal.raft.routes import Route

from .inprocess import InProcessReplica

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessReplica]:
    rep = InProcessReplica(tmp_path_factory.mktemp("chaos"), chaos=ChaosSection(enabled=True))
    try:
        rep.start()
        node = {
            "node_id": "n1",
            "address": "127.0.0.1:9",
            "resources": {"cpus": 2, "memory": 2**30, "gpus": [{"index": 0, "uuid": "G0"}]},
        }
        assert rep.request("POST", "/v1/nodes", node)[0] == 201
        job = {
            "job_id": "j1",
            "spec": {"placement": "manual"},
            "tasks": [{"task_id": "t1", "kind": "rollout-worker", "actor": "a.b:main"}],
        }
        assert rep.request("POST", "/v1/jobs", job)[0] == 201
        placement = {"placements": [{"task_id": "t1", "node_id": "n1"}]}
        assert rep.request("POST", "/v1/placements", placement)[0] == 200
        yield rep
    finally:
        rep.close()


def _path(route: Route, value: str = "unknown-id") -> str:
    return "/".join(value if part.startswith("{") else part for part in route.path.split("/"))


def _rid(route: Route) -> str:
    return f"{route.method} {route.path}"


@pytest.mark.parametrize("route", CHAOS_ROUTES, ids=_rid)
def test_disabled_chaos_answers_404_saying_how_to_enable_it(
    replica: InProcessReplica, route: Route
) -> None:
    status, body = replica.request(route.method, _path(route), {"kind": "node-kill"})
    assert status == 404
    assert body["error"] == "not_found"
    assert "chaos is disabled" in body["message"]
    assert "enabled = true" in body["message"]
    assert replica.request(route.method, _path(route), {}, token=None)[0] == 401


def test_disabled_chaos_is_shown_in_the_config_and_left_out_of_openapi(
    replica: InProcessReplica,
) -> None:
    assert replica.request("GET", "/v1/config")[1]["chaos"] == {"enabled": False}
    paths = replica.request("GET", "/openapi.json")[1]["paths"]
    assert not [p for p in paths if p.startswith("/v1/chaos")]


def test_enabled_chaos_is_in_the_config_and_in_openapi(chaos: InProcessReplica) -> None:
    assert chaos.request("GET", "/v1/config")[1]["chaos"] == {"enabled": True}
    doc = chaos.request("GET", "/openapi.json")[1]
    for route in CHAOS_ROUTES:
        op = doc["paths"][route.path][route.method.lower()]
        assert op["security"]
        if route.body is not None:
            assert op["requestBody"]["content"]["application/json"]["schema"] == route.body
    posted = doc["paths"]["/v1/chaos/faults"]["post"]["responses"]
    assert "202" in posted
    assert "201" not in posted


def test_the_config_file_switches_chaos_on(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.toml"
    path.write_text("[chaos]\nenabled = true\n")
    assert load_settings(path).chaos.enabled is True
    assert load_settings(None).chaos.enabled is False
    path.write_text('[chaos]\nenabled = "yes"\n')
    with pytest.raises(ConfigError, match=r"chaos\.enabled") as exc:
        load_settings(path)
    assert "true or false" in str(exc.value)
    path.write_text("[chaos]\nenable = true\n")
    with pytest.raises(ConfigError, match="enable"):
        load_settings(path)


@pytest.mark.parametrize("route", CHAOS_ROUTES, ids=_rid)
def test_chaos_routes_check_the_token(chaos: InProcessReplica, route: Route) -> None:
    assert chaos.request(route.method, _path(route), {}, token=None)[0] == 401
    assert chaos.request(route.method, _path(route), {}, token="wrong")[0] == 403


@pytest.mark.parametrize(
    ("body", "status", "text"),
    [
        ({"kind": "disk-melt", "target": "t1"}, 422, "body.kind"),
        ({"kind": "task-kill"}, 422, "body.target: is required"),
        ({"kind": "task-kill", "target": "t1", "duration_s": -1}, 422, "body.duration_s"),
        ({"kind": "task-pause", "target": "t1"}, 422, "needs duration_s > 0"),
        ({"kind": "gpu-xid", "target": "n1"}, 422, "needs gpu"),
        ({"kind": "node-kill", "target": "n1", "gpu": 0}, 422, "only gpu-xid takes gpu"),
        ({"kind": "task-kill", "target": "t1", "when": 3}, 422, "when"),
        ({"kind": "task-kill", "target": "no-such-task"}, 404, "no task 'no-such-task'"),
        ({"kind": "node-kill", "target": "no-such-node"}, 404, "no node 'no-such-node'"),
        ({"kind": "gpu-xid", "target": "n1", "gpu": 5}, 409, "not GPU 5"),
    ],
)
def test_bad_fault_requests_are_refused_with_a_clear_message(
    chaos: InProcessReplica, body: dict[str, object], status: int, text: str
) -> None:
    got, reply = chaos.request("POST", "/v1/chaos/faults", body)
    assert got == status, reply
    assert text in reply["message"]


def test_non_json_is_400(chaos: InProcessReplica) -> None:
    status, body = chaos.request("POST", "/v1/chaos/faults", raw=b"kind=node-kill")
    assert status == 400
    assert "JSON" in body["message"]


def test_a_fault_is_recorded_handed_to_its_node_and_takes_its_outcome(
    chaos: InProcessReplica,
) -> None:
    status, fault = chaos.request("POST", "/v1/chaos/faults", {"kind": "task-kill", "target": "t1"})
    assert status == 202, fault
    assert (fault["node"], fault["state"], fault["kind"]) == ("n1", "requested", "task-kill")
    fid = fault["id"]
    assert chaos.request("GET", f"/v1/chaos/faults/{fid}")[1] == fault
    listed = chaos.request("GET", "/v1/chaos/faults?node=n1&state=requested")[1]["faults"]
    assert fid in [f["id"] for f in listed]
    beat = chaos.request("POST", "/v1/nodes/n1/heartbeat", {})[1]
    assert fid in [f["id"] for f in beat["faults"]]

    outcome = {"state": "injected", "message": "SIGKILL sent"}
    status, done = chaos.request("PUT", f"/v1/chaos/faults/{fid}/outcome", outcome)
    assert status == 200, done
    assert (done["state"], done["message"]) == ("injected", "SIGKILL sent")
    beat = chaos.request("POST", "/v1/nodes/n1/heartbeat", {})[1]
    assert fid not in [f["id"] for f in beat["faults"]]
    assert chaos.request("PUT", f"/v1/chaos/faults/{fid}/outcome", outcome)[0] == 200
    status, body = chaos.request("PUT", f"/v1/chaos/faults/{fid}/outcome", {"state": "bogus"})
    assert status == 422
    status, body = chaos.request(
        "PUT", f"/v1/chaos/faults/{fid}/outcome", {"state": "failed", "message": "late"}
    )
    assert status == 200
    status, body = chaos.request("PUT", f"/v1/chaos/faults/{fid}/outcome", {"state": "healed"})
    assert status == 409
    assert "already failed" in body["message"]
    events = chaos.request("GET", "/v1/events?since=0")[1]["events"]
    assert [e["fields"]["state"] for e in events if e["fields"].get("fault") == fid] == [
        "requested",
        "injected",
        "failed",
    ]


def test_an_unknown_fault_is_404(chaos: InProcessReplica) -> None:
    status, body = chaos.request("GET", "/v1/chaos/faults/nope")
    assert status == 404
    assert "GET /v1/chaos/faults" in body["message"]
    assert chaos.request("PUT", "/v1/chaos/faults/nope/outcome", {"state": "injected"})[0] == 404


def test_a_retried_request_makes_one_fault(chaos: InProcessReplica) -> None:
    body = {"kind": "node-kill", "target": "n1"}
    headers = {"X-Shoal-Op-Id": "retry-once"}
    first = chaos.request("POST", "/v1/chaos/faults", body, headers=headers)[1]
    again = chaos.request("POST", "/v1/chaos/faults", body, headers=headers)[1]
    assert first["id"] == again["id"]
    faults = chaos.request("GET", "/v1/chaos/faults?consistent=true")[1]["faults"]
    assert [f["id"] for f in faults].count(first["id"]) == 1


json_bodies = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)


@pytest.mark.parametrize("route", [r for r in CHAOS_ROUTES if r.body is not None], ids=_rid)
def test_arbitrary_bodies_never_cause_a_500(chaos: InProcessReplica, route: Route) -> None:
    assert route.body is not None
    keys = st.sampled_from(sorted(route.body["properties"]))
    values = json_bodies | st.sampled_from(["task-kill", "gpu-xid", "t1", "n1", "injected"])

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(json_bodies | st.dictionaries(keys, values, max_size=5))
    def probe(body: object) -> None:
        status, reply = chaos.request(route.method, _path(route, "probe-id"), body)
        assert status < 500, (body, reply)

    probe()
