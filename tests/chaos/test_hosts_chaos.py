"""`shoal chaos run --hosts`: the host faults on hosts of their own, as a user runs them. Each
node daemon in a network namespace with its own address and data directory, the API over TLS,
a training job whose learner group and rollout workers sit on different hosts; real cuts
(neighbour entries that lead nowhere), real SIGKILLs of everything on a host, a real drain.
Without hosts (not root), the same faults are reported unsupported, never pretended."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shoal import hosts
from shoal.chaos import invariants
from shoal.chaos.scenario import INVARIANTS
from shoal.local import LocalCluster, coordinator_specs
from tests.support.chaos_report import chaos_failure
from tests.support.netns import netns_cluster, reach, skip_unless_hosts
from tests.support.waiting import eventually

pytestmark = [pytest.mark.slow]

PATIENT_S = 540.0
"""How long the CLI may take on a loaded 2-core machine before the test gives up on it (a
failure detector: the scenario itself runs about two minutes here)."""


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


def clean_up(run_dir: Path) -> None:
    """What a CLI killed by the timeout left: its processes (own sessions) and its network."""
    local = LocalCluster(run_dir)
    try:
        if (run_dir / "cluster.json").exists():
            local.stop_all()
    finally:
        local.remove_network()


def namespaces(run_dir: Path) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    tag = hosts.run_tag(run_dir.resolve())
    return [line for line in listed.stdout.splitlines() if f"shoal-{tag}-" in line]


def by_kind(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["kind"]: f for f in report["faults"]}


@pytest.mark.timeout(600)
def test_the_hosts_scenario_holds_every_invariant_on_three_hosts(tmp_path: Path) -> None:
    """The shipped `hosts` scenario (the host faults of `stress`, short): the learners' host
    cut off the others, a worker's links delayed, the learners' host delayed by netem (or
    reported unsupported), the group moved to another host, then that host killed. Exit 0
    only if every invariant held, fragment accounting across every host's ledgers and the
    job's checkpoints in the storage only moving forward included."""
    skip_unless_hosts()
    run_dir = tmp_path / "run"
    try:
        done = shoal(
            "chaos", "run", "hosts", "--hosts", "3", "--json", "--run-dir", str(run_dir),
            timeout=PATIENT_S,
        )  # fmt: skip
        assert done.returncode == 0, chaos_failure(done)
        report = json.loads(done.stdout)
        assert report["ok"] is True
        assert set(report["invariants"]) == set(INVARIANTS)
        assert all(v["held"] for v in report["invariants"].values())
        faults = by_kind(report)
        assert list(faults) == ["host-cut", "link-delay", "host-delay", "learner-move", "host-kill"]

        cut = faults["host-cut"]
        assert "cut off the other hosts (coordinators still reachable)" in cut["detail"]
        assert cut["liveness"] == {cut["processes"][0]: ["alive"]}  # it reached the replicas
        assert "relayed links blackholed" in cut["detail"]
        assert cut["progress_s"] is not None

        link = faults["link-delay"]
        assert "links of rollout worker w0" in link["detail"]
        # Found in the worker's own namespace: open at injection or, where w0 was still
        # redialling after the cut on a loaded machine, dialled while the delay was in place.
        hit = re.search(r"\((\d+) links hit in all\)", link["detail"])
        assert hit is not None, link
        assert int(hit[1]) > 0, link

        delay = faults["host-delay"]
        if delay["unsupported"] is not None:
            assert "netem" in delay["unsupported"]
            assert delay["injected_at"] is None
        else:
            assert delay["recovered"], delay

        move = faults["learner-move"]
        drained = move["processes"][0]
        assert f"{drained} drained through the API" in move["detail"]
        landed = move["detail"].rsplit("learner group running on ", 1)[1]
        assert drained not in landed, move
        assert move["recovered"], move

        kill = faults["host-kill"]
        assert kill["processes"][0] in landed  # the host the group had moved to
        assert "SIGKILL to all" in kill["detail"]
        assert "dead" in kill["liveness"][kill["processes"][0]]
        assert kill["tasks_elsewhere_s"] is not None
        assert kill["recovered"], kill

        accounting = report["invariants"]["fragment_accounting"]["detail"]
        assert "across all learner incarnations and hosts" in accounting
        stored = report["invariants"]["checkpoints_forward"]["detail"]
        assert str(run_dir.resolve() / "storage" / "train" / "checkpoints") in stored
        assert report["invariants"]["resumed_from_checkpoint"]["held"]
        assert invariants.leaked_processes(run_dir) == []
        assert namespaces(run_dir) == []  # the hosts' network went with the run
    finally:
        clean_up(run_dir)


