"""The pure parts of a cluster run: the job's task records, the job_metrics fields, and the
clear errors for a bad coordinator entry, bad flags or no cluster where one was named."""

from __future__ import annotations

import asyncio
import json
import math
import socket
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.cli import main
from shoal.cluster_train import (
    LEARNER_ENTRY,
    ROLLOUT_ENTRY,
    Coordinators,
    find_cluster,
    job_tasks,
    started_pids,
)
from shoal.errors import ConfigError
from shoal.learner.errors import LearnerError
from shoal.learner.job_metrics import MetricsTarget, loss_name, metrics_fields, post_once
from shoal.raft.model import LEARNER_KIND, ROLLOUT_KIND

words = st.lists(st.text("abc-_0123", min_size=1, max_size=6), max_size=4)
envs = st.dictionaries(st.sampled_from(["SHOAL_GROUP_RANK", "A", "B"]), st.text(max_size=4))


@given(
    learners=st.lists(st.tuples(words, envs), min_size=1, max_size=4),
    rollouts=st.lists(st.tuples(words, envs), max_size=5),
    gpus=st.integers(0, 16),
)
def test_job_tasks_one_process_task_per_rank_and_worker(
    learners: list[tuple[list[str], dict[str, str]]],
    rollouts: list[tuple[list[str], dict[str, str]]],
    gpus: int,
) -> None:
    tasks = job_tasks("job-1", learners, rollouts, {"cpus": 1.0, "gpus": gpus}, {"cpus": 0.5})
    assert len(tasks) == len(learners) + len(rollouts)
    assert len({t["task_id"] for t in tasks}) == len(tasks)
    ranks, workers = tasks[: len(learners)], tasks[len(learners) :]
    for rank, (task, (argv, env)) in enumerate(zip(ranks, learners, strict=True)):
        assert task == {
            "task_id": f"job-1-learner-{rank}",
            "kind": LEARNER_KIND,
            "actor": LEARNER_ENTRY,
            "args": {"argv": argv, "env": env},
            "resources": {"cpus": 1.0, "gpus": gpus},
        }
    for w, (task, (argv, env)) in enumerate(zip(workers, rollouts, strict=True)):
        assert task["task_id"] == f"job-1-rollout-{w}"
        assert task["kind"] == ROLLOUT_KIND
        assert task["actor"] == ROLLOUT_ENTRY
        assert task["args"] == {"argv": argv, "env": env}
        assert task["resources"] == {"cpus": 0.5}
    json.dumps(tasks)  # the records travel as JSON


numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5), st.none())


@given(
    version=st.integers(0, 10**6),
    returns=st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=30),
    sps=numbers,
    lag=numbers,
    metrics=st.dictionaries(st.sampled_from(["loss", "policy_loss", "value_loss", "kl"]), numbers),
    window=st.integers(1, 20),
)
def test_metrics_fields_are_finite_numbers_the_dashboard_plots(
    version: int,
    returns: list[float],
    sps: Any,
    lag: Any,
    metrics: dict[str, Any],
    window: int,
) -> None:
    status = {
        "version": version,
        "returns": returns,
        "sps": sps,
        "policy_lag_median": lag,
        "metrics": metrics,
    }
    fields = metrics_fields("j", status, window)
    assert fields["job"] == "j"
    assert fields["step"] == version
    numeric = {k: v for k, v in fields.items() if k not in ("job", "step")}
    assert all(isinstance(v, float) and math.isfinite(v) for v in numeric.values())
    assert set(numeric) <= {
        "return",
        "sps",
        "policy_lag",
        "loss_total",
        "loss_policy",
        "loss_value",
    }
    finite = [r for r in returns[-window:] if math.isfinite(r)]
    assert ("return" in fields) == bool(finite)
    if finite:
        assert fields["return"] == pytest.approx(sum(r / len(finite) for r in finite))


def test_loss_names() -> None:
    assert loss_name("loss") == "loss_total"
    assert loss_name("policy_loss") == "loss_policy"
    assert loss_name("loss_aux") == "loss_aux"
    assert loss_name("approx_kl") is None


