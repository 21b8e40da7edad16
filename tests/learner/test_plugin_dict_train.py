"""`shoal train` learns a shoal plugin environment with a Dict observation (grid, vector, text)
loaded through SHOAL_ENV_MODULES, with no change to the plugin: the vector packs it, `auto`
picks the multi model, and a real cluster in child processes trains it above random."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shoal.envs as envs
from tests.support.signal_room import LAMPS, LATE_NAN_SIGNAL_ROOM, NAN_SIGNAL_ROOM, SIGNAL_ROOM

ROOT = Path(__file__).resolve().parents[2]


def _random_return(episodes: int) -> float:
    """Mean return of uniformly random actions over `episodes` episodes (seeded)."""
    rng = np.random.default_rng(0)
    returns: list[float] = []
    with envs.make_vector(SIGNAL_ROOM, 4, seed=0) as vec:
        vec.reset()
        while len(returns) < episodes:
            step = vec.step(rng.integers(0, LAMPS, 4))
            returns += step.episode_return[step.ended].tolist()
    return float(np.mean(returns))


def _environ(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SHOAL_ENV_MODULES": "tests.support.signal_room",
        "SHOAL_HOME": str(tmp_path / "home"),
        "OMP_NUM_THREADS": "1",
    }


@pytest.mark.timeout(300)
def test_shoal_train_learns_a_dict_observation_plugin(tmp_path: Path) -> None:
    baseline = _random_return(40)
    environ = _environ(tmp_path)
    argv = [sys.executable, "-m", "shoal", "train", SIGNAL_ROOM, "--max-env-steps", "20000",
            "--seed", "1", "--no-eval", "--quiet", "--json", "--embedded",
            "--run-dir", str(tmp_path / "run")]  # fmt: skip
    out = subprocess.run(
        argv, cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=280
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.splitlines()[-1])
    assert summary["env_steps"] >= 20000
    assert summary["intake"]["trained"] >= 10
    # Random actions light the right lamp one step in three (about 5.3 of 16); reading the grid
    # scores up to 16.
    assert summary["final_return"] > baseline + 4.0, (summary["final_return"], baseline)
    trainer = json.loads(Path(summary["checkpoint"], "trainer.json").read_text())
    assert trainer["policy_spec"]["family"] == "multi"


@pytest.mark.timeout(120)
def test_a_plugin_whose_first_observation_is_hostile_is_refused_before_any_process(
    tmp_path: Path,
) -> None:
    argv = [sys.executable, "-m", "shoal", "train", NAN_SIGNAL_ROOM, "--quiet", "--embedded",
            "--run-dir", str(tmp_path / "run")]  # fmt: skip
    out = subprocess.run(
        argv, cwd=tmp_path, env=_environ(tmp_path), capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "shoal: error: observation part vector holds NaN or infinite values: fix the environment"
    ]
    assert not (tmp_path / "run").exists()  # the pre-flight's reset refused it


@pytest.mark.timeout(300)
def test_a_plugin_observation_that_turns_hostile_mid_run_ends_the_job_with_the_reason(
    tmp_path: Path,
) -> None:
    """The workers' PackingError is published and ends the run (as an unsendable fragment
    does), not a rollout task restarted again and again on the same bad observation."""
    argv = [sys.executable, "-m", "shoal", "train", LATE_NAN_SIGNAL_ROOM, "--max-env-steps",
            "20000", "--no-eval", "--quiet", "--embedded", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    out = subprocess.run(
        argv, cwd=tmp_path, env=_environ(tmp_path), capture_output=True, text=True, timeout=280
    )
    assert out.returncode != 0, out.stdout[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    assert "cannot go on" in lines[0]
    assert "observation part vector holds NaN or infinite values" in lines[0]
