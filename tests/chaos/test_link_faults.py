"""link-* faults: scenario files that name them (parsed, and refused with a reason), and a
small scenario run end to end as a user runs it, with every rollout<->learner link of a real
training job dialled through the run's link relay."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.chaos.errors import ScenarioError
from shoal.chaos.scenario import LINK_KINDS, parse
from shoal.chaos.traffic import NetFaults
from shoal.local import LocalCluster
from tests.support.chaos_report import chaos_failure

HEAD = """
name = "links"
replicas = 1
nodes = 1
sim_gpus = 2
duration_s = 30
clients = 1
keys = 2
recover_within_s = 45
"""
TRAINING = """
[training]
env = "acrobot"
ranks = 1
workers = 2
checkpoint_interval_s = 2.0
"""
FAULTS = """
[[faults]]
kind = "link-partition"
target = "w0"
at = 2.0
duration = 4.0

[[faults]]
kind = "link-delay"
target = "rank0"
at = 9.0
duration = 4.0
delay_s = 0.05
jitter_s = 0.02

[[faults]]
kind = "link-reset"
target = "all"
at = 15.0

[[faults]]
kind = "link-bandwidth"
target = "w1"
at = 19.0
duration = 3.0
bandwidth_bps = 50000

[[faults]]
kind = "link-loss"
target = "rank0"
at = 24.0
duration = 2.0
loss = 0.05
"""


def test_link_faults_parse_with_their_settings() -> None:
    scenario = parse(HEAD + TRAINING + FAULTS)
    assert [f.kind for f in scenario.faults] == [
        "link-partition", "link-delay", "link-reset", "link-bandwidth", "link-loss",
    ]  # fmt: skip
    assert set(LINK_KINDS) == {f.kind for f in scenario.faults}
    partition, delay, reset, bandwidth, loss = scenario.faults
    assert partition.net_faults() == NetFaults(partition="refuse")
    assert delay.net_faults() == NetFaults(delay_s=0.05, jitter_s=0.02)
    assert reset.net_faults() == NetFaults()
    assert bandwidth.net_faults() == NetFaults(bandwidth_bps=50000)
    assert loss.net_faults() == NetFaults(loss=0.05)


@pytest.mark.parametrize(
    ("fault", "says"),
    [
        ('kind = "link-delay"\ntarget = "w2"\nat = 1.0', "target='w2' is not one of"),
        ('kind = "link-delay"\ntarget = "leader"\nat = 1.0', "['all', 'rank0', 'w0', 'w1']"),
        ('kind = "link-delay"\ntarget = "all"\nat = 1.0\ndelay_s = -1', "delay_s=-1"),
        ('kind = "link-loss"\ntarget = "all"\nat = 1.0\nloss = 2', "loss=2"),
        ('kind = "link-reset"\ntarget = "all"\nat = 1.0\nloss = 0.5', "unknown keys ['loss']"),
        ('kind = "link-partition"\ntarget = "all"\nat = 1.0\npartition = "x"', "partition='x'"),
    ],
)
def test_bad_link_faults_name_the_problem(fault: str, says: str) -> None:
    with pytest.raises(ScenarioError, match=f"faults\\[0\\].*{_escape(says)}"):
        parse(HEAD + TRAINING + "[[faults]]\n" + fault + "\n")


def test_link_faults_need_the_training_job() -> None:
    with pytest.raises(ScenarioError, match="add a \\[training\\] table"):
        parse(HEAD + '[[faults]]\nkind = "link-reset"\ntarget = "all"\nat = 1.0\n')


def _escape(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_a_training_job_rides_out_link_faults_through_the_relay(tmp_path: Path) -> None:
    """Each fault hits real links of the job's processes (the relay's counts say how many), and
    training goes on after each with every invariant holding."""
    scenario = tmp_path / "links.toml"
    scenario.write_text(HEAD + TRAINING + FAULTS)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("SHOAL_LINK_RELAY", None)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "shoal", "chaos", "run", str(scenario), "--json",
             "--run-dir", str(run_dir)],
            capture_output=True, text=True, timeout=330, env=env, check=False,
        )  # fmt: skip
    finally:
        if (run_dir / "cluster.json").exists():
            LocalCluster(run_dir).stop_all()
    assert done.returncode == 0, chaos_failure(done)
    report = json.loads(done.stdout)
    assert report["ok"] is True
    assert all(v["held"] for v in report["invariants"].values()), report["invariants"]
    faults = {f["kind"]: f for f in report["faults"]}
    assert sorted(faults) == sorted(LINK_KINDS)
    for fault in faults.values():
        assert fault["recovered"], fault
        assert fault["progress_s"] is not None, fault
    # Rollout worker w0's links: its two to the learner and the learner's two to it.
    assert "rollout worker w0 (pid " in faults["link-partition"]["detail"]
    assert "(4 open now" in faults["link-partition"]["detail"]
    # The job has 8 links; w0's, cut until t = 6 s, may still be reconnecting at the later
    # faults on a loaded machine, but w1's 4 are open throughout.
    delayed = re.search(r"\((\d+) open now", faults["link-delay"]["detail"])
    assert delayed is not None, faults["link-delay"]
    assert 4 <= int(delayed[1]) <= 8
    reset = re.match(r"reset (\d+) open links", faults["link-reset"]["detail"])
    assert reset is not None, faults["link-reset"]
    assert 4 <= int(reset[1]) <= 8
    spec = json.loads((run_dir / "cluster.json").read_text())
    nodes = [p for p in spec["processes"] if p["kind"] == "node"]
    assert all(p["env"]["SHOAL_LINK_RELAY"].startswith("127.0.0.1:") for p in nodes)


def test_a_run_with_link_faults_but_no_relay_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    from shoal.chaos.errors import ChaosError
    from shoal.chaos.runner import run_scenario
    from shoal.local import ProcessSpec, coordinator_specs

    cluster = LocalCluster(tmp_path / "run")
    node = ProcessSpec("n1", [sys.executable, "-c", "pass"], "node")
    cluster.create([*coordinator_specs(cluster.run_dir, 1), node])
    with pytest.raises(ChaosError, match="no link relay was planned; pass relay_port"):
        run_scenario(parse(HEAD + TRAINING + FAULTS), cluster)
    assert all(cluster.pid(name) is None for name in ("c1", "n1"))
