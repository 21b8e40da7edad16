"""The scenario's training job, read from its run directory: pids are found from `start`
events and signalled only when the command line is that program of this run; rank 0's status
becomes a curve sample; bad `[training]` settings are named."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.chaos.errors import FaultError
from shoal.chaos.trainjob import ClusterJob, JobConfig
from shoal.errors import ConfigError


def sleeper(*argv: str) -> subprocess.Popen[bytes]:
    """A process whose command line carries `argv` (as a task process's would)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *argv])


@pytest.fixture
def job(tmp_path: Path) -> ClusterJob:
    job = ClusterJob(JobConfig(), tmp_path, time_limit_s=60.0)
    job.run_dir.mkdir()
    return job


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for proc in started:
            proc.kill()
            proc.wait()


def write_events(job: ClusterJob, events: list[dict[str, object]]) -> None:
    lines = [json.dumps(e) for e in events]
    (job.run_dir / "events.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.timeout(30)
def test_pids_come_from_start_events_and_command_lines(
    job: ClusterJob, procs: list[subprocess.Popen[bytes]]
) -> None:
    run = str(job.run_dir)
    rank0 = sleeper("shoal.learner.learner_main:main", "--run-dir", run, "--port", "1")
    worker1 = sleeper("shoal.learner.rollout_main:main", "--run-dir", run, "--worker", "1")
    stranger = sleeper("shoal.learner.learner_main:main", "--run-dir", "/elsewhere")
    procs += [rank0, worker1, stranger]
    write_events(
        job,
        [
            {"event": "submitted", "job": "train-1"},
            {"event": "start", "process": "learner", "rank": 0, "pid": rank0.pid},
            {"event": "start", "process": "learner", "rank": 1, "pid": stranger.pid},
            {"event": "start", "process": "rollout", "pid": worker1.pid},
        ],
    )
    assert job.job_id() == "train-1"
    assert job.learner_pid(0) == rank0.pid
    assert job.rollout_pid(1) == worker1.pid
    with pytest.raises(FaultError, match="learner rank 1 of the job is not running"):
        job.learner_pid(1)  # a live pid, but not this run's: never signalled
    with pytest.raises(FaultError, match="rollout worker 0"):
        job.rollout_pid(0)
    assert job.kill(rank0.pid, "learner rank 0") == f"SIGKILL learner rank 0 (pid {rank0.pid})"
    rank0.wait(timeout=10)
    with pytest.raises(FaultError, match="learner rank 0"):
        job.learner_pid(0)
    with pytest.raises(FaultError, match="exited before the SIGKILL"):
        job.kill(rank0.pid, "learner rank 0")


def test_rank0_status_becomes_a_sample(job: ClusterJob) -> None:
    assert job.sample(1.0, 0) is None
    status = {"version": 12, "env_steps": 3000, "incarnation": "ab", "returns": [-80.0, -100.0]}
    (job.run_dir / "status-0.json").write_text(json.dumps(status))
    sample = job.sample(2.5, 3)
    assert sample is not None
    assert (sample.t, sample.version, sample.env_steps) == (2.5, 12, 3000)
    assert (sample.mean_return, sample.restarts, sample.incarnation) == (-90.0, 3, "ab")


def test_a_job_never_started_fails_its_wait(job: ClusterJob) -> None:
    with pytest.raises(FaultError, match="exited before it trained"):
        job.wait_training()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ranks": 0}, "training.ranks=0 must be in 1..4"),
        ({"ranks": 3, "workers": 2}, "training.workers=2 must be in 3..8"),
        ({"checkpoint_interval_s": 0}, "training.checkpoint_interval_s=0 must be > 0"),
        ({"env": ""}, "training.env=''"),
    ],
)
def test_bad_training_settings_are_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        JobConfig(**kwargs)  # type: ignore[arg-type]
