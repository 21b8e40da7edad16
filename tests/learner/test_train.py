"""`shoal train` end to end with no cluster up: an embedded coordinator and node daemon, the
learner and rollout processes they run on 127.0.0.1, then the report; nothing left behind.

The runs are tiny (a low target return) so they finish in seconds; they still cross every
process boundary a full run does.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from shoal.cli import main
from tests.support.processes import child_process
from tests.support.waiting import eventually


def _events(run_dir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def _assert_all_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _naming(run_dir: Path) -> list[int]:
    """Live processes whose command line names `run_dir`: the embedded cluster and its tasks."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(run_dir.resolve()) in cmdline and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def _port_closed(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


@pytest.mark.timeout(180)
def test_train_cli_reaches_a_small_target_and_cleans_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHOAL_EVAL_EPISODES", "2")
    run_dir = tmp_path / "run"
    argv = ["train", "cartpole", "--json", "--quiet", "--target-return", "40"]
    argv += ["--time-limit", "120", "--run-dir", str(run_dir)]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert summary["solved"] is True
    assert summary["stopped_by"] == "target"
    assert summary["final_return"] >= 40
    assert summary["env_steps"] > 0
    assert summary["wall_s"] > 0
    assert 0 < summary["startup_s"] <= summary["solve_s"]
    assert Path(summary["checkpoint"]).is_dir()  # a DCP checkpoint directory
    assert Path(summary["report"]).is_file()
    assert Path(summary["report_html"]).is_file()
    assert f"checkpoint: {summary['checkpoint']}" in out
    # The job's transport token travels in its tasks' records, never in a file of the run.
    assert not (run_dir / "cluster.token").exists()
    assert "SHOAL_JOB_TOKEN" not in (run_dir / "job.json").read_text()
    # It ran as a job on an embedded cluster in the run directory, logs and all.
    cluster = summary["cluster"]
    assert cluster["embedded"] is True
    assert any(line.startswith("logs:") for line in out)
    job = summary["job_id"]
    assert (run_dir / "logs" / "c1.log").is_file()
    assert (run_dir / "logs" / "n1.log").is_file()
    tasks = Path(cluster["task_logs"][0])
    assert (tasks / f"{job}-learner-0.g1.log").is_file()
    assert (tasks / f"{job}-rollout-0.g1.log").is_file()
    assert _naming(run_dir) == []
    assert all(_port_closed(url) for url in cluster["coordinators"])
    intake = summary["intake"]
    assert intake["received"] == (
        intake["trained"] + intake["dropped_stale"] + intake["duplicates"] + intake["queued"]
    )
    starts = [e for e in _events(run_dir) if e["event"] == "start"]
    assert {e["process"] for e in starts} == {"learner", "rollout"}
    _assert_all_gone([int(e["pid"]) for e in starts])  # type: ignore[call-overload]
    assert list((run_dir / "pids").iterdir()) == []

    # shoal eval on the same run: the newest complete checkpoint, a fresh report
    out_dir = tmp_path / "eval"
    assert main(["eval", str(run_dir), "--episodes", "3", "--out", str(out_dir), "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert evaluated["env_id"] == "CartPole-v1"
    assert evaluated["checkpoint"] == summary["checkpoint"]
    assert Path(evaluated["report"]).parent == out_dir
    assert Path(evaluated["report_html"]).is_file()
    assert evaluated["mean_return"] > 0


@pytest.mark.timeout(60)
def test_eval_cli_reads_a_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", str(tmp_path)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


def test_unknown_environment_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["train", "NoSuchEnv-v1", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("shoal: error: no environment 'NoSuchEnv-v1'")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('env_id = "CartPole-v1"\nbogus = 1\n', "unknown key(s) bogus"),
        ('[rollout]\nnum_envs = "many"\n', "rollout.num_envs = 'many' is invalid"),
        ("[intake]\ncapacity = 1\nfragments_per_update = 2\n", "[intake] intake.fragments_per"),
        ("[ppo]\nlr = -1.0\n", "ppo.lr = -1.0 is invalid"),
        ("time_limit_s = \n", "not valid TOML"),
    ],
)
def test_bad_job_files_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    job = tmp_path / "job.toml"
    job.write_text(text)
    assert main(["train", str(job), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert message in err
    assert str(job) in err


def test_bad_flag_values_are_config_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "cartpole", "--workers", "0"]) == 2
    assert "rollout.workers = 0 is invalid" in capsys.readouterr().err


def test_more_ranks_than_rollout_actors_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "r"
    assert (
        main(["train", "cartpole", "--ranks", "2", "--workers", "1", "--run-dir", str(run_dir)])
        == 2
    )
    assert "learner.ranks = 2 is invalid with 1 rollout actor(s)" in capsys.readouterr().err
    assert not run_dir.exists()


def test_environment_overrides_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.cli import build_parser
    from shoal.commands.train import build_config

    monkeypatch.setenv("SHOAL_PPO_LR", "0.001")
    monkeypatch.setenv("SHOAL_ROLLOUT_HORIZON", "8")
    args = build_parser().parse_args(["train", "acrobot", "--envs", "4", "--seed", "3"])
    cfg = build_config(args)
    assert cfg.env_id == "acrobot"
    assert cfg.ppo.lr == 0.001
    assert cfg.ppo.num_minibatches == 2  # the job's tuned default survives a partial override
    assert (cfg.rollout.horizon, cfg.rollout.num_envs, cfg.seed) == (8, 4, 3)


@pytest.mark.timeout(180)
def test_sigterm_to_shoal_train_stops_every_process_and_keeps_a_checkpoint(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "shoal", "train", "cartpole", "--quiet", "--no-eval"]
    argv += ["--time-limit", "150", "--target-return", "1000", "--run-dir", str(run_dir)]
    with child_process(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        status = run_dir / "status-0.json"

        def trained() -> bool:
            if status.exists() and json.loads(status.read_text())["version"] >= 2:
                return True
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            return False

        eventually(trained, "two policy versions", 120)
        proc.send_signal(15)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert b"not solved (interrupted)" in out
    events = _events(run_dir)
    starts = [e for e in events if e["event"] == "start"]
    _assert_all_gone([int(e["pid"]) for e in starts])  # type: ignore[call-overload]
    stop = [e for e in events if e["event"] == "stop"]
    assert len(stop) == 1
    assert (run_dir / "checkpoints" / f"ckpt-{int(stop[0]['step']):012d}.json").is_file()  # type: ignore[call-overload]
    assert _naming(run_dir) == []


@pytest.mark.timeout(180)
def test_sigkill_to_shoal_train_takes_its_embedded_cluster_and_tasks_down(
    tmp_path: Path,
) -> None:
    """No orderly stop is possible, yet nothing outlives it: the coordinator and node get
    SIGTERM from the kernel (PDEATHSIG), the node's tasks likewise when the node exits."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "shoal", "train", "cartpole", "--quiet", "--no-eval"]
    argv += ["--time-limit", "150", "--target-return", "1000", "--run-dir", str(run_dir)]
    try:
        with child_process(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
            status = run_dir / "status-0.json"

            def started() -> bool:
                assert proc.poll() is None
                return status.exists()

            eventually(started, "the learner's status file", 120)
            assert len(_naming(run_dir)) >= 4  # coordinator, node, learner, rollout worker
            proc.kill()
            proc.wait()
            eventually(lambda: _naming(run_dir) == [], "no process naming the run left", 60)
    finally:
        for pid in _naming(run_dir):
            os.kill(pid, 9)


@pytest.mark.timeout(180)
def test_a_dead_embedded_node_ends_the_run_with_its_log(tmp_path: Path) -> None:
    from dataclasses import replace

    from shoal.cluster_train import ClusterRun
    from shoal.learner.config import TrainConfig
    from shoal.train import TrainError, train

    run_dir = tmp_path / "run"
    cfg = replace(TrainConfig(), target_return=1e9, time_limit_s=120.0)

    def kill_the_node(run: ClusterRun) -> None:
        pid = run.embedded.pid("n1") if run.embedded is not None else None
        if run.status.version() >= 1 and pid is not None:
            os.kill(pid, 9)

    with pytest.raises(TrainError, match=r"n1 of the embedded cluster exited; see .*n1\.log"):
        train(cfg, run_dir=run_dir, on_poll=kill_the_node, evaluate_at_end=False)
    assert _naming(run_dir) == []


@pytest.mark.timeout(180)
def test_past_max_restarts_the_job_fails_and_the_run_ends_with_its_message(
    tmp_path: Path,
) -> None:
    """`max_restarts` travels in the job spec: with 0, the leader restarts nothing, fails the
    job at the first SIGKILLed rank, and the run ends with the job's message."""
    import signal
    from dataclasses import replace

    from shoal.cluster_train import ClusterRun
    from shoal.learner.config import TrainConfig
    from shoal.train import TrainError, train

    run_dir = tmp_path / "run"
    cfg = replace(TrainConfig(), target_return=1e9, time_limit_s=120.0)
    killed: list[int] = []

    def kill_the_learner(run: ClusterRun) -> None:
        pid = run.status.statuses.get(0, {}).get("pid")
        if not killed and run.status.version() >= 1 and pid is not None:
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)

    with pytest.raises(TrainError, match=r"job train-\w+ failed: .*SIGKILL"):
        train(cfg, run_dir=run_dir, on_poll=kill_the_learner, evaluate_at_end=False, max_restarts=0)
    assert killed
    spec = json.loads((run_dir / "cluster.json").read_text())
    assert {p["name"] for p in spec["processes"]} == {"c1", "n1"}
    assert _naming(run_dir) == []
