"""Kill -9 a learner rank mid-run: the run re-forms the group and resumes from a checkpoint."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest

from shoal.learner.config import CheckpointConfig, EvalConfig, TrainConfig
from shoal.train import LocalRun, train


@pytest.mark.timeout(240)
def test_sigkilled_learner_resumes_from_its_newest_checkpoint(tmp_path: Path) -> None:
    cfg = replace(
        TrainConfig(),
        target_return=120.0,
        time_limit_s=150.0,
        checkpoint=CheckpointConfig(interval_s=0.2),
        eval=EvalConfig(episodes=1),
    )
    killed: list[int] = []
    seen: list[int] = []

    def kill_after_a_checkpoint(run: LocalRun) -> None:
        proc = run.learners[0].proc
        assert proc is not None
        if proc.pid not in seen:
            seen.append(proc.pid)
        step = run.statuses.get(0, {}).get("checkpoint_step")
        if not killed and step is not None and step >= 3:
            killed.append(proc.pid)
            os.kill(proc.pid, signal.SIGKILL)

    result = train(cfg, run_dir=tmp_path / "run", on_poll=kill_after_a_checkpoint)

    assert killed, "the learner never wrote a checkpoint to resume from"
    assert result.restarts == 1
    assert result.solved
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["event"] == "start" and e["process"] == "learner"]
    assert len(starts) == 2
    assert starts[0]["step"] == 0
    assert starts[0]["resumed_from"] is None
    resumed = starts[1]
    assert resumed["resumed_from"] is not None
    resumed_step = int(Path(resumed["resumed_from"]).stem.split("-")[1])
    assert resumed["step"] == resumed_step
    assert resumed["step"] >= 3
    assert resumed["env_steps"] > 0
    assert result.checkpoint_step is not None
    assert result.checkpoint_step > resumed["step"]
    assert any(e["event"] == "restart" and "learner-0" in e["why"] for e in events)
    for pid in seen:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
