"""`/metrics` as Prometheus reads it: parsed by prometheus_client's own parser, not by regexes."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from shoal.raft.metrics import Metrics, cluster_gauges, format_value
from shoal.raft.model import Gpu, Node, Resources, Task, TaskResources
from tests.support.waiting import eventually

from .inprocess import InProcessReplica

NODE = "metrics-n1"


@pytest.fixture(scope="module")
def busy_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessReplica]:
    """A replica with one node (two GPUs, per-GPU health), a job of two tasks and a stopped job."""
    rep = InProcessReplica(tmp_path_factory.mktemp("metrics"))
    try:
        rep.start()
        gpus = [
            {"index": i, "uuid": f"GPU-{i}", "island": f"{NODE}/nvl0", "domain": "d0"}
            for i in range(2)
        ]
        resources = {"cpus": 4, "memory": 2**30, "gpus": gpus}
        body = {"node_id": NODE, "address": "shoal://127.0.0.1:1", "resources": resources}
        assert rep.request("POST", "/v1/nodes", body)[0] == 201
        health = {
            "summary": {"node": NODE, "gpu_util": 0.5},
            "gpus": [{"index": 0, "utilisation": 0.25}, {"index": 1, "utilisation": 0.75}],
        }
        assert rep.request("POST", f"/v1/nodes/{NODE}/heartbeat", {"health": health})[0] == 200
        tasks = [
            {"task_id": f"metrics-job-t{i}", "kind": "rollout", "actor": "m:A"} for i in range(2)
        ]
        job = {"job_id": "metrics-job", "tasks": tasks}
        assert rep.request("POST", "/v1/jobs", job)[0] == 201
        old = {
            "job_id": "metrics-old",
            "tasks": [{"task_id": "old-t", "kind": "r", "actor": "m:A"}],
        }
        assert rep.request("POST", "/v1/jobs", old)[0] == 201
        assert rep.request("POST", "/v1/jobs/metrics-old/stop", {})[0] == 200
        yield rep
    finally:
        rep.close()


def _scrape(rep: InProcessReplica) -> dict[str, list[Sample]]:
    status, text = rep.request("GET", "/metrics")
    assert status == 200
    assert "version=0.0.4" in rep.last_headers["Content-Type"]
    families = list(text_string_to_metric_families(text))
    assert len({f.name for f in families}) == len(families), "a family is declared twice"
    for family in families:
        assert family.documentation, f"{family.name} has no HELP text"
        assert family.type in {"counter", "gauge", "summary"}, family.type
        for sample in family.samples:
            assert isinstance(sample.value, int | float), sample
            assert math.isfinite(sample.value), sample
        if family.type == "counter":
            assert all(s.name == family.name + "_total" for s in family.samples), family.name
        if family.type == "summary":
            assert family.name.endswith("_seconds"), family.name
            assert {s.name for s in family.samples} <= {
                family.name + "_sum",
                family.name + "_count",
            }
    return {f.name: f.samples for f in families}


@pytest.mark.timeout(60)
def test_coordinator_metrics_follow_prometheus_conventions(busy_replica: InProcessReplica) -> None:
    # per-GPU health reaches the state with the leader's next health report
    eventually(
        lambda: _scrape(busy_replica).get("shoal_gpu_utilisation_ratio"), "per-GPU health scraped"
    )
    samples = _scrape(busy_replica)
    assert {"shoal_api_requests", "shoal_heartbeats", "shoal_raft_commands"} <= set(samples)
    assert "shoal_api_request_seconds" in samples
    assert samples["shoal_raft_is_leader"][0].value == 1.0
    util = {
        (s.labels["node"], s.labels["gpu"]): s.value for s in samples["shoal_gpu_utilisation_ratio"]
    }
    assert util == {(NODE, "0"): 0.25, (NODE, "1"): 0.75}
    gpus = {s.labels["node"]: s.value for s in samples["shoal_node_gpus"]}
    assert gpus[NODE] == 2.0
    jobs = {(s.labels["job"], s.labels["state"]): s.value for s in samples["shoal_job_tasks"]}
    assert jobs[("metrics-job", "pending")] + jobs.get(("metrics-job", "running"), 0) == 2.0
    assert {job for job, _ in jobs} == {"metrics-job"}  # a stopped job has no series
    ages = {s.labels["node"]: s.value for s in samples["shoal_node_heartbeat_age_seconds"]}
    assert ages[NODE] >= 0.0
    routes = {s.labels["route"] for s in samples["shoal_api_requests"]}
    assert "GET /metrics" in routes or "POST /v1/jobs" in routes


labels = st.dictionaries(
    st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True).filter(lambda k: not k.startswith("__")),
    st.text(max_size=12),
    max_size=3,
)
values = st.floats(allow_nan=False) | st.integers(-(2**60), 2**60).map(float)


@given(
    counters=st.lists(st.tuples(labels, st.floats(0, 1e15)), max_size=4),
    gauges=st.lists(st.tuples(labels, values), max_size=4),
    help_text=st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=20).map(str.strip)
    | st.just("two\nlines \\ and a backslash"),
)
def test_rendering_round_trips_through_the_prometheus_parser(
    counters: list[tuple[dict[str, str], float]],
    gauges: list[tuple[dict[str, str], float]],
    help_text: str,
) -> None:
    metrics = Metrics()
    expected_counts: dict[tuple[tuple[str, str], ...], float] = {}
    for lab, amount in counters:
        metrics.inc("shoal_things_total", help_text, amount, **lab)
        key = tuple(sorted(lab.items()))
        expected_counts[key] = expected_counts.get(key, 0.0) + amount
    gauge_cells = {tuple(sorted(lab.items())): v for lab, v in gauges}
    text = metrics.render({"shoal_level_ratio": (help_text, gauge_cells)})
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    assert parsed["shoal_level_ratio"].documentation == help_text
    got = {tuple(sorted(s.labels.items())): s.value for s in parsed["shoal_level_ratio"].samples}
    assert got == gauge_cells
    if counters:
        samples = parsed["shoal_things"].samples
        got_counts = {tuple(sorted(s.labels.items())): s.value for s in samples}
        assert got_counts == expected_counts


@given(st.integers(-(2**53) + 1, 2**53 - 1))
def test_integers_print_exactly(value: int) -> None:
    assert int(format_value(float(value))) == value


def test_special_values_use_prometheus_spelling() -> None:
    assert [format_value(v) for v in (math.nan, math.inf, -math.inf)] == ["NaN", "+Inf", "-Inf"]


def _node(health: object) -> Node:
    gpus = [Gpu(index=0, uuid="g", island="i", domain="d")]
    node = Node("n", "shoal://h:1", Resources(1.0, 1, gpus), {}, registered_at=0.0)
    node.health = health  # type: ignore[assignment]
    return node


@pytest.mark.parametrize(
    "health",
    [
        {},
        {"gpus": "all of them"},
        {"gpus": [7, {"index": "0", "utilisation": 0.5}, {"index": 0, "utilisation": "high"}]},
        {"gpus": [{"index": 0, "utilisation": True}]},
    ],
)
def test_malformed_gpu_health_is_left_out(health: object) -> None:
    gauges = cluster_gauges([_node(health)], [], set(), now=10.0)
    assert gauges["shoal_gpu_utilisation_ratio"][1] == {}
    assert gauges["shoal_node_gpus"][1] == {(("node", "n"),): 1.0}


def test_tasks_of_running_jobs_are_counted_by_job_and_state() -> None:
    jobs = [("a", "running"), ("a", "running"), ("b", "failed"), ("done", "stopped")]
    tasks = [
        Task(f"t{i}", job, "rollout", "m:A", {}, TaskResources(), state=state)
        for i, (job, state) in enumerate(jobs)
    ]
    cells = cluster_gauges([], tasks, {"a", "b"}, now=0.0)["shoal_job_tasks"][1]
    assert cells == {
        (("job", "a"), ("state", "running")): 2.0,
        (("job", "b"), ("state", "failed")): 1.0,
    }
