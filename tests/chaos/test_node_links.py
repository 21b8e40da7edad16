"""Faults on the node<->coordinator links, end to end through `shoal chaos run`: real replicas,
real node daemons reaching them only through their own fault proxies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.chaos import invariants
from shoal.local import LocalCluster
from tests.support.chaos_report import chaos_failure

pytestmark = [pytest.mark.slow]

# Node n1 cut off every replica for longer than the run's dead-after (5 s); n2's links slowed
# and its connections reset; n2 also lives through a lossy spell.
SCENARIO = """
name = "node-links"
replicas = 3
nodes = 2
sim_gpus = 1
duration_s = 24
clients = 2
keys = 2
recover_within_s = 15
invariants = ["linearizable", "digests_equal", "no_leaks", "recovered", "nodes_alive"]

[[faults]]
kind = "coord-partition"
target = "n1"
partition = "refuse"
at = 1.0
duration = 8.0

[[faults]]
kind = "coord-delay"
target = "n2"
delay_s = 0.2
jitter_s = 0.05
at = 1.0
duration = 5.0

[[faults]]
kind = "coord-reset"
target = "all"
at = 12.0

[[faults]]
kind = "coord-loss"
target = "n2"
loss = 0.3
loss_mode = "drop"
at = 14.0
duration = 4.0
"""


@pytest.mark.timeout(150)
def test_a_partitioned_node_is_declared_dead_and_comes_back(tmp_path: Path) -> None:
    scenario, run_dir = tmp_path / "links.toml", tmp_path / "run"
    scenario.write_text(SCENARIO)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "shoal", "chaos", "run", str(scenario), "--json",
             "--run-dir", str(run_dir)],
            capture_output=True, text=True, timeout=140, check=False,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    finally:
        if (run_dir / "cluster.json").exists():
            LocalCluster(run_dir).stop_all()
    assert done.returncode == 0, chaos_failure(done)
    report = json.loads(done.stdout)
    assert all(v["held"] for v in report["invariants"].values()), report["invariants"]
    faults = {f["kind"]: f for f in report["faults"]}
    partition, delay = faults["coord-partition"], faults["coord-delay"]
    reset, loss = faults["coord-reset"], faults["coord-loss"]
    assert partition["processes"] == ["n1"]
    # Cut off longer than dead-after: the leader declared it dead, then alive once healed.
    assert partition["liveness"]["n1"][0] == "alive"
    assert "dead" in partition["liveness"]["n1"]
    assert partition["liveness"]["n1"][-1] == "alive"
    assert partition["recovered"]
    assert partition["recovery_s"] >= 8.0
    # Slowed, not cut: it never went dead.
    assert "dead" not in delay["liveness"]["n2"]
    assert delay["recovered"]
    assert reset["processes"] == ["n1", "n2"]
    assert "reset" in reset["detail"]
    assert reset["recovered"]
    assert loss["recovered"]
    assert invariants.leaked_processes(run_dir) == []
