"""A job whose rollout workers cannot send a fragment ends, as a real `shoal train` process
(embedded cluster), in one line on stderr naming the sizes and the fix, with exit status 2,
and leaves no process behind; the coordinator never restarts the worker into the same error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.cluster_train import _published_error
from shoal.job_watch import started_pids
from tests.support.processes import child_process, running

pytestmark = pytest.mark.timeout(300)

JOB = """\
env_id = "GridWorld-v1"
env_kwargs = { size = 64 }
time_limit_s = 150
[rollout]
num_envs = 4096
"""
"""4096 copies of a 64x64 GridWorld: 81,958 bytes per environment and step, 320 MiB for a
one-step fragment, over the transport's 256 MiB frame limit."""


def test_a_fragment_that_cannot_fit_ends_shoal_train_with_the_reason(tmp_path: Path) -> None:
    job, run_dir = tmp_path / "job.toml", tmp_path / "run"
    job.write_text(JOB)
    env = {
        **os.environ,
        "SHOAL_HOME": str(tmp_path / "home"),
        "SHOAL_RUN_DIR": str(tmp_path / "cluster"),
        "OMP_NUM_THREADS": "1",
    }
    shoal = Path(sys.executable).with_name("shoal")
    argv = [str(shoal), "train", str(job), "--embedded", "--run-dir", str(run_dir)]
    argv += ["--quiet", "--no-eval"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    with child_process(argv, env=env, stdin=subprocess.DEVNULL, **pipes) as process:
        _, err = process.communicate(timeout=240)
    assert process.returncode == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("shoal: error: task "), line
    assert "-rollout-0 cannot go on: rollout-0-0: one step of 4096 environment(s)" in line
    assert "shape [20481] is 320.2 MiB" in line
    assert "frame limit of 256.0 MiB (max_frame_bytes)" in line
    assert "at most 3274 environments per actor (--envs, rollout.num_envs)" in line

    events = [
        json.loads(e) for e in (run_dir / "events.jsonl").read_text().splitlines() if e.strip()
    ]
    job_id = next(e["job"] for e in events if e.get("event") == "submitted")
    lines_ = (run_dir / "events.jsonl").read_text().splitlines()
    pids = started_pids(lines_, job_id)
    rollouts = [e for e in events if e.get("event") == "start" and e.get("process") == "rollout"]
    assert len(rollouts) == 1, "the worker was restarted into the same error"
    assert pids, "no task announced its start"
    assert not [pid for pid in pids if running(pid)], "a task outlived the run"
    assert list((run_dir / "pids").iterdir()) == [], "the embedded cluster outlived the run"


@pytest.mark.parametrize(
    ("task", "error"),
    [
        (
            {"published": {"role": "rollout", "error": "rollout-0-0: too big"}},
            "rollout-0-0: too big",
        ),
        ({"published": {"role": "rollout", "horizon": 20}}, None),
        ({"published": {"error": ""}}, None),
        ({"published": {"error": 3}}, None),
        ({"published": ["error"]}, None),
        ({}, None),
    ],
)
def test_only_a_published_error_text_ends_the_run(
    task: dict[str, object], error: str | None
) -> None:
    assert _published_error(task) == error
