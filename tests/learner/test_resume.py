"""Kill -9 a learner rank mid-run: the coordinator of the embedded cluster restarts the group,
which resumes from a checkpoint; kill -9 a rollout worker: it is restarted alone and its new
incarnation is accounted apart."""

from __future__ import annotations

import json
import os
import re
import signal
from dataclasses import replace
from pathlib import Path

import pytest

from shoal.chaos.job_files import ledger_verdict
from shoal.cluster_train import ClusterRun
from shoal.learner.config import CheckpointConfig, EvalConfig, TrainConfig
from shoal.train import train


@pytest.mark.timeout(240)
def test_sigkilled_learner_resumes_from_its_newest_checkpoint(tmp_path: Path) -> None:
    cfg = replace(
        TrainConfig(),
        target_return=1e9,
        max_env_steps=150_000,  # room to resume and train on after both kills, however fast
        time_limit_s=150.0,
        checkpoint=CheckpointConfig(interval_s=1.0),
        eval=EvalConfig(episodes=1),
    )
    killed: list[int] = []
    seen: list[int] = []
    asked: list[int] = []
    steps_at_kill: list[int] = []

    def kill_after_a_checkpoint(run: ClusterRun) -> None:
        status = run.status.statuses.get(0, {})
        learner = status.get("pid")
        rollout = _newest_start(run.run_dir, "rollout")
        if learner is None or rollout is None:
            return
        seen.extend(pid for pid in (learner, rollout) if pid not in seen)
        step = status.get("checkpoint_step")
        if not asked and status.get("version", 0) >= 1:
            asked.append(learner)
            os.kill(learner, signal.SIGUSR1)  # a checkpoint on demand
        answered = _on_demand_written(run.run_dir)  # a kill in the same poll would lose it
        if not killed and answered and step is not None and step >= 3:
            killed.append(learner)
            os.kill(learner, signal.SIGKILL)
        elif len(killed) == 1 and learner != killed[0] and status.get("version", 0) > 6:
            killed.append(rollout)  # the resumed learner is training: now lose the actors
            steps_at_kill.append(int(status.get("env_steps", 0)))
            os.kill(rollout, signal.SIGKILL)

    result = train(cfg, run_dir=tmp_path / "run", on_poll=kill_after_a_checkpoint)

    assert len(killed) == 2, "the learner never wrote a checkpoint, or never resumed"
    assert result.restarts == 2
    # Training went on after both kills: to its budget, or (a loaded machine) to its clock.
    assert result.stopped_by in ("max_env_steps", "time_limit")
    assert result.env_steps > steps_at_kill[0]
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["event"] == "start" and e["process"] == "learner"]
    assert len(starts) == 2
    assert starts[0]["step"] == 0
    assert starts[0]["resumed_from"] is None
    resumed = starts[1]
    assert resumed["resumed_from"] is not None
    resumed_step = int(Path(resumed["resumed_from"]).stem.split("-")[1])
    assert resumed["step"] == resumed_step
    assert resumed["step"] > 0
    assert resumed["env_steps"] > 0
    assert result.checkpoint_step is not None
    assert result.checkpoint_step > resumed["step"]
    assert any(e.get("reason") == "on demand" for e in events if e["event"] == "checkpoint")
    rollout_starts = [e for e in events if e["event"] == "start" and e["process"] == "rollout"]
    assert len(rollout_starts) == 2
    for pid in seen:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # Issue #7 across both kills: every acknowledged fragment trained (from the resumed
    # checkpoint on), dropped as stale, rolled back with the dead learner, or queued at the stop.
    accounting = ledger_verdict(tmp_path / "run")
    assert accounting.held, accounting.detail
    trained = re.search(r"(\d+) trained", accounting.detail)
    assert trained is not None
    assert int(trained.group(1)) > 0, accounting.detail


def _on_demand_written(run_dir: Path) -> bool:
    """Whether the learner has recorded the checkpoint SIGUSR1 asked for."""
    return any(
        e.get("event") == "checkpoint" and e.get("reason") == "on demand"
        for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
    )


def _newest_start(run_dir: Path, process: str) -> int | None:
    """The pid of the newest `process` that announced its start in events.jsonl."""
    pids = [
        int(e["pid"])
        for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
        if e.get("event") == "start" and e.get("process") == process
    ]
    return pids[-1] if pids else None
