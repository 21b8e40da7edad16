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
from shoal.learner.preflight import (
    PreflightError,
    check_fragment,
    check_spaces,
    mismatch,
    trainable,
)

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


GRIDWORLD_64 = 'env_id = "GridWorld-v1"\nenv_kwargs = {{ size = 64 }}\n[rollout]\nnum_envs = {}\n'
"""A 64x64 GridWorld observes 20,481 float32s: 81,958 bytes per environment and step."""


@pytest.mark.timeout(240)
def test_shoal_train_refuses_a_fragment_no_frame_holds_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "job.toml").write_text(GRIDWORLD_64.format(4096))
    done = shoal_train(tmp_path, "job.toml", "--no-eval")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    line = lines[0]
    assert line.startswith("shoal: error: one step of 4096 environment(s)"), line
    assert "shape [20481] is 320.2 MiB" in line
    assert "frame limit of 256.0 MiB (max_frame_bytes)" in line
    assert "at most 3274 environments per actor (--envs, rollout.num_envs)" in line
    assert not (tmp_path / "runs").exists()  # refused before a run directory or a cluster


@pytest.mark.timeout(240)
def test_shoal_train_says_before_starting_that_the_horizon_will_be_shortened(
    tmp_path: Path,
) -> None:
    # 128 copies: 32 steps make 320 MiB, 25 fit. The run is stopped right after the pre-flight
    # by a run directory that cannot be made (under a file), so no 250 MiB fragment is
    # collected on a test machine; the line is printed before that.
    (tmp_path / "job.toml").write_text(GRIDWORLD_64.format(128))
    (tmp_path / "a-file").write_text("")
    done = shoal_train(tmp_path, "job.toml", "--no-eval", "--run-dir", "a-file/run")
    assert done.returncode == 2, done.stderr
    assert "cannot create run directory" in done.stderr
    shrunk = [line for line in done.stdout.splitlines() if line.startswith("rollout.horizon")]
    assert shrunk == [
        "rollout.horizon: 32 asked, 25 used: a fragment of 32 steps x 128 envs (320.2 MiB) "
        "would exceed the transport's frame limit of 256.0 MiB; collecting fragments of 25 "
        "steps x 128 envs (250.2 MiB)"
    ]


def test_the_pre_flight_horizon_is_the_one_the_collector_uses() -> None:
    from shoal.envs import make_vector
    from shoal.learner.collector import Collector
    from shoal.learner.config import RolloutConfig
    from shoal.learner.models import build_model

    with make_vector("GridWorld-v1", 128, seed=0, size=64) as env:
        policy = build_model(ModelConfig(), env.single_observation_space, env.single_action_space)
        collector = Collector("a", env, policy, 32, "hash", 0, max_frame_bytes=256 << 20)
        note = check_fragment(
            RolloutConfig(num_envs=128, horizon=32), policy, env.single_action_space
        )
        fits = check_fragment(
            RolloutConfig(num_envs=128, horizon=25), policy, env.single_action_space
        )
    assert collector.horizon == 25
    assert note is not None
    assert note.startswith("rollout.horizon: 32 asked, 25 used: ")
    assert fits is None
    with pytest.raises(PreflightError, match="use at most 3274 environments per actor"):
        check_fragment(RolloutConfig(num_envs=4096), policy, env.single_action_space)
