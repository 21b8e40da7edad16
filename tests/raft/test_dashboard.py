"""The dashboard's pure views (property-based) and its routes on a real in-process replica:
public page without data, token-guarded view, long-poll that answers on the next change."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.raft.dashboard import (
    CSP,
    MAX_POINTS,
    METRICS_KIND,
    health_sources,
    islands,
    job_curves,
)

from .inprocess import InProcessReplica

pytestmark = pytest.mark.timeout(60)

IDS = st.text(alphabet="abcdef0123", min_size=1, max_size=4)
UTIL = st.one_of(
    st.none(), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.text(max_size=2)
)


@st.composite
def node_records(draw: st.DrawFn) -> list[dict[str, Any]]:
    nodes = []
    for node_id in draw(st.lists(IDS, unique=True, max_size=5)):
        gpus = [
            {"index": i, "uuid": f"{node_id}-{i}", "island": draw(st.sampled_from(["", "i0", "i1"])),
             "domain": draw(st.sampled_from(["", "d0"]))}
            for i in range(draw(st.integers(0, 5)))
        ]  # fmt: skip
        health = draw(
            st.one_of(
                st.just({}),
                st.builds(lambda u: {"summary": {"gpu_util": u}}, UTIL),
                st.builds(lambda u: {"gpus": [{"index": 0, "utilisation": u}]}, UTIL),
            )
        )
        nodes.append(
            {"id": node_id, "liveness": draw(st.sampled_from(["alive", "dead"])),
             "resources": {"gpus": gpus}, "health": health}
        )  # fmt: skip
    return nodes


@given(node_records())
@settings(max_examples=150, deadline=None)
def test_every_gpu_lands_in_exactly_one_island_with_a_bounded_utilisation(
    nodes: list[dict[str, Any]],
) -> None:
    groups = islands(nodes)
    seen = [(g["node"], g["index"]) for group in groups for g in group["gpus"]]
    expected = [(n["id"], g["index"]) for n in nodes for g in n["resources"]["gpus"]]
    assert sorted(seen) == sorted(expected)
    assert len({group["island"] for group in groups}) == len(groups)
    for group in groups:
        assert all(g["island"] == group["island"] for g in group["gpus"])
        assert all(g["util"] is None or 0.0 <= g["util"] <= 1.0 for g in group["gpus"])


def test_a_gpu_without_an_island_is_its_own_nodes_island() -> None:
    node = {
        "id": "n1",
        "liveness": "alive",
        "resources": {"gpus": [{"index": 0, "uuid": "u", "island": "", "domain": ""}]},
        "health": {"summary": {"gpu_util": 0.5}},
    }
    assert islands([node])[0]["island"] == "n1/local"
    assert islands([node])[0]["gpus"][0]["util"] == 0.5


VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(), st.text(max_size=3), st.none()
)


@st.composite
def events(draw: st.DrawFn) -> list[dict[str, Any]]:
    out = []
    for _ in range(draw(st.integers(0, 30))):
        fields = draw(st.dictionaries(st.sampled_from(["return", "sps", "loss"]), VALUES))
        fields["job"] = draw(st.sampled_from(["j1", "j2", 7]))
        fields["step"] = draw(st.one_of(st.integers(0, 100), st.floats(), st.none()))
        kind = draw(st.sampled_from([METRICS_KIND, "node_registered"]))
        out.append({"kind": kind, "fields": fields})
    return out


def test_health_sources_keep_only_valid_collectors_for_the_page() -> None:
    """A node's health object is hostile: the page gets only valid names and states."""
    health = {
        "collectors": {
            "dcgm": {"state": "up", "reason": ""},
            "ptp": {"state": "absent", "reason": "no pmc\x1b[31m"},
            "<img src=x>": {"state": "up", "reason": ""},
            "nvml": {"state": "<script>", "reason": ""},
            "host": "up",
        },
        "gpu_util_source": "<b>dcgm</b>",
    }
    assert health_sources(health) == {
        "collectors": {
            "dcgm": {"state": "up", "reason": ""},
            "ptp": {"state": "absent", "reason": "no pmc?[31m"},
        },
        "gpu_util_source": None,
    }
    assert health_sources({"gpu_util_source": "dcgm"})["gpu_util_source"] == "dcgm"
    assert health_sources(None) == {"collectors": {}, "gpu_util_source": None}


