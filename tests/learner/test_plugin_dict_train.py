"""`shoal train` learns a shoal plugin environment with a Dict observation (grid, vector, text)
loaded through SHOAL_ENV_MODULES, with no change to the plugin: the vector packs it, `auto`
picks the multi model, and a real cluster in child processes trains it above random."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import shoal.envs as envs
from tests.support.signal_room import LAMPS, LATE_NAN_SIGNAL_ROOM, NAN_SIGNAL_ROOM, SIGNAL_ROOM
from tests.support.train_cli import run_train, train_process

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
    """The plugin importable in the child and a SHOAL_HOME of the test's own, over the
    environment train_process gives it."""
    return {
        "PYTHONPATH": str(ROOT),
        "SHOAL_ENV_MODULES": "tests.support.signal_room",
        "SHOAL_HOME": str(tmp_path / "home"),
    }


@pytest.mark.timeout(300)
def test_shoal_train_learns_a_dict_observation_plugin(tmp_path: Path) -> None:
    baseline = _random_return(40)
    summary = run_train(
        SIGNAL_ROOM, "--max-env-steps", "20000", "--seed", "1", "--no-eval", "--quiet",
        "--embedded", run_dir=tmp_path / "run", timeout=280, env=_environ(tmp_path), cwd=tmp_path,
    )  # fmt: skip
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
    out = train_process(
        NAN_SIGNAL_ROOM, "--quiet", "--embedded", run_dir=tmp_path / "run", timeout=100,
        env=_environ(tmp_path), cwd=tmp_path,
    )  # fmt: skip
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
    out = train_process(
        LATE_NAN_SIGNAL_ROOM, "--max-env-steps", "20000", "--no-eval", "--quiet", "--embedded",
        run_dir=tmp_path / "run", timeout=280, env=_environ(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode != 0, out.stdout[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    assert "cannot go on" in lines[0]
    assert "observation part vector holds NaN or infinite values" in lines[0]
