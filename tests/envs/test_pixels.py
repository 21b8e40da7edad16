"""Pixels end to end: the `atari` wrapper set (natively or per copy) gives uint8 [4, 84, 84]
frames that `auto` hands to the CNN and a real collector puts into fragments as uint8; returns
reported are whole games; MinAtar's boolean frames become uint8 images and MinAtar Breakout
trains through `shoal train`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shoal.envs.atari import area_taps
from shoal.envs.hashing import HashStore, env_hash
from shoal.envs.vector import make_vector
from shoal.envs.wrappers import EnvConfig
from shoal.learner.collector import Collector
from shoal.learner.models import ModelConfig, build_model
from shoal.learner.models.cnn import CNNPolicy
from tests.support.train_cli import run_train

pytest.importorskip("ale_py", reason="ale-py (the envs extra) is not installed")

ATARI = EnvConfig(wrappers=({"name": "atari", "kwargs": {}},))


def test_area_taps_average_each_span_exactly() -> None:
    indices, weights = area_taps(210, 84)
    assert np.allclose(weights.sum(axis=1), 1.0)
    ramp = np.arange(210, dtype=np.float64)
    resized = (ramp[indices] * weights).sum(axis=1)
    # Output 0 averages pixels 0, 1 and half of 2; output 1 the other half of 2, then 3 and 4.
    assert np.allclose(resized[:2], [(0 + 1 + 2 * 0.5) / 2.5, (2 * 0.5 + 3 + 4) / 2.5])
    assert np.isclose(resized.sum() * 2.5, ramp.sum())  # every input pixel counted exactly once


def test_pong_with_the_atari_set_travels_as_uint8_frames_into_a_cnn_fragment(
    tmp_path: Path,
) -> None:
    with make_vector("gym:ALE/Pong-v5", 2, seed=0, env=ATARI) as vec:
        space = vec.single_observation_space
        assert space.shape == (4, 84, 84)
        assert space.dtype == np.uint8
        policy = build_model(ModelConfig(), space, vec.single_action_space)
        assert isinstance(policy, CNNPolicy)
        digest = env_hash("gym:ALE/Pong-v5", {}, 0, store=HashStore(tmp_path), wrappers=ATARI)
        collector = Collector("pong-0", vec, policy, 16, digest, seed=0)
        fragment = collector.collect()
    assert fragment.obs.dtype == np.uint8
    assert fragment.obs.shape == (16, 2, 4, 84, 84)
    assert fragment.obs.max() > 0  # real frames, not padding
    assert fragment.env_hash == digest
    assert set(np.unique(fragment.rewards)) <= {-1.0, 0.0, 1.0}


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"mode": 0}],  # ale-py's C++ vector; the per-copy wrappers (mode has no C++ equivalent)
    ids=["native", "per-copy"],
)
def test_breakout_reports_whole_games_while_each_life_ends_the_learners_episode(
    kwargs: dict[str, int],
) -> None:
    rng = np.random.default_rng(0)
    dones = ended = 0
    returns: list[float] = []
    with make_vector("gym:ALE/Breakout-v5", 2, seed=0, env=ATARI, **kwargs) as vec:
        vec.reset()
        while ended < 2:
            step = vec.step(rng.integers(0, 4, 2))
            dones += int(step.done.sum())
            ended += int(step.ended.sum())
            returns += step.episode_return[step.ended].tolist()
    # Breakout has 5 lives: 2 games are at least 10 of the learner's episodes (the last life
    # of a game ends both).
    assert dones >= 5 * ended
    assert all(r >= 0 and r == int(r) for r in returns)


def test_minatar_frames_are_uint8_images_for_the_small_image_cnn() -> None:
    pytest.importorskip("minatar", reason="MinAtar (the envs extra) is not installed")
    with make_vector("gym:MinAtar/Breakout-v1", 3, seed=0) as vec:
        space = vec.single_observation_space
        assert space.shape == (10, 10, 4)
        assert space.dtype == np.uint8
        obs = vec.reset()
        assert set(np.unique(obs)) <= {0, 255}
        policy = build_model(ModelConfig(), space, vec.single_action_space)
        assert isinstance(policy, CNNPolicy)
        actions, _, _ = policy.act(obs)
        assert vec.step(actions).obs.dtype == np.uint8


@pytest.mark.timeout(300)
def test_shoal_train_steps_minatar_breakout(tmp_path: Path) -> None:
    pytest.importorskip("minatar", reason="MinAtar (the envs extra) is not installed")
    summary = run_train(
        "gym:MinAtar/Breakout-v1", "--max-env-steps", "8192", "--seed", "1", "--no-eval",
        "--quiet", run_dir=tmp_path / "run", timeout=280,
        codes=(0, 1),  # 1: ran, target not reached
    )  # fmt: skip
    assert summary["env_steps"] >= 8192
    assert summary["intake"]["trained"] >= 2
    trainer = json.loads(Path(summary["checkpoint"], "trainer.json").read_text())
    assert trainer["policy_spec"]["family"] == "cnn"