@given(events())
@settings(max_examples=150, deadline=None)
def test_curves_hold_only_finite_numbers_in_step_order(evs: list[dict[str, Any]]) -> None:
    curves = job_curves(evs)
    assert set(curves) <= {"j1", "j2"}
    for series in curves.values():
        for points in series.values():
            assert 0 < len(points) <= MAX_POINTS
            assert [p[0] for p in points] == sorted(p[0] for p in points)
            assert all(
                all(isinstance(v, float) and abs(v) != float("inf") for v in p) for p in points
            )


def test_curves_keep_the_newest_points() -> None:
    evs = [
        {"kind": METRICS_KIND, "fields": {"job": "j", "step": s, "return": float(s)}}
        for s in range(MAX_POINTS + 10)
    ]
    points = job_curves(evs)["j"]["return"]
    assert len(points) == MAX_POINTS
    assert points[-1] == [MAX_POINTS + 9.0, MAX_POINTS + 9.0]


# -- routes on a real replica -----------------------------------------------------------------


def test_the_page_is_public_self_contained_and_holds_no_data(replica: InProcessReplica) -> None:
    status, body = replica.request("GET", "/", token=None)
    assert status == 200
    assert body.startswith("<!doctype html>")
    assert "http://" not in body.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in body
    assert replica.last_headers["Content-Security-Policy"] == CSP


def test_the_view_needs_the_token(replica: InProcessReplica) -> None:
    assert replica.request("GET", "/v1/dashboard", token=None)[0] == 401
    assert replica.request("GET", "/v1/dashboard", token="wrong")[0] == 403


@pytest.mark.parametrize(
    ("query", "field"),
    [("wait=1000", "query.wait"), ("wait=abc", "query.wait"), ("after=-5", "query.after"),
     ("nope=1", "query.nope")],
)  # fmt: skip
def test_bad_queries_get_a_400_naming_the_parameter(
    replica: InProcessReplica, query: str, field: str
) -> None:
    status, body = replica.request("GET", f"/v1/dashboard?{query}")
    assert status == 400
    assert field in body["message"]


def test_the_view_shows_nodes_jobs_and_curves(replica: InProcessReplica) -> None:
    gpus = [{"index": i, "uuid": f"dash-{i}", "island": "isl-a", "domain": "d"} for i in range(2)]
    node = {"node_id": "dash-node", "address": "127.0.0.1:1",
            "resources": {"cpus": 2, "memory": 1 << 30, "gpus": gpus}}  # fmt: skip
    assert replica.request("POST", "/v1/nodes", node)[0] == 201
    assert (
        replica.request("POST", "/v1/jobs", {"job_id": "dash-job", "spec": {}, "tasks": []})[0]
        == 201
    )
    metrics = {"kind": METRICS_KIND, "message": "step 10",
               "fields": {"job": "dash-job", "step": 10, "return": 21.5, "sps": 900}}  # fmt: skip
    assert replica.request("POST", "/v1/events", metrics)[0] == 201
    status, view = replica.request("GET", "/v1/dashboard")
    assert status == 200
    assert "dash-node" in [n["id"] for n in view["nodes"]]
    assert [
        g["index"] for g in next(i for i in view["islands"] if i["island"] == "isl-a")["gpus"]
    ] == [0, 1]
    assert "dash-job" in [j["id"] for j in view["jobs"]]
    assert view["curves"]["dash-job"]["return"] == [[10.0, 21.5]]
    assert all(e["kind"] != METRICS_KIND for e in view["events"])
    assert view["cluster"]["leader_id"] == "c1"
    assert view["cluster"]["state"] == "leader"


def test_the_long_poll_answers_on_the_next_write(replica: InProcessReplica) -> None:
    applied = replica.request("GET", "/v1/dashboard")[1]["applied"]

    def write_soon() -> None:
        time.sleep(0.5)
        replica.request("POST", "/v1/events", {"kind": "note", "message": "poke", "fields": {}})

    writer = threading.Thread(target=write_soon)
    writer.start()
    try:
        status, view = replica.request("GET", f"/v1/dashboard?after={applied}&wait=20")
    finally:
        writer.join()
    assert status == 200
    assert view["applied"] > applied
    assert "poke" in [e["message"] for e in view["events"]]


def test_the_long_poll_ends_at_its_wait_without_a_change(replica: InProcessReplica) -> None:
    far = replica.request("GET", "/v1/dashboard")[1]["applied"] + 10**9
    status, view = replica.request("GET", f"/v1/dashboard?after={far}&wait=0.2")
    assert status == 200
    assert view["applied"] < far


def test_the_openapi_document_lists_the_dashboard_routes(replica: InProcessReplica) -> None:
    paths = replica.request("GET", "/openapi.json")[1]["paths"]
    assert "/" in paths
    assert "/v1/dashboard" in paths
