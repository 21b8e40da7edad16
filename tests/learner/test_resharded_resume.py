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
    assert done.returncode == 1, done.stderr[-3000:]  # 1: stopped unsolved, as asked
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["stopped_by"] == "max_env_steps"
    return dict(summary)


def learner_starts(run_dir: Path) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e.get("event") == "start" and e.get("process") == "learner"]


def status(run_dir: Path, rank: int) -> dict[str, Any]:
    return json.loads((run_dir / f"status-{rank}.json").read_text())


def resumed(run_dir: Path, rank: int, previous: dict[str, Any]) -> dict[str, Any]:
    """This run's start event of `rank`, checked to have resumed from the previous run's final
    checkpoint; rank 0 takes over the group's counts, the others count on top of them."""
    pid = status(run_dir, rank)["pid"]
    starts = [e for e in learner_starts(run_dir) if e["pid"] == pid]
    assert starts
    start = starts[0]
    assert start["resumed_from"] == previous["checkpoint"]
    trainer = json.loads((Path(start["resumed_from"]) / "trainer.json").read_text())
    assert start["step"] == trainer["version"] == previous["checkpoint_step"] > 0
    assert start["env_steps"] == (trainer["env_steps"] if rank == 0 else 0)
    assert trainer["env_steps"] > 0
    return start


def test_two_ranks_to_one_and_back_resume_the_sharded_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = train(run_dir, ranks=2, max_steps=6000)
    assert status(run_dir, 0)["parallel"] == "fsdp"

    second = train(run_dir, ranks=1, max_steps=first["env_steps"] + 6000)
    one = resumed(run_dir, 0, first)
    assert status(run_dir, 0)["parallel"] == "single"

    train(run_dir, ranks=2, max_steps=second["env_steps"] + 6000)
    for rank in (0, 1):
        resumed(run_dir, rank, second)
    assert status(run_dir, 0)["parallel"] == "fsdp"
    assert status(run_dir, 0)["version"] > one["step"]