@pytest.mark.timeout(200)
def test_host_faults_without_hosts_are_reported_unsupported(tmp_path: Path) -> None:
    """On a cluster whose nodes share this host's network a host fault is not pretended: it
    is named unsupported, with what to do, and the run still passes on what it did make."""
    scenario = tmp_path / "one-host.toml"
    scenario.write_text(
        'name = "one-host"\nreplicas = 1\nnodes = 2\nduration_s = 4\nclients = 1\nkeys = 2\n'
        'invariants = ["recovered", "linearizable", "no_leaks"]\n'
        '[[faults]]\nkind = "host-cut"\ntarget = "n2"\nat = 1\nduration = 1\n'
        '[[faults]]\nkind = "kill"\ntarget = "leader"\nat = 2\nduration = 1\n'
    )
    run_dir = tmp_path / "run"
    try:
        done = shoal(
            "chaos", "run", str(scenario), "--json", "--run-dir", str(run_dir), timeout=180
        )
    finally:
        clean_up(run_dir)
    assert done.returncode == 0, chaos_failure(done)
    report = json.loads(done.stdout)
    cut, kill = report["faults"]
    assert "--hosts N" in cut["unsupported"]
    assert cut["injected_at"] is None
    assert kill["recovered"]
    assert (
        "unsupported here, so not made: ['host-cut n2']"
        in (report["invariants"]["recovered"]["detail"])
    )


def test_hosts_must_match_the_scenario_and_need_root(tmp_path: Path) -> None:
    """One line, before anything is made."""
    done = shoal("chaos", "run", "hosts", "--hosts", "2", "--run-dir", str(tmp_path), timeout=60)
    assert done.returncode != 0
    error = done.stderr.strip()
    assert len(error.splitlines()) == 1, error
    assert "give --hosts 3" in error
    assert not (tmp_path / "cluster.json").exists()
    if os.geteuid() != 0:
        done = shoal("chaos", "run", "hosts", "--hosts", "3", timeout=60)
        assert "--hosts needs root" in done.stderr


@pytest.mark.timeout(300)
def test_inject_cuts_a_host_of_a_running_cluster_and_kills_one(tmp_path: Path) -> None:
    """`shoal chaos inject host-cut|host-kill` on a `shoal up --hosts 2` cluster: during the
    cut h1 cannot reach h2's node but still the coordinators; healed, it can. A killed host
    loses its node daemon and comes back with a new one that registers again."""
    with netns_cluster(tmp_path, hosts=2) as local:
        network = local.network()
        assert network is not None
        h1, h2 = network.hosts
        node_port = _listening_port(local, "n2")
        api = local.api_urls()[0].rsplit(":", 1)[1]
        run = ["--run-dir", str(local.run_dir)]
        cut = subprocess.Popen(
            [sys.executable, "-m", "shoal", "chaos", "inject", "host-cut", "--target", "n2",
             "--duration", "4", *run],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            eventually(lambda: reach(h1, h2.address, node_port) == "lost", "the cut", timeout=60)
            assert reach(h2, network.bridge_address, int(api)) == "open"
            out, err = cut.communicate(timeout=60)
        finally:
            if cut.poll() is None:
                cut.kill()
        assert cut.returncode == 0, err
        assert "n2's host" in out
        assert "cut off the other hosts" in out
        assert "reaches the other hosts again" in out
        assert reach(h1, h2.address, node_port) == "open"

        before = local.pid("n2")
        done = shoal("chaos", "inject", "host-kill", "--target", "n2", "--duration", "1", *run,
                     timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f"(node daemon pid {before} and " in done.stdout
        assert "n2 registered and alive again" in done.stdout
        assert local.pid("n2") not in (None, before)


def _listening_port(local: LocalCluster, node: str) -> int:
    """The port node `node` listens on (its registered address, shoal://HOST:PORT)."""
    for row in local.get(f"{local.api_urls()[0]}/v1/nodes")["nodes"]:
        if row["id"] == node:
            return int(str(row["address"]).rsplit(":", 1)[1])
    raise AssertionError(f"{node} is not registered")


def test_inject_host_faults_need_a_cluster_with_hosts(tmp_path: Path) -> None:
    local = LocalCluster(tmp_path / "run")
    local.create(coordinator_specs(local.run_dir, 1))
    done = shoal("chaos", "inject", "host-kill", "--target", "n1", "--run-dir", str(local.run_dir),
                 timeout=60)  # fmt: skip
    assert done.returncode != 0
    assert "has no hosts of its own; start it with `shoal up --hosts N`" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    done = shoal("chaos", "inject", "host-cut", "--target", "n1", "--run-dir", str(local.run_dir),
                 timeout=60)  # fmt: skip
    assert "host-cut needs --duration" in done.stderr
