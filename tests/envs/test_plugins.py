"""Environments from outside shoal reach every process: the tutorial's module, loaded through
SHOAL_ENV_MODULES in fresh interpreters, makes, steps, passes check_env and trains."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.envs.plugins import PluginError, load_plugins

TUTORIAL = Path(__file__).parents[2] / "docs" / "tutorial-new-environment.md"


def tutorial_module(folder: Path) -> Path:
    """Write the tutorial's corridor.py into `folder`, exactly as the tutorial shows it."""
    match = re.search(r"<!-- corridor.py -->\n```python\n(.*?)```", TUTORIAL.read_text(), re.S)
    assert match, "the tutorial lost its corridor.py block"
    (folder / "corridor.py").write_text(match.group(1))
    return folder


def _env(folder: Path, modules: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(folder), "SHOAL_ENV_MODULES": modules}


@pytest.mark.timeout(120)
def test_the_tutorial_environment_makes_steps_and_passes_check_env(tmp_path: Path) -> None:
    script = """
import json, warnings
import numpy as np
from gymnasium.utils.env_checker import check_env
import shoal.envs as envs
from shoal.envs.gym_adapter import to_gymnasium
vec = envs.make_vector("Corridor-v1", 3, seed=0)
vec.reset()
steps = [vec.step(np.ones(3, dtype=np.int64)) for _ in range(9)]
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    check_env(to_gymnasium("Corridor-v1"))
print(json.dumps({"done": steps[-1].done.tolist(), "ret": steps[-1].episode_return.tolist()}))
"""
    folder = tutorial_module(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", script], env=_env(folder, "corridor"), capture_output=True,
        text=True, timeout=100, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["done"] == [True, True, True]  # nine steps right reach the end of 10 cells
    assert result["ret"] == pytest.approx([1.0 - 8 * 0.01] * 3)


@pytest.mark.timeout(200)
def test_shoal_train_learns_the_tutorial_environment_in_its_child_processes(
    tmp_path: Path,
) -> None:
    folder = tutorial_module(tmp_path)
    argv = [sys.executable, "-m", "shoal", "train", "Corridor-v1", "--target-return", "0.9",
            "--time-limit", "90", "--quiet", "--json", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    out = subprocess.run(
        argv, env=_env(folder, "corridor"), capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.splitlines()[-1])
    assert summary["solved"] is True
    assert Path(summary["report"]).exists()


def test_a_module_that_cannot_be_imported_is_named_with_the_fix() -> None:
    with pytest.raises(PluginError) as exc:
        load_plugins({"SHOAL_ENV_MODULES": " ,no_such_shoal_env_module"})
    assert "SHOAL_ENV_MODULES names 'no_such_shoal_env_module'" in str(exc.value)
    assert "PYTHONPATH" in str(exc.value)


def test_the_cli_turns_a_bad_plugin_into_one_line(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shoal", "envs", "info", "CartPole-v1"],
        env=_env(tmp_path, "no_such_shoal_env_module"), capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().startswith("shoal: error: SHOAL_ENV_MODULES names")
    assert len(out.stderr.strip().splitlines()) == 1
