"""A job resumes its sharded checkpoint at another world size: 2 FSDP2 ranks → 1 rank → 2 ranks.

Real `shoal train` runs (an embedded cluster each time) on one run directory; each run trains
past the previous one's steps, so every resume must have loaded the previous run's checkpoint,
whatever number of ranks wrote it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def train(run_dir: Path, ranks: int, max_steps: int) -> dict[str, Any]:
    argv = [
        sys.executable, "-m", "shoal", "train", "cartpole", "--embedded", "--run-dir",
        str(run_dir), "--ranks", str(ranks), "--workers", "2", "--sharding", "fsdp",
        "--max-env-steps", str(max_steps), "--target-return", "100000", "--time-limit", "400",
        "--quiet", "--json", "--no-eval",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def learner_starts(run_dir: Path) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e.get("event") == "start" and e.get("process") == "learner"]


def status(run_dir: Path, rank: int) -> dict[str, Any]:
    return json.loads((run_dir / f"status-{rank}.json").read_text())


def test_two_ranks_to_one_and_back_resume_the_sharded_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = train(run_dir, ranks=2, max_steps=6000)
    assert status(run_dir, 0)["parallel"] == "fsdp"
    steps_after_first = first["env_steps"]

    second = train(run_dir, ranks=1, max_steps=steps_after_first + 6000)
    one = [e for e in learner_starts(run_dir) if e["pid"] == status(run_dir, 0)["pid"]]
    assert one
    assert one[0]["resumed_from"], "the 1-rank run did not resume"
    assert one[0]["env_steps"] >= steps_after_first
    assert status(run_dir, 0)["parallel"] == "single"

    train(run_dir, ranks=2, max_steps=second["env_steps"] + 6000)
    again = [e for e in learner_starts(run_dir) if e["pid"] == status(run_dir, 1)["pid"]]
    assert again
    assert again[0]["resumed_from"]
    assert again[0]["env_steps"] >= second["env_steps"]
    assert status(run_dir, 0)["parallel"] == "fsdp"
    assert status(run_dir, 0)["version"] > one[0]["step"] > 0
