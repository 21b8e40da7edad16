"""The pre-flight check refuses an environment/model mismatch before any process starts: a
real `shoal train` exits 2 with one line naming the reason and the fix, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces

from shoal.learner.models import ModelConfig
from shoal.learner.preflight import PreflightError, check_spaces, mismatch, trainable

ROOT = Path(__file__).resolve().parents[2]
ALE_BANNER = ("A.L.E: Arcade Learning Environment", "[Powered by Stella]")
"""What ale-py's native code prints on import, outside shoal's hands."""


def shoal_train(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    environ = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SHOAL_ENV_MODULES": "tests.support.odd_envs",
        "SHOAL_HOME": str(tmp_path / "home"),
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "shoal", "train", *argv, "--quiet", "--embedded"],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (
            ("CartPole-v1", "--model", "cnn"),
            ("model.family = 'cnn' needs image observations", "use model.family = 'auto'"),
        ),
        (
            ("gym:ALE/Pong-v5", "--model", "mlp", "--preset", "none"),
            ("'mlp' would flatten gym:ALE/Pong-v5's 210x160x3 frames", "100,800 inputs"),
        ),
        (
            ("Acrobot-v1", "--model", "causal-lm"),
            ("'causal-lm' reads token ids", "Acrobot-v1 observes"),
        ),
        (
            ("gym:ShoalOdd/SwitchBoard-v0",),
            ("acts in MultiBinary(3)", "Discrete or 1-D Box", "package.module:factory"),
        ),
    ],
)
def test_shoal_train_refuses_a_mismatch_in_one_line_before_any_process(
    tmp_path: Path, argv: tuple[str, ...], words: tuple[str, ...]
) -> None:
    done = shoal_train(tmp_path, *argv)
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith(ALE_BANNER)]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("shoal: error: ")
    for word in words:
        assert word in lines[0]
    assert "Traceback" not in done.stderr + done.stdout
    assert not (tmp_path / "runs").exists()  # refused before a run directory or a cluster


VECTOR = spaces.Box(-1.0, 1.0, (4,), np.float32)
FRAMES = spaces.Box(0, 255, (4, 84, 84), np.uint8)
SMALL_GRID = spaces.Box(0, 255, (7, 7, 3), np.uint8)
TINY = spaces.Box(0, 255, (3, 3, 1), np.uint8)


@pytest.mark.parametrize(
    ("family", "observation", "action", "refused"),
    [
        ("auto", VECTOR, spaces.Discrete(2), False),
        ("auto", FRAMES, spaces.Discrete(6), False),
        ("mlp", SMALL_GRID, spaces.Discrete(3), False),  # too small for the cnn: an MLP's job
        ("mlp", FRAMES, spaces.Discrete(6), True),
        ("cnn", VECTOR, spaces.Discrete(2), True),
        ("auto", VECTOR, spaces.MultiDiscrete([2, 3]), True),
        ("auto", VECTOR, spaces.Box(-1, 1, (2, 2), np.float32), True),
        ("pkg.mod:factory", VECTOR, spaces.MultiDiscrete([2, 3]), False),  # its own business
    ],
)
def test_mismatch_names_only_what_cannot_train(
    family: str, observation: spaces.Space[Any], action: spaces.Space[Any], refused: bool
) -> None:
    assert (mismatch("X-v0", family, observation, action) is not None) == refused


def test_a_model_that_cannot_be_built_is_refused_with_its_reason() -> None:
    with pytest.raises(PreflightError, match=r"model.family = 'cnn' cannot be built for X-v0"):
        check_spaces("X-v0", ModelConfig(family="cnn"), TINY, spaces.Discrete(3))


def test_trainable_says_why_not_or_nothing() -> None:
    assert trainable("CartPole-v1") == ""
    assert trainable("CodeGen-v1") == ""  # text: the token path builds its causal LM
