"""`shoal chaos` end to end, as a user runs it: real replicas, real signals, real proxies."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.chaos import invariants
from shoal.chaos.scenario import INVARIANTS
from shoal.local import LocalCluster, coordinator_specs
from tests.support.chaos_report import chaos_failure

pytestmark = [pytest.mark.slow]


def stop_leftovers(run_dir: Path) -> None:
    """If the CLI was killed by a timeout, its replicas (own sessions) are still running."""
    if (run_dir / "cluster.json").exists():
        LocalCluster(run_dir).stop_all()


def shoal(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "shoal", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


@pytest.mark.timeout(200)
def test_smoke_scenario_holds_every_invariant(tmp_path: Path) -> None:
    """The CI scenario: a training job through the cluster under every kind of fault it has;
    exit 0 only if every invariant held, training_progress after each fault included."""
    run_dir, text = tmp_path / "run", tmp_path / "report.txt"
    done = shoal(
        "chaos", "run", "smoke", "--json", "--run-dir", str(run_dir), "--report-file", str(text),
        timeout=180,
    )  # fmt: skip
    try:
        assert done.returncode == 0, chaos_failure(done)
        report = json.loads(done.stdout)
        assert report["ok"] is True
        shown = text.read_text()
        assert shown.startswith("chaos scenario smoke: PASSED")
        for part in ("recovery (s):", "policy version (^ = fault injected):", "^"):
            assert part in shown
        assert set(report["invariants"]) == set(INVARIANTS)
        assert all(v["held"] for v in report["invariants"].values())
        kinds = [f["kind"] for f in report["faults"]]
        assert kinds == [
            "kill", "learner-kill", "pause", "node-kill", "api-partition", "gpu-xid",
            "raft-partition", "rollout-kill", "coord-partition",
        ]  # fmt: skip
        for fault in report["faults"]:
            assert fault["recovered"], fault
            assert fault["injected_at"] is not None
            assert fault["healed_at"] >= fault["injected_at"]
            assert fault["progress_s"] is not None, fault
        # Three clients for 70 s, each starting at most the scenario's 50 a second, and the
        # four registers' first writes.
        assert 100 < report["operations"] <= 3 * (70 * 50 + 1) + 4
        learner = report["faults"][1]
        assert learner["processes"] == ["rank1"]
        assert learner["detail"].startswith("SIGKILL learner rank 1")
        assert report["recovery"]["all"]["faults"] == len(kinds)
        node = report["faults"][3]
        assert "dead" in node["liveness"][node["processes"][0]], node
        assert node["tasks_elsewhere_s"] is not None, node
        assert node["tasks_elsewhere_target_s"] == 10.0
        assert report["tasks_elsewhere"]["measured"] >= 1
        cut = report["faults"][-1]
        assert "dead" not in cut["liveness"][cut["processes"][0]], cut
        training = report["training"]
        assert training["restarts"] >= 1
        versions = [s["version"] for s in training["curve"]]
        assert versions[-1] > versions[0]
        assert invariants.leaked_processes(run_dir) == []
    finally:
        stop_leftovers(run_dir)


@pytest.mark.timeout(200)
def test_a_broken_bound_fails_the_run(tmp_path: Path) -> None:
    """A majority down for 4 s cannot be writable 0.2 s after it is restarted: exit 1."""
    scenario = tmp_path / "majority.toml"
    scenario.write_text(
        'name = "majority-down"\nduration_s = 8\nclients = 2\nkeys = 2\n'
        'invariants = ["recovered", "linearizable", "no_leaks"]\n'
        '[[faults]]\nkind = "kill"\ntarget = "leader"\nat = 1\nduration = 4\n'
        "recover_within_s = 0.2\n"
        '[[faults]]\nkind = "kill"\ntarget = "follower"\nat = 1\nduration = 4\n'
        "recover_within_s = 0.2\n"
    )
    run_dir = tmp_path / "run"
    try:
        done = shoal(
            "chaos", "run", str(scenario), "--json", "--run-dir", str(run_dir), timeout=180
        )
    finally:
        stop_leftovers(run_dir)
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert [f["detail"].startswith("SIGKILL") for f in report["faults"]] == [True, True]
    assert len({p for f in report["faults"] for p in f["processes"]}) == 2
    assert report["invariants"]["recovered"]["held"] is False
    assert "not recovered" in report["invariants"]["recovered"]["detail"]
    assert report["invariants"]["linearizable"]["held"] is True
    assert report["invariants"]["no_leaks"]["held"] is True
    assert report["workload"]["unknown_outcome"] > 0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path / "run")
    local.create(coordinator_specs(local.run_dir, 3))
    try:
        local.start_all()
        local.wait_ready()
        yield local
    finally:
        local.stop_all()
        # Processes restarted by `shoal chaos inject` are known by their pid files only.
        LocalCluster(local.run_dir).stop_all()


@pytest.mark.timeout(120)
def test_inject_kills_the_leader_and_restarts_it(cluster: LocalCluster) -> None:
    """The leader is resolved when the command runs (it may have changed since the cluster
    came up on a loaded machine), so the killed replica is read from the output."""
    cluster.wait_ready()
    pids = {s.name: cluster.pid(s.name) for s in cluster.specs()}
    done = shoal(
        "chaos", "inject", "kill", "--target", "leader", "--duration", "1",
        "--run-dir", str(cluster.run_dir),
        timeout=100,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    killed = re.search(r"SIGKILL (c\d) \(pid (\d+)\)", done.stdout)
    assert killed is not None, done.stdout
    leader, old_pid = killed[1], int(killed[2])
    assert pids[leader] == old_pid
    assert f"restarted {leader}" in done.stdout
    assert LocalCluster(cluster.run_dir).pid(leader) not in (None, old_pid)


def test_inject_refuses_bad_input(cluster: LocalCluster) -> None:
    run_dir = str(cluster.run_dir)
    done = shoal("chaos", "inject", "kill", "--target", "c9", "--run-dir", run_dir, timeout=30)
    assert done.returncode == 2
    assert "no process 'c9'" in done.stderr
    # The API kinds need [chaos] enabled = true in the coordinators' config; this cluster has none.
    done = shoal("chaos", "inject", "node-kill", "--target", "n1", "--run-dir", run_dir, timeout=30)
    assert done.returncode == 2
    assert "chaos is disabled" in done.stderr
    assert "enabled = true" in done.stderr
    for argv, text in (
        (("pause", "--target", "c1"), "pause needs --duration > 0"),
        (("clock-skew", "--target", "n1", "--duration", "3"), "clock-skew needs --offset"),
        (("node-kill", "--target", "n1", "--offset", "2"), "--offset belongs to clock-skew"),
        (("task-pause", "--target", "t1", "--duration", "0"), "task-pause needs --duration > 0"),
        (("task-kill", "--target", "t1", "--gpu", "0"), "--gpu and --xid belong to gpu-xid"),
        (("gpu-xid", "--target", "n1"), "gpu-xid needs --gpu N"),
        (("task-kill", "--target", "t1", "--duration", "-1"), "--duration=-1.0 must be in"),
        (("kill", "--target", "c1", "--coordinator", "http://h:1"), "takes no --coordinator"),
        (("node-kill", "--target", "n1", "--coordinator", "h:1"), "use http://HOST:PORT"),
        (("node-kill",), "--target"),
        (("disk-melt", "--target", "n1"), "invalid choice"),
    ):
        done = shoal("chaos", "inject", *argv, "--run-dir", run_dir, timeout=30)
        assert done.returncode == 2, (argv, done.stderr)
        assert text in done.stderr, (argv, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    done = shoal("chaos", "run", "no-such-scenario", timeout=30)
    assert done.returncode == 2
    assert "smoke" in done.stderr
    done = shoal("chaos", "run", "smoke", "--report-file", "/no/such/dir/r.txt", timeout=30)
    assert done.returncode == 2
    assert "folder /no/such/dir does not exist" in done.stderr


@pytest.mark.timeout(60)
def test_standalone_proxy_is_switched_over_http() -> None:
    """`shoal chaos proxy` between this test and a real TCP server; faults set with curl-like
    HTTP calls take effect on the byte stream."""
    server = socket.create_server(("127.0.0.1", 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal", "chaos", "proxy", f"127.0.0.1:{server.getsockname()[1]}"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        proxy_port = int(proc.stdout.readline().split()[1].rsplit(":", 1)[1])
        control = proc.stdout.readline().split()[1]
        with socket.create_connection(("127.0.0.1", proxy_port), timeout=10) as client:
            upstream, _ = server.accept()
            with upstream:
                client.sendall(b"through")
                assert upstream.recv(100) == b"through"
                request = urllib.request.Request(
                    control.replace("/proxies", "/proxies/proxy/reset"), method="POST"
                )
                with urllib.request.urlopen(request, timeout=10) as resp:
                    assert json.loads(resp.read()) == {"reset": 1}
                with pytest.raises(ConnectionResetError):
                    client.recv(1)
        bad = urllib.request.Request(
            control.replace("/proxies", "/proxies/proxy/faults"),
            data=b'{"loss": 7}',
            method="PUT",
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(bad, timeout=10)
        assert info.value.code == 400
        assert "loss=7" in info.value.read().decode()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
        server.close()


def test_standalone_proxy_refuses_a_bad_target() -> None:
    done = shoal("chaos", "proxy", "nowhere", timeout=30)
    assert done.returncode == 2
    assert "target='nowhere'" in done.stderr


@pytest.mark.timeout(120)
def test_soak_runs_until_its_time_is_up(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(
        'name = "tiny"\nduration_s = 2\nclients = 1\nkeys = 1\n'
        '[[faults]]\nkind = "api-reset"\ntarget = "all"\nat = 1\n'
    )
    done = shoal("chaos", "soak", "--hours", "0.0003", "--scenario", str(scenario), timeout=100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "every invariant held" in done.stdout
    assert "chaos scenario tiny: PASSED" in done.stdout
    bad = shoal("chaos", "soak", "--hours", "0", timeout=30)
    assert bad.returncode == 2
    assert "--hours=0.0" in bad.stderr
