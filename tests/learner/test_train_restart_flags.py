"""`shoal train --max-restarts N --restart-window S`: validated before anything starts, and
carried into the job's `spec.restart` (with 0 the first killed rank fails the job, and the
run ends naming the window it was given)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.cli import main
from shoal.cluster_train import RestartPolicy
from shoal.errors import ConfigError
from tests.support.processes import child_process, eventually_while_running


@given(st.integers(0, 1_000_000), st.floats(0.001, 1e9))
def test_a_valid_policy_becomes_the_job_spec_restart(count: int, window: float) -> None:
    assert RestartPolicy(count, window).to_spec() == {"max_restarts": count, "window_s": window}


@pytest.mark.parametrize(
    ("count", "window", "flag"),
    [
        (-1, 600.0, "--max-restarts"),
        (1_000_001, 600.0, "--max-restarts"),
        (True, 600.0, "--max-restarts"),
        (5, 0.0, "--restart-window"),
        (5, -3.0, "--restart-window"),
        (5, float("inf"), "--restart-window"),
        (5, float("nan"), "--restart-window"),
    ],
)
def test_a_bad_policy_is_refused_naming_its_flag(count: int, window: float, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        RestartPolicy(count, window)


@pytest.mark.parametrize(
    ("extra", "flag"),
    [(["--max-restarts", "-2"], "--max-restarts"), (["--restart-window", "0"], "--restart-window")],
)
def test_the_cli_refuses_bad_values_in_one_line_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], flag: str
) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", "cartpole", "--run-dir", str(run_dir), "--quiet", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert flag in err
    assert len(err.splitlines()) == 1
    assert not (run_dir / "logs").exists()


def test_the_pipeline_refuses_the_restart_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "cartpole", "--pipeline", "--max-restarts", "1"]) == 2
    assert "--max-restarts does not apply to --pipeline" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_max_restarts_zero_fails_the_job_at_the_first_killed_rank(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [
        sys.executable, "-m", "shoal", "train", "cartpole", "--run-dir", str(run_dir),
        "--workers", "1", "--time-limit", "150", "--target-return", "100000", "--quiet",
        "--no-eval", "--max-restarts", "0", "--restart-window", "30",
    ]  # fmt: skip
    with child_process(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:

        def learner_pid() -> int | None:
            events = run_dir / "events.jsonl"
            lines = events.read_text().splitlines() if events.exists() else []
            starts = [json.loads(line) for line in lines if '"process": "learner"' in line]
            return next((e["pid"] for e in starts if e.get("event") == "start"), None)

        pid = eventually_while_running(proc, learner_pid, "the learner started", 120)
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-2000:]
    assert "gave up after 0 restarts in 30 s" in err
