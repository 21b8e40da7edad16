"""A learner rank that meets an error no restart can fix publishes it as its task's `error`
(which ends the job at once, as tests/learner/test_plugin_dict_train.py shows for a rollout
worker) instead of failing the same way on each of the group's restarts: the real `serve`,
its real publication in a task directory, and a host whose memory is made too small for the
model (the one thing simulated)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.learner import trainer
from shoal.learner.config import TrainConfig
from shoal.learner.group import GroupSpec
from shoal.learner.learner_main import serve
from shoal.learner.parallel import ParallelError
from shoal.runtime.loop import run
from shoal.task_exchange import PUBLISHED


def test_a_model_over_the_ranks_memory_is_published_as_the_tasks_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = tmp_path / "task"
    task.mkdir()
    monkeypatch.setenv("SHOAL_TASK_DIR", str(task))
    monkeypatch.setattr(trainer, "rank_memory_bytes", lambda device, ranks: 4096)
    listen_at = ("127.0.0.1", 0)
    with pytest.raises(ParallelError, match="over a rank's"):
        run(serve(TrainConfig(), "CartPole-v1", tmp_path / "run", listen_at, GroupSpec(), "t"))
    published = json.loads((task / PUBLISHED).read_text())
    assert published["error"].startswith("learner rank 0: the model's training state")
    assert "add ranks" in published["error"]
    assert published["role"] == "learner"  # the rest of its state is still published
