"""Training across hosts that share nothing but a network: each node daemon in a network
namespace of its own (`shoal up --hosts`), tasks meeting through the coordinators' task state,
checkpoints in the cluster's storage. Real processes, real TLS, real signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shoal.local import LocalCluster
from shoal.raft.client import CoordinatorClient
from tests.support.netns import netns_cluster
from tests.support.waiting import eventually

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

FAST_LIVENESS = """\
[liveness]
suspect_after = 1.5
dead_after = 4.0
"""
PATIENT_S = 240.0
"""How long a step of these runs may take on a loaded 2-core machine (a failure detector)."""


def _ask(local: LocalCluster, fn: Callable[[CoordinatorClient], Any]) -> Any:
    async def go() -> Any:
        async with CoordinatorClient(local.api_urls(), local.token, timeout=10.0) as client:
            return await fn(client)

    return asyncio.run(go())


def _job(local: LocalCluster) -> dict[str, Any] | None:
    jobs = _ask(local, lambda c: c.request("GET", "/v1/jobs"))["jobs"]
    train = [j for j in jobs if str(j.get("id", "")).startswith("train-")]
    if not train:
        return None
    return dict(_ask(local, lambda c: c.job(train[0]["id"])))


def _tasks(job: dict[str, Any] | None, kind: str) -> list[dict[str, Any]]:
    return [t for t in (job or {}).get("tasks", []) if f"-{kind}-" in t["id"]]


def _train(local: LocalCluster, run_dir: Path, *argv: str) -> subprocess.Popen[str]:
    env = {**os.environ, "SHOAL_TLS_DIR": str(local.run_dir / "tls")}
    return subprocess.Popen(
        [sys.executable, "-m", "shoal", "train", *argv, "--cluster", str(local.run_dir),
         "--run-dir", str(run_dir), "--json", "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def _finish(proc: subprocess.Popen[str]) -> tuple[int, dict[str, Any] | None, str]:
    out, err = proc.communicate(timeout=PATIENT_S)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return proc.returncode, json.loads(lines[-1]) if lines else None, err


@pytest.fixture
def two_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalCluster]:
    config = tmp_path / "coordinator.toml"
    config.write_text(FAST_LIVENESS)
    with netns_cluster(
        tmp_path, hosts=2, sim_gpus=2, island_size=2, coordinator_args=("--config", str(config))
    ) as local:
        monkeypatch.setenv("SHOAL_TLS_DIR", str(local.run_dir / "tls"))  # the API is https
        yield local


def test_a_job_spans_two_hosts_on_the_gpus_it_asked_for(
    two_hosts: LocalCluster, tmp_path: Path
) -> None:
    """The learner on one host, both rollout workers on the other (each asks for most of a
    host's CPUs), the rank on the GPU its placement chose; it trains to its target."""
    local = two_hosts
    cpus = min(float(n["resources"]["cpus"]) for n in _nodes(local))
    job = tmp_path / "job.toml"
    job.write_text(
        f'env_id = "CartPole-v1"\ntarget_return = 120\ntime_limit_s = {PATIENT_S}\n'
        f"[learner]\ngpus_per_rank = 1\ncpus_per_rank = {cpus * 0.75}\n"
        f"[rollout]\nworkers = 2\ncpus_per_worker = {cpus * 0.375}\n"
    )
    run_dir = tmp_path / "train"
    proc = _train(local, run_dir, str(job))
    try:
        code, summary, err = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, err
    assert summary is not None
    assert summary["solved"], summary
    record = _ask(local, lambda c: c.job(summary["job_id"]))
    (learner,) = _tasks(record, "learner")
    workers = _tasks(record, "rollout")
    assert len(learner["gpus"]) == 1
    assert learner["published"]["gpus"] == str(learner["gpus"][0])  # the GPU its node gave it
    assert {w["node"] for w in workers} == {"n1", "n2"} - {learner["node"]}
    assert learner["published"]["final"] is True
    storage = json.loads((local.run_dir / "cluster.json").read_text())["storage"]
    assert summary["checkpoint"].startswith(storage)  # not the run dir: no host shares it
    assert not (run_dir / "status-0.json").exists()  # each task wrote on its own host
    events = _ask(local, lambda c: c.request("GET", "/v1/events"))["events"]
    posted = [
        e
        for e in events
        if e["kind"] == "evaluation" and e["fields"].get("job") == summary["job_id"]
    ]
    assert posted[-1]["fields"]["report"] == summary["report_html"]
    node_dir = local.run_dir / "data" / learner["node"] / "jobs" / summary["job_id"]
    assert (node_dir / "status-0.json").exists()


def _nodes(local: LocalCluster) -> list[dict[str, Any]]:
    return list(_ask(local, lambda c: c.request("GET", "/v1/nodes"))["nodes"])


def _kill_host(local: LocalCluster, node: str) -> None:
    """Everything on the host dies at once: every process in its namespace gets SIGKILL."""
    from shoal import hosts

    network = local.network()
    assert network is not None
    pids = hosts.pids(network, node)
    assert pids, f"nothing runs on {node}'s host"
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_group_whose_host_dies_resumes_on_the_other_host_from_its_checkpoint(
    two_hosts: LocalCluster, tmp_path: Path
) -> None:
    """Two ranks on one host (one island of 2 GPUs), checkpoints every second into the
    cluster's storage; that host is killed with everything on it. The leader starts the group
    on the other host, where the ranks meet at rank 0's new address and resume from the
    newest checkpoint the dead host wrote."""
    local = two_hosts
    run_dir = tmp_path / "train"
    proc = _train(
        local, run_dir, "cartpole", "--ranks", "2", "--workers", "2", "--gpus-per-rank", "1",
        "--checkpoint-interval", "1", "--target-return", "100000", "--time-limit",
        str(3 * PATIENT_S),
    )  # fmt: skip  # a target it cannot reach: the run must outlive the move; the test stops it
    try:

        def checkpointed() -> dict[str, Any] | None:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            job = _job(local)
            lead = _tasks(job, "learner")
            published = lead[0].get("published") or {} if lead else {}
            return job if published.get("checkpoint_step") else None

        job = eventually(checkpointed, "rank 0 to publish a checkpoint", PATIENT_S)
        ranks = _tasks(job, "learner")
        (dead,) = {r["node"] for r in ranks}  # one gang, one island: one host
        written = ranks[0]["published"]["checkpoint_step"]
        _kill_host(local, dead)

        def moved() -> list[dict[str, Any]] | None:
            moved = _tasks(_job(local), "learner")
            running = [r for r in moved if r["node"] != dead and r["state"] == "running"]
            resumed = [r for r in running if (r.get("published") or {}).get("version", 0) > 0]
            return moved if len(running) == 2 and resumed else None

        now = eventually(moved, "the group to train again on the other host", PATIENT_S)
        assert {r["node"] for r in now} == {"n1", "n2"} - {dead}
        assert all(len(r["gpus"]) == 1 for r in now)
        events = local.run_dir / "data" / now[0]["node"] / "jobs" / job["id"] / "events.jsonl"
        starts = [json.loads(x) for x in events.read_text().splitlines() if '"start"' in x]
        resumed = [e for e in starts if e.get("process") == "learner" and e.get("rank") == 0]
        assert resumed[-1]["resumed_from"] is not None
        assert resumed[-1]["step"] >= written  # forward only: from a checkpoint the dead host wrote
        proc.send_signal(signal.SIGINT)  # Ctrl-C: an orderly stop with a final checkpoint
        code, summary, err = _finish(proc)
        assert code == 1, err  # stopped before its target, as asked
        assert summary is not None
        assert summary["stopped_by"] == "interrupted", summary
        assert summary["checkpoint_step"] >= resumed[-1]["step"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_group_that_fits_no_island_is_refused_with_the_reason(
    two_hosts: LocalCluster, tmp_path: Path
) -> None:
    proc = _train(
        two_hosts,
        tmp_path / "train",
        "cartpole",
        "--ranks",
        "2",
        "--workers",
        "2",
        "--gpus-per-rank",
        "4",
    )
    code, summary, err = _finish(proc)
    assert code == 2
    assert summary is None
    assert "cannot place task" in err
    assert "gpus" in err.lower() or "gpu" in err.lower()


def test_a_job_submitted_through_the_api_alone_trains_across_hosts(two_hosts: LocalCluster) -> None:
    """No `shoal train` process: the task records (learner/job.py's arguments, a token in the
    environment) are all a node on any host needs; rank 0's final checkpoint lands in the
    cluster's storage and its last publication names it."""
    from shoal.cluster_train import job_tasks
    from shoal.learner.config import CheckpointConfig, LearnerConfig, RolloutConfig, TrainConfig
    from shoal.learner.group import GroupSpec
    from shoal.learner.job import TOKEN_VARIABLE, job_argument

    local = two_hosts
    storage = json.loads((local.run_dir / "cluster.json").read_text())["storage"]
    cfg = TrainConfig(
        learner=LearnerConfig(ranks=2),
        rollout=RolloutConfig(workers=2),
        checkpoint=CheckpointConfig(storage=f"{storage}/api-job"),
    )
    argv = job_argument(cfg, "CartPole-v1")
    env = {TOKEN_VARIABLE: "t" * 64, "OMP_NUM_THREADS": "1"}
    learners = [(argv, {**env, **GroupSpec(r, 2, backend="gloo").to_env()}) for r in range(2)]
    rollouts = [([*argv, "--worker", str(w)], env) for w in range(2)]
    tasks = job_tasks("api-job", learners, rollouts, {"gpus": 1}, {})
    spec = {"placement": "auto", "kind": "train"}
    _ask(local, lambda c: c.submit_job(spec=spec, tasks=tasks, job_id="api-job"))

    def trained() -> bool:
        lead = _tasks(_ask(local, lambda c: c.job("api-job")), "learner")[0]
        return int((lead.get("published") or {}).get("version", 0)) >= 3

    eventually(trained, "rank 0 to publish version 3", PATIENT_S)
    _ask(local, lambda c: c.stop_job("api-job"))

    def final() -> dict[str, Any] | None:
        lead = _tasks(_ask(local, lambda c: c.job("api-job")), "learner")[0]
        published = lead.get("published") or {}
        return published if published.get("final") else None

    last = eventually(final, "rank 0's final publication", PATIENT_S)
    assert Path(last["checkpoint"]).parent == Path(storage) / "api-job"
    assert Path(last["checkpoint"]).is_dir()  # a DCP checkpoint directory
    assert last["checkpoint_step"] >= 3
