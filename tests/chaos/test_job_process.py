"""The scenario's training job, read from its run directory: pids are found from `start`
events and signalled only when the command line is that program of this run; rank 0's status
becomes a curve sample; bad `[training]` settings are named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.chaos.errors import FaultError
from shoal.chaos.job_process import ClusterJob, JobConfig
from shoal.errors import ConfigError
from tests.support.waiting import eventually


def sleeper(*argv: str) -> subprocess.Popen[bytes]:
    """A process whose command line carries `argv` (as a task process's would), returned once
    it does: between fork and exec a child's /proc cmdline is still its parent's, and a loaded
    machine can leave it there long enough for a lookup to find pytest instead."""
    script = "import time; time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", script, *argv])
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    eventually(lambda: script.encode() in cmdline.read_bytes(), f"pid {proc.pid} exec'd")
    return proc


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


@pytest.mark.timeout(120)
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
        ({"gpus_per_rank": 65}, "training.gpus_per_rank=65 must be in 0..64"),
    ],
)
def test_bad_training_settings_are_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        JobConfig(**kwargs)  # type: ignore[arg-type]


# -- a job whose tasks run on hosts of their own (`shoal chaos run --hosts`) ----------------


@pytest.fixture
def hosts_job(tmp_path: Path) -> ClusterJob:
    """A job whose nodes share no run directory: checkpoints in the cluster's storage, each
    task's files in its node's job directory (nodes/<node>/jobs/<job>)."""
    job = ClusterJob(
        JobConfig(gpus_per_rank=1, spread=True),
        tmp_path,
        time_limit_s=60.0,
        storage=tmp_path / "storage",
        tls_dir=tmp_path / "tls",
    )
    job.run_dir.mkdir()
    write_events(job, [{"time": 1.0, "event": "submitted", "job": "train-2"}])
    return job


def node_dir(job: ClusterJob, node: str) -> Path:
    directory = job.cluster_dir / "nodes" / node / "jobs" / "train-2"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def append(directory: Path, *events: dict[str, object]) -> None:
    with (directory / "events.jsonl").open("a") as handle:
        for event in events:
            handle.write(json.dumps(event) + "\n")


def test_a_job_across_hosts_checkpoints_to_storage_and_asks_for_its_resources(
    hosts_job: ClusterJob, tmp_path: Path
) -> None:
    argv = hosts_job._argv(["https://10.1.2.1:7000"], tmp_path / "api-token")
    storage = str(tmp_path / "storage" / "train" / "checkpoints")
    assert argv[argv.index("--checkpoint-storage") + 1] == storage
    assert argv[argv.index("--gpus-per-rank") + 1] == "1"
    assert hosts_job.checkpoints == Path(storage)
    env = hosts_job.environment(host_cpus=2.0)
    assert env["SHOAL_ROLLOUT_CPUS_PER_WORKER"] == "1.200"  # two never fit on one host
    assert env["SHOAL_TLS_DIR"] == str(tmp_path / "tls")
    with pytest.raises(FaultError, match="spread needs the hosts' CPU counts"):
        hosts_job.environment(host_cpus=None)
    shared = ClusterJob(JobConfig(), tmp_path / "one-host", time_limit_s=60.0)
    assert "--checkpoint-storage" not in shared._argv(["http://127.0.0.1:1"], tmp_path / "t")
    assert "SHOAL_ROLLOUT_CPUS_PER_WORKER" not in shared.environment(None)


def test_what_the_tasks_wrote_is_gathered_from_every_host(hosts_job: ClusterJob) -> None:
    """Events merge in the order of their times; rank 0's status is the newest one written
    (a group that moved host left its old status behind)."""
    old, new = node_dir(hosts_job, "n1"), node_dir(hosts_job, "n2")
    append(old, {"time": 2.0, "event": "start", "process": "learner", "rank": 0, "pid": 1})
    append(new, {"time": 4.0, "event": "start", "process": "learner", "rank": 0, "pid": 2})
    append(old, {"time": 3.0, "event": "checkpoint", "step": 5}, {"time": "bad", "event": "x"})
    (old / "status-0.json").write_text(json.dumps({"version": 3, "incarnation": "a"}))
    (new / "status-0.json").write_text(json.dumps({"version": 9, "incarnation": "b"}))
    os.utime(old / "status-0.json", (1.0, 1.0))
    assert hosts_job.output_dirs() == [hosts_job.run_dir, old, new]
    events = [(e.get("event"), e.get("pid") or e.get("step")) for e in hosts_job.events()]
    assert events == [
        ("x", None),
        ("submitted", None),
        ("start", 1),
        ("checkpoint", 5),
        ("start", 2),
    ]
    sample = hosts_job.sample(1.0, 0)
    assert sample is not None
    assert (sample.version, sample.incarnation) == (9, "b")


@pytest.mark.timeout(30)
def test_a_task_on_a_host_is_known_by_its_job_directory(
    hosts_job: ClusterJob, procs: list[subprocess.Popen[bytes]]
) -> None:
    """No run directory on its command line: the node gave it this job's directory."""
    ours = node_dir(hosts_job, "n2")
    learner = ["shoal.learner.learner_main:main", "--job", "{}"]
    rank0 = sleeper_in(ours, *learner)
    joining = sleeper_in(ours, *learner)  # started, not yet announced
    stranger = sleeper_in(hosts_job.cluster_dir / "nodes" / "n2" / "jobs" / "other", *learner)
    procs += [rank0, joining, stranger]
    append(ours, {"time": 2.0, "event": "start", "process": "learner", "rank": 0, "pid": rank0.pid})
    append(
        ours, {"time": 3.0, "event": "start", "process": "learner", "rank": 1, "pid": stranger.pid}
    )
    assert hosts_job.learner_pid(0) == rank0.pid
    with pytest.raises(FaultError, match="learner rank 1"):
        hosts_job.learner_pid(1)
    assert hosts_job.live_learners() == sorted([rank0.pid, joining.pid])


def sleeper_in(job_dir: Path, *argv: str) -> subprocess.Popen[bytes]:
    """A task process as a node starts it: its job directory in SHOAL_JOB_DIR."""
    env = {**os.environ, "SHOAL_JOB_DIR": str(job_dir)}
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *argv], env=env)


def test_stored_checkpoints_only_move_forward(hosts_job: ClusterJob) -> None:
    import torch

    from shoal.learner.checkpoint import CheckpointManager

    assert hosts_job.newest_checkpoint() == 0
    with CheckpointManager(hosts_job.checkpoints) as manager:
        for step in (3, 7):
            manager.save({"w": torch.full((1,), float(step))}, step, {}, block=True)
    assert hosts_job.newest_checkpoint() == 7
    append(node_dir(hosts_job, "n1"), {"time": 2.0, "event": "checkpoint", "step": 7})
    verdict = hosts_job.checkpoints_forward([0, 3, 7])
    assert verdict.held, verdict.detail
    assert str(hosts_job.checkpoints) in verdict.detail
    assert not hosts_job.checkpoints_forward([0, 7, 3]).held
    append(node_dir(hosts_job, "n2"), {"time": 3.0, "event": "checkpoint", "step": 9})
    lost = hosts_job.checkpoints_forward([0, 3, 7])
    assert not lost.held
    assert "acknowledged checkpoint step 9 lost" in lost.detail
