"""The best checkpoint (highest recent mean return when saved) survives rotation; resuming
still takes the newest; `shoal eval RUN --best` evaluates the best one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.cli import main
from shoal.envs import make
from shoal.learner.checkpoint import CheckpointManager
from shoal.learner.checkpoint_best import best_saved
from shoal.learner.checkpoint_layout import manifest_steps
from shoal.learner.models import MLPPolicy


def save(manager: CheckpointManager, step: int, mean_return: float | None) -> None:
    meta = {} if mean_return is None else {"mean_return": mean_return}
    tensors = {"weights": torch.full((2,), float(step))}
    manager.save(tensors, step, {"step": step}, meta=meta, block=True)


def test_the_best_survives_rotation_and_resume_takes_the_newest(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep=2) as manager:
        for step, mean in enumerate([1.0, 5.0, 9.0, 3.0, 2.0, 4.0], start=1):
            save(manager, step, mean)
        assert sorted(manifest_steps(tmp_path)) == [3, 5, 6]
        best, newest = manager.best(), manager.latest()
        assert best is not None
        assert newest is not None
        assert (best.step, best.meta["mean_return"], newest.step) == (3, 9.0, 6)
        save(manager, 7, 10.0)  # a new best: the old one rotates away like any other
        assert sorted(manifest_steps(tmp_path)) == [6, 7]
        assert manager.best() == manager.latest()


def test_without_returns_there_is_no_best_and_keep_rules_alone(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep=2) as manager:
        for step in range(1, 5):
            save(manager, step, None)
        assert manager.best() is None
        assert sorted(manifest_steps(tmp_path)) == [3, 4]


@settings(max_examples=15, deadline=None)
@given(
    returns=st.lists(
        st.one_of(st.none(), st.floats(-1e6, 1e6, allow_nan=False)), min_size=1, max_size=7
    ),
    keep=st.integers(1, 3),
)
def test_on_disk_are_the_newest_keep_and_the_best(
    tmp_path_factory: pytest.TempPathFactory, returns: list[float | None], keep: int
) -> None:
    directory = tmp_path_factory.mktemp("ckpt")
    with CheckpointManager(directory, keep=keep) as manager:
        for step, mean in enumerate(returns):
            save(manager, step, mean)
        ranked = [(m, s) for s, m in enumerate(returns) if m is not None]
        best = max(ranked)[1] if ranked else None
        steps = list(range(len(returns)))
        assert set(manifest_steps(directory)) == {*steps[-keep:], *([] if best is None else [best])}
        assert best_saved(directory) == (None if best is None else (returns[best], best))
        found = manager.best()
        assert (None if found is None else found.step) == best
        newest = manager.latest()
        assert newest is not None
        assert newest.step == steps[-1]


def test_shoal_eval_best_evaluates_the_best_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = make("CartPole-v1")
    policy = MLPPolicy(env.observation_space, env.action_space, (8,))
    env.close()
    trainer = {"policy_spec": policy.spec(), "env_id": "CartPole-v1", "config": {}}
    directory = tmp_path / "run" / "checkpoints"
    with CheckpointManager(directory, keep=1) as manager:
        for step, mean in ((1, 30.0), (2, 80.0), (3, 20.0)):
            meta = {"mean_return": mean}
            manager.save({"model": policy.state_dict()}, step, trainer, meta=meta, block=True)
    args = ["eval", str(tmp_path / "run"), "--episodes", "2", "--json"]
    assert main([*args, "--best"]) == 0
    best = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert Path(best["checkpoint"]).name == "ckpt-000000000002"
    assert main(args) == 0
    newest = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert Path(newest["checkpoint"]).name == "ckpt-000000000003"


@pytest.mark.timeout(300)
def test_shoal_train_names_the_best_checkpoint_in_its_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", "cartpole", "--run-dir", str(run_dir), "--quiet", "--no-eval", "--json"]
    argv += ["--max-env-steps", "30000", "--target-return", "1000", "--checkpoint-interval", "0.5"]
    assert main(argv) == 1  # the budget ends it, unsolved by design
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    directory = run_dir / "checkpoints"
    with CheckpointManager(directory) as manager:
        best = manager.best()
        assert best is not None
        returns = [
            m for i in manager.list_complete() if (m := i.meta.get("mean_return")) is not None
        ]
    assert summary["best_checkpoint"] == str(best.path)
    assert summary["best_return"] == max(returns) == best.meta["mean_return"]
    assert len(manifest_steps(directory)) <= 3 + 1  # checkpoint.keep, and the best beside
