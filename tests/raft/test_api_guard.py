"""Every route of the admin API against a missing or wrong token and malformed input:
always a 4xx with a JSON error naming the field, never a 500 or a hang."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.raft.api import ALL_ROUTES
from shoal.raft.routes import Route

from .inprocess import InProcessReplica

pytestmark = pytest.mark.timeout(120)

AUTH_ROUTES = [r for r in ALL_ROUTES if r.auth]
BODY_ROUTES = [r for r in ALL_ROUTES if r.body is not None]
QUERY_ROUTES = [
    r
    for r in ALL_ROUTES
    if any(p.schema.get("type") in ("integer", "number", "boolean") for p in r.query)
]


def _path(route: Route, value: str = "unknown-id") -> str:
    return "/".join(value if part.startswith("{") else part for part in route.path.split("/"))


def _rid(route: Route) -> str:
    return f"{route.method} {route.path}"


@pytest.mark.parametrize("route", AUTH_ROUTES, ids=_rid)
def test_no_token_is_401_and_wrong_token_is_403(replica: InProcessReplica, route: Route) -> None:
    status, body = replica.request(route.method, _path(route), {}, token=None)
    assert status == 401
    assert body["error"] == "unauthorized"
    status, body = replica.request(route.method, _path(route), {}, token="wrong")
    assert status == 403
    assert body["error"] == "forbidden"
    status, _ = replica.request(
        route.method, _path(route), {}, headers={"Authorization": "Basic x"}, token=None
    )
    assert status == 403


def test_healthz_needs_no_token(replica: InProcessReplica) -> None:
    status, body = replica.request("GET", "/healthz", token=None)
    assert status == 200
    assert body["ok"] is True


@pytest.mark.parametrize("route", BODY_ROUTES, ids=_rid)
def test_malformed_bodies_are_4xx_naming_the_field(replica: InProcessReplica, route: Route) -> None:
    path = _path(route)
    status, body = replica.request(route.method, path, raw=b"{not json")
    assert status == 400, body
    assert "JSON" in body["message"]
    status, body = replica.request(route.method, path, [1, 2])
    assert status == 422, body
    assert body["field"] == "body"
    status, body = replica.request(route.method, path, {"no_such_field": 1})
    assert status == 422, body
    assert body["field"].startswith("body.")
    assert route.body is not None
    for name, schema in route.body["properties"].items():
        wrong = [] if schema.get("type") != "array" else {}
        status, body = replica.request(route.method, path, {name: wrong})
        assert status == 422, (name, body)
        assert body["field"].startswith("body."), body
    if route.body.get("required"):
        status, body = replica.request(route.method, path, {})
        assert status == 422
        assert body["field"] == f"body.{route.body['required'][0]}"
        assert "required" in body["message"]


@pytest.mark.parametrize("route", QUERY_ROUTES, ids=_rid)
def test_bad_query_values_are_400_naming_the_parameter(
    replica: InProcessReplica, route: Route
) -> None:
    for param in route.query:
        if param.schema.get("type") in ("integer", "number", "boolean"):
            status, body = replica.request(route.method, f"{_path(route)}?{param.name}=banana")
            assert status == 400, body
            assert f"query.{param.name}" in body["message"]
    status, body = replica.request(route.method, f"{_path(route)}?no_such_param=1")
    assert status == 400


@pytest.mark.parametrize("route", [r for r in ALL_ROUTES if r.path_params], ids=_rid)
def test_unknown_or_malformed_ids_are_404_or_422(replica: InProcessReplica, route: Route) -> None:
    status, body = replica.request(route.method, _path(route, "unknown-id"), {})
    assert status in (404, 422), body
    if route.method == "GET" or (route.body is not None and not route.body.get("required")):
        assert status == 404, body
    status, body = replica.request(route.method, _path(route, "-bad%20id"), {})
    assert status == 422
    assert body["field"].startswith("path.")


def test_bad_operation_id_header_is_rejected(replica: InProcessReplica) -> None:
    status, body = replica.request(
        "POST", "/v1/events", {"kind": "k", "message": "m"}, headers={"X-Shoal-Op-Id": "bad id!"}
    )
    assert status == 422
    assert body["field"] == "header.X-Shoal-Op-Id"


def test_state_conflicts_are_409(replica: InProcessReplica) -> None:
    assert replica.request("POST", "/v1/jobs", {"job_id": "dup-job"})[0] == 201
    status, body = replica.request("POST", "/v1/jobs", {"job_id": "dup-job"})
    assert status == 409
    assert body["field"] == "job_id"


def test_the_openapi_document_covers_every_route_with_its_body(replica: InProcessReplica) -> None:
    status, doc = replica.request("GET", "/openapi.json")
    assert status == 200
    assert doc["openapi"].startswith("3.")
    for route in ALL_ROUTES:
        op = doc["paths"][route.path][route.method.lower()]
        if route.body is not None:
            assert op["requestBody"]["content"]["application/json"]["schema"] == route.body
        assert {p["name"] for p in op["parameters"] if p["in"] == "path"} == set(route.path_params)
        assert bool(op["security"]) == route.auth


def test_metrics_use_prometheus_names(replica: InProcessReplica) -> None:
    status, text = replica.request("GET", "/metrics")
    assert status == 200
    assert "# TYPE shoal_api_requests_total counter" in text
    assert "shoal_raft_term " in text


json_bodies = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)


@pytest.mark.parametrize("route", BODY_ROUTES, ids=_rid)
def test_arbitrary_json_bodies_never_cause_a_500(replica: InProcessReplica, route: Route) -> None:
    assert route.body is not None
    field_names = st.sampled_from(sorted(route.body["properties"]) or ["x"])

    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
    @given(json_bodies | st.dictionaries(field_names, json_bodies, max_size=4))
    def probe(body: object) -> None:
        status, reply = replica.request(route.method, _path(route, "probe-id"), body)
        assert status < 500, (body, reply)

    probe()