def test_metrics_target_rejects_a_bad_entry(tmp_path: Path) -> None:
    with pytest.raises(LearnerError, match="needs urls, token_file and job"):
        MetricsTarget.from_job({"urls": ["http://127.0.0.1:1"]})
    with pytest.raises(LearnerError, match="cannot read the coordinator token file"):
        MetricsTarget.from_job({"urls": ["x"], "token_file": str(tmp_path / "no"), "job": "j"})
    token = tmp_path / "t"
    token.write_text("secret\n")
    with pytest.raises(LearnerError, match="no urls"):
        MetricsTarget.from_job({"urls": [], "token_file": str(token), "job": "j"})
    target = MetricsTarget.from_job({"urls": ["http://a"], "token_file": str(token), "job": "j"})
    assert target.token == "secret"


def test_coordinators_validate(tmp_path: Path) -> None:
    token = tmp_path / "t"
    token.write_text("x")
    with pytest.raises(ConfigError, match="http"):
        Coordinators(["127.0.0.1:80"], token)
    with pytest.raises(ConfigError, match="api-token"):
        Coordinators(["http://127.0.0.1:80"], tmp_path / "missing")
    assert Coordinators(["http://127.0.0.1:80"], token).to_job()["token_file"] == str(token)


def test_no_cluster_where_none_runs(tmp_path: Path) -> None:
    assert find_cluster(tmp_path) is None
    (tmp_path / "cluster.json").write_text(
        json.dumps(
            {
                "processes": [
                    {
                        "name": "c1",
                        "argv": ["x"],
                        "kind": "coordinator",
                        "health_url": None,
                        "api_url": "http://127.0.0.1:1",
                    }
                ]
            }
        )
    )
    assert find_cluster(tmp_path) is None  # described, but no replica runs


def test_cli_cluster_flags_fail_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "cartpole", "--cluster", str(tmp_path)]) == 2
    assert "no running cluster there" in capsys.readouterr().err
    assert main(["train", "cartpole", "--coordinators", "http://127.0.0.1:1"]) == 2
    assert "--token-file" in capsys.readouterr().err
    token = tmp_path / "t"
    token.write_text("x")
    assert main(["train", "cartpole", "--token-file", str(token)]) == 2
    assert "goes with --coordinators" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_unreachable_coordinators_are_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, never listening
        token = tmp_path / "t"
        token.write_text("x")
        argv = ["train", "cartpole", "--coordinators", url, "--token-file", str(token)]
        argv += ["--run-dir", str(tmp_path / "r"), "--quiet"]
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert "refused or did not answer" in err


starts = st.lists(
    st.one_of(
        st.builds(lambda p: {"event": "start", "process": "learner", "pid": p}, st.integers(1, 99)),
        st.builds(lambda j: {"event": "submitted", "job": j}, st.sampled_from(["a", "b"])),
        st.just({"event": "checkpoint", "step": 1}),
    ),
    max_size=20,
)


@given(events=starts, noise=st.lists(st.text(max_size=5), max_size=3))
def test_started_pids_are_those_after_the_latest_submission_of_the_job(
    events: list[dict[str, Any]], noise: list[str]
) -> None:
    lines = [json.dumps(e) for e in events] + noise
    marks = [i for i, e in enumerate(events) if e["event"] == "submitted"]
    expected: set[int] = set()
    if marks and events[marks[-1]]["job"] == "a":
        expected = {e["pid"] for e in events[marks[-1] :] if e["event"] == "start"}
    assert started_pids(lines, "a") == expected


@pytest.mark.timeout(30)
def test_a_post_to_an_unreachable_coordinator_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, never listening: the connection is refused
        target = MetricsTarget("j", [f"http://127.0.0.1:{sock.getsockname()[1]}"], "token")
        status = {"version": 3, "returns": [1.0], "sps": 5.0, "metrics": {"loss": 0.5}}
        asyncio.run(post_once(target, status, 10))
    assert "could not post job_metrics" in caplog.text
