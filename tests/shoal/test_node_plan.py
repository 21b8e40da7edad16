"""The node's pure parts: reconciling assignments (property tests), backoff, identity,
GPU topology labels, health summaries and configuration checks."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.agent_policy import AgentConfig, Backoff, plan
from shoal.commands.node import parse_labels
from shoal.errors import ConfigError
from shoal.node import NodeConfig, gpu_topology, health_summary, node_identity
from shoal.scheduler.health.collector import GpuSample, Report, unavailable
from shoal.tasks import TaskSpec

STATES = ("pending", "running", "stopped", "failed")
IDS = st.sampled_from([f"t{i}" for i in range(6)])
GENS = st.integers(min_value=1, max_value=4)

assigned_lists = st.lists(
    st.builds(
        TaskSpec,
        id=IDS,
        generation=GENS,
        kind=st.just("rollout"),
        actor=st.just("m:A"),
        state=st.sampled_from(STATES),
    ),
    unique_by=lambda t: t.id,
)
locals_ = st.dictionaries(IDS, GENS)
dones = st.sets(st.tuples(IDS, GENS))


@given(assigned_lists, locals_, dones, st.booleans())
def test_after_the_plan_exactly_the_wanted_tasks_run(
    assigned: list[TaskSpec], local: dict[str, int], done: set[tuple[str, int]], accepting: bool
) -> None:
    p = plan(assigned, local, done, accepting)
    after = {k: v for k, v in local.items() if k not in p.stop}
    after.update({t.id: t.generation for t in p.start})
    wanted = {t.id: t for t in assigned if t.state in ("pending", "running")}
    for task_id, generation in after.items():
        assert task_id in wanted
        assert wanted[task_id].generation == generation
    for t in wanted.values():
        if accepting and t.key not in done:
            assert after.get(t.id) == t.generation


@given(assigned_lists, locals_, dones, st.booleans())
def test_the_plan_never_restarts_what_ended_or_runs(
    assigned: list[TaskSpec], local: dict[str, int], done: set[tuple[str, int]], accepting: bool
) -> None:
    p = plan(assigned, local, done, accepting)
    for t in p.start:
        assert t.key not in done
        assert local.get(t.id) != t.generation
    assert len({t.id for t in p.start}) == len(p.start)
    assert set(p.stop) <= set(local)
    if not accepting:
        assert p.start == ()


@given(assigned_lists, locals_, dones)
def test_the_plan_is_idempotent(
    assigned: list[TaskSpec], local: dict[str, int], done: set[tuple[str, int]]
) -> None:
    p = plan(assigned, local, done)
    after = {k: v for k, v in local.items() if k not in p.stop}
    after.update({t.id: t.generation for t in p.start})
    again = plan(assigned, after, done)
    assert again.start == ()
    assert again.stop == ()


def test_a_moved_task_restarts_under_its_new_generation() -> None:
    moved = TaskSpec("t", 3, "rollout", "m:A", "pending")
    p = plan([moved], {"t": 2}, set())
    assert p.stop == ("t",)
    assert p.start == (moved,)


@given(st.floats(0.01, 1.0), st.floats(1.0, 10.0), st.integers(1, 40))
def test_backoff_doubles_up_to_its_ceiling(first: float, most: float, tries: int) -> None:
    b = Backoff(first, most)
    pauses = [b.take() for _ in range(tries)]
    assert pauses[0] == first
    assert all(p <= max(first, most) for p in pauses)
    assert all(later >= earlier for earlier, later in itertools.pairwise(pauses))
    b.reset()
    assert b.take() == first


def test_node_id_is_kept_in_the_data_dir(tmp_path: Path) -> None:
    first = node_identity(tmp_path, None)
    assert node_identity(tmp_path, None) == first
    assert node_identity(tmp_path, first) == first
    with pytest.raises(ConfigError, match="belongs to node"):
        node_identity(tmp_path, "someone-else")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert node_identity(fresh, None) != first


def test_a_chosen_node_id_is_stored(tmp_path: Path) -> None:
    assert node_identity(tmp_path, "n7") == "n7"
    assert (tmp_path / "node-id").read_text().strip() == "n7"


@given(st.integers(0, 64), st.integers(1, 16))
def test_islands_group_consecutive_gpus(count: int, size: int) -> None:
    report = Report("nvml", True, "", tuple(GpuSample(i, uuid=f"GPU-{i}") for i in range(count)))
    gpus = gpu_topology([report, unavailable("dcgm", "absent")], "n1", size, "rdma0", True)
    assert [g["index"] for g in gpus] == list(range(count))
    islands: dict[str, list[int]] = {}
    for g in gpus:
        islands.setdefault(g["island"], []).append(g["index"])
        assert g["domain"] == "rdma0"
        assert g["uuid"].endswith("@n1")
    assert all(len(members) <= size for members in islands.values())
    assert all(len({i // size for i in members}) == 1 for members in islands.values())


def test_health_summary_says_why_a_source_is_missing() -> None:
    host = Report("host", True, "", (), {"cpu_fraction": 0.25, "memory_fraction": 0.5})
    out = health_summary("n1", [host, unavailable("nvml", "no driver")])
    assert out["summary"]["cpu"] == 0.25
    assert out["summary"]["node"] == "n1"
    assert out["unavailable"] == {"nvml": "unavailable: no driver"}
    assert out["collectors"] == {
        "host": {"state": "up", "reason": ""},
        "nvml": {"state": "down", "reason": "unavailable: no driver"},
    }
    assert out["gpu_util_source"] is None
    absent = health_summary("n1", [host], {"dcgm": "not installed"})["collectors"]["dcgm"]
    assert absent == {"state": "absent", "reason": "not installed"}


def test_good_dcgm_and_ptp_addresses_are_accepted() -> None:
    for host in (
        "127.0.0.1",
        "10.0.0.2:5555",
        "[::1]:5555",
        "gpu-host.example",
        "unix:///run/dcgm.sock",
    ):
        assert config(dcgm_host=host).dcgm_host == host
    assert config(ptp_socket="/var/run/ptp4l-eth1").ptp_socket == "/var/run/ptp4l-eth1"


def config(**overrides: object) -> NodeConfig:
    values: dict[str, object] = {
        "coordinators": ("http://127.0.0.1:8001",),
        "data_dir": Path("/tmp/x"),
        "token": "t",
    }
    values.update(overrides)
    return NodeConfig(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"coordinators": ()}, "--coordinators is empty"),
        ({"coordinators": ("127.0.0.1:8001",)}, "use http://HOST:PORT"),
        ({"token": ""}, "token is empty"),
        ({"node_id": "-bad id"}, "--node-id='-bad id' is invalid"),
        ({"listen": "nowhere"}, "--listen='nowhere' is invalid"),
        ({"sim_gpus": -1}, "--sim-gpus=-1 is invalid"),
        ({"island_size": 0}, "--island-size=0 is invalid"),
        ({"domain": ""}, "--domain='' is invalid"),
        ({"labels": {"bad key": "v"}}, "--label bad key"),
        ({"clock": "host"}, "--clock='host' is invalid"),
        ({"health_s": 0}, "--health-period=0 is invalid"),
        ({"dcgm_host": "a host"}, "--dcgm-host='a host' is invalid"),
        ({"dcgm_host": ""}, "--dcgm-host='' is invalid"),
        ({"ptp_socket": "relative/ptp4l"}, "--ptp-socket='relative/ptp4l' is invalid"),
        ({"ptp_socket": "/" + "x" * 200}, "at most 107 characters"),
    ],
)
def test_bad_node_config_names_the_option(overrides: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        config(**overrides)


@pytest.mark.parametrize("key", ["heartbeat_s", "backoff_max_s", "stop_timeout_s"])
@pytest.mark.parametrize("value", [0, -1, float("inf"), True])
def test_bad_agent_config_names_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        AgentConfig(**{key: value})  # type: ignore[arg-type]


def test_labels_parse_and_bad_ones_are_refused() -> None:
    assert parse_labels(["rack=r1", "zone=a=b"]) == {"rack": "r1", "zone": "a=b"}
    with pytest.raises(ConfigError, match="write KEY=VALUE"):
        parse_labels(["rack"])


RECORD = {"id": "t", "kind": "rollout", "actor": "m:A", "node": "a", "generation": 3}


@given(st.sampled_from(["a", "b", "c"]), st.sampled_from(["a", "b", "c", None]))
def test_a_node_runs_exactly_the_copies_placed_on_it(me: str, incoming: str | None) -> None:
    record = {
        **RECORD,
        "state": "running",
        "incoming": None
        if incoming is None
        else {"node": incoming, "generation": 5, "state": "pending"},
    }
    copies = {(s.generation, s.state) for s in TaskSpec.copies_for(record, me)}
    expected = {(3, "running")} if me == "a" else set()
    expected |= {(5, "pending")} if incoming == me else set()
    assert copies == expected


def test_a_record_without_placement_fields_is_this_nodes() -> None:
    record = {key: value for key, value in RECORD.items() if key != "node"}
    assert [s.key for s in TaskSpec.copies_for(record, "z")] == [("t", 3)]
