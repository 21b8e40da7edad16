"""`shoal coordinator --config FILE.toml` and `shoal up --coordinator-config`: the settings file
is checked key by key, reaches every replica, shows at GET /v1/config, and drives the leader."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.commands.coordinator import load_settings, with_flags
from shoal.errors import ConfigError
from shoal.local import LocalCluster, coordinator_specs, node_specs
from shoal.ports import free_port
from shoal.raft.config import CoordinatorSettings
from tests.support.waiting import eventually

from .inprocess import InProcessReplica

FLAGS_UNSET = argparse.Namespace(
    min_election_timeout=None,
    max_election_timeout=None,
    append_period=None,
    suspect_after=None,
    dead_after=None,
    config=None,
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "coordinator.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[liveness]\ndead_afterr = 3\n", ["liveness.dead_afterr", "valid keys", "dead_after"]),
        ("[balancers]\nhigh = 0.9\n", ["balancers", "valid keys", "balancer"]),
        ("[liveness]\ndead_after = 'soon'\n", ["liveness.dead_after", "'soon'", "a number"]),
        ("[liveness]\ndead_after = 2.0\n", ["dead_after=2.0", "must exceed", "suspect_after"]),
        ("[liveness]\ncheck_period = nan\n", ["liveness.check_period=nan", "finite"]),
        ("[balancer]\nlow = 0.9\n", ["balancer.low = 0.9", "0 < low < high"]),
        ("[balancer]\nenter_after = 1.5\n", ["balancer.enter_after", "1.5", "an integer"]),
        ("[scheduler]\nperiod = 0\n", ["scheduler.period=0", "> 0"]),
        ("[raft]\nmin_timeout = 0.1\n", ["raft.min_timeout=0.1", "3 x raft.append_period"]),
        ("scheduler = 3\n", ["scheduler must be a table"]),
        ("[liveness\n", ["not valid TOML"]),
    ],
)
def test_a_bad_file_names_the_key_the_value_and_what_is_valid(
    tmp_path: Path, text: str, words: list[str]
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    message = str(caught.value)
    assert str(path) in message
    assert "\n" not in message
    for word in words:
        assert word in message


def test_a_missing_file_and_no_file_at_all(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_settings(tmp_path / "absent.toml")
    assert load_settings(None) == CoordinatorSettings()


def test_keys_left_out_keep_their_defaults(tmp_path: Path) -> None:
    loaded = load_settings(write(tmp_path, "[balancer]\nhigh = 0.95\n[scheduler]\nperiod = 2\n"))
    default = CoordinatorSettings()
    assert loaded.balancer.high == 0.95
    assert loaded.balancer.low == default.balancer.low
    assert loaded.scheduling.period == 2.0
    assert loaded.liveness == default.liveness
    assert loaded.raft == default.raft


@settings(deadline=None, max_examples=60)
@given(
    suspect=st.floats(0.01, 100.0),
    extra=st.floats(0.01, 100.0),
    period=st.floats(0.01, 60.0),
    high=st.floats(0.02, 1.0),
    fraction=st.floats(0.05, 0.95),
    enter_after=st.integers(1, 50),
)
def test_every_valid_file_loads_exactly_what_it_says(
    tmp_path_factory: pytest.TempPathFactory,
    suspect: float,
    extra: float,
    period: float,
    high: float,
    fraction: float,
    enter_after: int,
) -> None:
    tables: dict[str, dict[str, Any]] = {
        "liveness": {"suspect_after": suspect, "dead_after": suspect + extra},
        "scheduler": {"period": period},
        "balancer": {"high": high, "low": high * fraction, "enter_after": enter_after},
    }
    text = "".join(
        f"[{name}]\n" + "".join(f"{k} = {v!r}\n" for k, v in table.items())
        for name, table in tables.items()
    )
    loaded = load_settings(write(tmp_path_factory.mktemp("cfg"), text)).as_dict()
    for name, table in tables.items():
        for key, value in table.items():
            assert loaded[name][key] == value


def test_flags_override_the_file_and_a_clash_names_both(tmp_path: Path) -> None:
    path = write(tmp_path, "[liveness]\nsuspect_after = 1.0\ndead_after = 4.0\n")
    flags = argparse.Namespace(**{**vars(FLAGS_UNSET), "dead_after": 6.0, "config": path})
    merged = with_flags(load_settings(path), flags)
    assert (merged.liveness.suspect_after, merged.liveness.dead_after) == (1.0, 6.0)
    assert with_flags(load_settings(path), FLAGS_UNSET) == load_settings(path)
    flags.dead_after = 0.5
    with pytest.raises(ConfigError, match=r"timing flags do not fit .*coordinator.toml"):
        with_flags(load_settings(path), flags)


def shoal(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shoal", *args], capture_output=True, text=True, timeout=90
    )


@pytest.mark.timeout(120)
def test_the_commands_refuse_a_bad_file_in_one_line_and_start_nothing(tmp_path: Path) -> None:
    path = write(tmp_path, "[liveness]\ndead_after = -1\n")
    run_dir = tmp_path / "run"
    up = shoal(
        "up", "--replicas", "1", "--run-dir", str(run_dir), "--coordinator-config", str(path)
    )
    assert up.returncode == 2
    assert "liveness.dead_after" in up.stderr
    assert "Traceback" not in up.stderr
    assert not (run_dir / "cluster.json").exists()
    coordinator = shoal(
        "coordinator", "--id", "c1", "--raft", f"127.0.0.1:{free_port()}",
        "--api", f"127.0.0.1:{free_port()}", "--data-dir", str(tmp_path / "data"),
        "--config", str(path),
    )  # fmt: skip
    assert coordinator.returncode == 2
    assert len(coordinator.stderr.strip().splitlines()) == 1
    assert "liveness.dead_after=-1.0" in coordinator.stderr


@pytest.mark.timeout(60)
def test_the_effective_settings_are_served_and_documented(tmp_path: Path) -> None:
    loaded = load_settings(write(tmp_path, "[balancer]\ncooldown_s = 7.5\n"))
    replica = InProcessReplica(
        tmp_path / "data",
        scheduling=loaded.scheduling,
        settings_source="coordinator.toml",
    )
    try:
        replica.start()
        status, body = replica.request("GET", "/v1/config")
        assert status == 200
        assert body["source"] == "coordinator.toml"
        assert body["balancer"]["cooldown_s"] == 7.5
        assert body["liveness"] == CoordinatorSettings().as_dict()["liveness"]
        assert set(body) >= {"scheduler", "balancer", "liveness", "raft"}
        assert replica.request("GET", "/v1/config", token=None)[0] == 401
        _, document = replica.request("GET", "/openapi.json")
        assert "get" in document["paths"]["/v1/config"]
    finally:
        replica.close()


def get(url: str, token: str) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=5) as answer:
        return json.loads(answer.read())


def liveness_of(local: LocalCluster, node: str) -> str:
    for row in local.nodes():
        if row["id"] == node:
            return str(row["liveness"])
    return "unregistered"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_shoal_up_hands_the_file_to_every_replica(tmp_path: Path) -> None:
    path = write(tmp_path, "[balancer]\nhigh = 0.9\n[liveness]\ndead_after = 12\n")
    run_dir = tmp_path / "run"
    local = LocalCluster(run_dir)
    try:
        up = shoal(
            "up", "--replicas", "3", "--run-dir", str(run_dir),
            "--coordinator-config", str(path),
        )  # fmt: skip
        assert up.returncode == 0, up.stderr
        configs = [get(f"{url}/v1/config", local.token) for url in local.api_urls()]
        assert [c["liveness"]["dead_after"] for c in configs] == [12.0, 12.0, 12.0]
        assert [c["balancer"]["high"] for c in configs] == [0.9, 0.9, 0.9]
        assert {c["source"] for c in configs} == {str(path.resolve())}
        other = tmp_path / "other.toml"
        other.write_text("[balancer]\nhigh = 0.8\n")
        again = shoal(
            "up", "--replicas", "3", "--run-dir", str(run_dir),
            "--coordinator-config", str(other),
        )  # fmt: skip
        assert again.returncode == 2
        assert "re-reads the file it was created with" in again.stderr
    finally:
        if (run_dir / "cluster.json").exists():
            local.stop_all()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_coordinator_with_a_short_dead_after_declares_a_killed_node_dead(
    tmp_path: Path,
) -> None:
    path = write(
        tmp_path,
        "[liveness]\nsuspect_after = 0.75\ndead_after = 1.5\ncheck_period = 0.05\n",
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    local = LocalCluster(run_dir)
    coordinators = coordinator_specs(run_dir, 1, ("--config", str(path)))
    urls = [s.api_url for s in coordinators if s.api_url]
    # Nodes heartbeat every 0.2 s, well inside the short suspect_after, so n2 stays alive.
    nodes = node_specs(run_dir, urls, 2, 1, extra_args=("--heartbeat", "0.2"))
    local.create(coordinators + nodes)
    try:
        local.start_all()
        leader = local.wait_ready()
        local.wait_nodes(2)
        assert get(f"{leader}/v1/config", local.token)["liveness"]["dead_after"] == 1.5
        local.kill("n1")
        eventually(lambda: liveness_of(local, "n1") == "dead", "n1 declared dead")
        # Declared dead sooner after its last heartbeat than the 10 s default dead_after
        # allows: only the file's 1.5 s can do that (times from the leader's own stamps).
        last = get(f"{leader}/v1/nodes/n1", local.token)["last_heartbeat"]
        events = get(f"{leader}/v1/events?since=0", local.token)["events"]
        dead_at = next(e["at"] for e in events if e["message"] == "node n1 suspect -> dead")
        assert dead_at - last < 10.0
        changes = [e["message"] for e in events if e["kind"] == "node_liveness"]
        assert changes.index("node n1 alive -> suspect") < changes.index("node n1 suspect -> dead")
        assert "node n2 suspect -> dead" not in changes
        assert liveness_of(local, "n2") != "dead"
    finally:
        local.stop_all()


def test_every_key_is_documented_with_its_default() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1]
    for table, keys in CoordinatorSettings().as_dict().items():
        for key, default in keys.items():
            shown = str(default).lower() if isinstance(default, bool) else str(default)
            assert rows.get(f"{table}.{key}") == shown, f"{table}.{key} in docs/operations.md"
