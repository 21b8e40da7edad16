"""The four-stage pipeline end to end on the real GridWorld and code environments."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from shoal.errors import ConfigError
from shoal.learner.checkpoint import CheckpointManager
from shoal.learner.errors import PipelineError
from shoal.learner.pipeline import PipelineConfig, run_pipeline

SMALL = {"num_envs": 8, "demo_steps": 1024, "pretrain_epochs": 20, "pretrain_minibatch": 64, "ppo_env_steps": 1024,
         "horizon": 32, "eval_episodes": 8}  # fmt: skip


@pytest.fixture(autouse=True)
def private_hash_store(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "home"))


def check_outputs(run_dir, manifest):
    for stage in manifest["stages"]:
        for output in stage["outputs"].values():
            data = (run_dir / output["path"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == output["sha256"]


@pytest.mark.timeout(180)
def test_gridworld_pipeline_records_every_stage(tmp_path):
    run_dir = tmp_path / "run"
    cfg = PipelineConfig(env_id="GridWorld-v1", held_out=("GridWorld-HeldOut-v1",), **SMALL)
    manifest = run_pipeline(cfg, run_dir)
    assert json.loads((run_dir / "pipeline.json").read_text()) == json.loads(json.dumps(manifest))
    stages = {s["name"]: s for s in manifest["stages"]}
    assert list(stages) == ["demonstrations", "pretrain", "ppo", "evaluation"]
    check_outputs(run_dir, manifest)
    assert manifest["config"]["env_id"] == "GridWorld-v1"
    # stage 1 and stage 3 see different seeds, hence different environment hashes
    assert stages["demonstrations"]["env_hash"] != stages["ppo"]["env_hash"]
    assert stages["demonstrations"]["metrics"]["teacher_mean_return"] > 0.5
    with np.load(run_dir / "demonstrations.npz") as demos:
        assert demos["obs"].shape[0] == demos["actions"].shape[0] == 1024
    assert stages["pretrain"]["metrics"]["accuracy"] > 0.9
    assert stages["ppo"]["metrics"]["env_steps"] == 1024.0
    final = stages["evaluation"]["metrics"]["final"]
    assert final["mean_return"] > 0.5  # the distilled policy reaches the goal
    assert "GridWorld-HeldOut-v1" in final["held_out_mean_return"]
    with CheckpointManager(run_dir / "checkpoints" / "ppo") as ckpt:
        latest = ckpt.latest()
        assert latest is not None
        assert ckpt.load_trainer(latest)["stage"] == "ppo"


@pytest.mark.timeout(180)
def test_code_choice_pipeline_distils_the_reference_solutions(tmp_path):
    cfg = PipelineConfig(env_id="CodeChoice-v1", **{**SMALL, "ppo_env_steps": 0})
    manifest = run_pipeline(cfg, tmp_path / "run")
    stages = {s["name"]: s for s in manifest["stages"]}
    assert stages["demonstrations"]["metrics"]["teacher_mean_return"] == pytest.approx(1.0)
    assert stages["pretrain"]["metrics"]["accuracy"] == 1.0
    assert stages["ppo"]["metrics"]["updates"] == 0.0
    assert stages["evaluation"]["metrics"]["final"]["mean_return"] == pytest.approx(1.0)
    check_outputs(tmp_path / "run", manifest)


def test_an_environment_without_a_teacher_is_refused(tmp_path):
    with pytest.raises(PipelineError, match="CartPole-v1 has no teacher"):
        run_pipeline(PipelineConfig(env_id="CartPole-v1", **SMALL), tmp_path / "run")


@pytest.mark.parametrize(
    ("key", "value"),
    [("num_envs", 0), ("demo_steps", -1), ("ppo_env_steps", -5), ("pretrain_lr", 0.0),
     ("env_id", ""), ("held_out", ("",)), ("horizon", 2.0)],
)  # fmt: skip
def test_bad_config_names_the_key(key, value):
    with pytest.raises(ConfigError, match=f"pipeline.{key} = "):
        PipelineConfig(**{key: value})
