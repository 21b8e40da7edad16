"""MiniGrid and BabyAI through shoal with no plugin: their Dict observations are packed by the
Gymnasium adapter, stepped by a vector, acted on by the multi family, and DoorKey-5x5 learns
from `shoal train gym:MiniGrid-DoorKey-5x5-v0` (a real cluster in child processes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import shoal.envs as envs
from shoal.envs.packed_obs import PackedBox
from shoal.learner.models import ModelConfig, build_model, model_from_spec
from shoal.learner.models.multi import MultiPolicy
from tests.support.train_cli import run_train

DOORKEY = "gym:MiniGrid-DoorKey-5x5-v0"


def _random_return(episodes: int) -> float:
    """Mean return of uniformly random actions over `episodes` DoorKey episodes (seeded)."""
    rng = np.random.default_rng(0)
    returns: list[float] = []
    with envs.make_vector(DOORKEY, 8, seed=0) as vec:
        vec.reset()
        while len(returns) < episodes:
            step = vec.step(rng.integers(0, 7, 8))
            returns += step.episode_return[step.done].tolist()
    return float(np.mean(returns))


def test_a_babyai_level_steps_in_a_vector_under_the_multi_policy() -> None:
    with envs.make_vector("gym:BabyAI-GoToRedBall-v0", 3, seed=0) as vec:
        space = vec.single_observation_space
        assert isinstance(space, PackedBox)
        policy = build_model(ModelConfig(), space, vec.single_action_space)
        assert isinstance(policy, MultiPolicy)
        obs = vec.reset()
        assert obs.dtype == np.uint8
        assert obs.shape == (3, space.shape[0])
        ended = 0
        for _ in range(200):
            actions, _, _ = policy.act(obs)
            step = vec.step(actions)
            obs = step.obs
            ended += int(step.done.sum())
        assert obs.dtype == np.uint8
        assert ended >= 3  # GoToRedBall's time limit is 64 steps: every copy ended at least once


@pytest.mark.timeout(900)
def test_shoal_train_learns_doorkey_with_no_plugin(tmp_path: Path) -> None:
    # Trained to a target, not for a fixed budget: how far a budget gets depends on the asynchrony
    # (seed 1's last 20 episodes averaged 0.09 at 100k steps under CI's load, though it had
    # learned on an idle machine), while the target is reached far inside the 400k cap either way
    # (28k-41k steps beside three busy loops; docs/benchmarks.md: all three seeds are at
    # 0.75-0.96 by 150k). Random actions score about 0.03 (`_random_return`); 0.5 is a policy
    # that opens the door and reaches the goal in most episodes.
    baseline = _random_return(40)
    summary = run_train(
        DOORKEY, "--target-return", "0.5", "--max-env-steps", "400000", "--time-limit", "840",
        "--seed", "1", "--no-eval", "--quiet", run_dir=tmp_path / "run", timeout=880,
    )  # fmt: skip
    assert baseline < 0.1
    assert summary["solved"], summary
    assert summary["final_return"] >= 0.5
    assert summary["intake"]["trained"] >= 5  # 13-19 updates when measured
    trainer = json.loads(Path(summary["checkpoint"], "trainer.json").read_text())
    assert trainer["policy_spec"]["family"] == "multi"
    assert isinstance(model_from_spec(trainer["policy_spec"]), MultiPolicy)
