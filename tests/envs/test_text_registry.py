"""Text environments in the registry: ids and aliases, the gym-style form, and the env hash."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.envs import make
from shoal.envs.catalog import probe_one
from shoal.envs.errors import EnvError, InvalidAction
from shoal.envs.hashing import env_hash, env_manifest
from shoal.envs.text_registry import TEXT_ENVS, is_text_env, make_text_env, text_env_hash


@pytest.fixture(autouse=True)
def _hash_store_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "shoal-home"))


def test_text_ids_and_aliases_are_recognised():
    assert set(TEXT_ENVS) == {"CodeGen-v1", "Countdown-v1", "CodeExec-v1"}
    assert all(is_text_env(i) for i in ("CodeGen-v1", "codegen", "countdown", "CodeExec-v1"))
    assert not any(is_text_env(i) for i in ("CartPole-v1", "CodeChoice-v1", "nope", 3))
    with pytest.raises(EnvError, match="not a text environment"):
        make_text_env("CartPole-v1")
    with pytest.raises(
        EnvError, match="CodeGen-v1 takes no keyword 'colour'; its keywords are: batch,"
    ):
        make_text_env("CodeGen-v1", colour="blue")


def test_the_hash_covers_generator_version_parameters_and_tokenizer():
    env = make_text_env("CodeGen-v1")
    assert text_env_hash(env) == env.digest() == make_text_env("codegen").digest()
    assert text_env_hash(env) != text_env_hash(make_text_env("CodeGen-v1", max_new_tokens=16))
    assert text_env_hash(env) != text_env_hash(make_text_env("Countdown-v1"))
    manifest = env_manifest("CodeGen-v1")
    assert manifest["text"] == env.manifest()
    assert env_hash("CodeGen-v1") != env_hash("CodeGen-v1", {"max_new_tokens": 16})
    assert "text" not in env_manifest("CartPole-v1")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env_id", ["CodeGen-v1", "Countdown-v1", "CodeExec-v1"])
def test_the_registry_probe_makes_resets_and_steps_each_text_env(env_id):
    result = probe_one(env_id)
    assert result.ok, result.detail


@pytest.mark.timeout(60)
def test_the_gym_style_form_observes_the_prompt_and_scores_one_completion():
    env = make("CodeGen-v1")
    try:
        env.seed(3)
        obs, info = env.reset()
        ids = env.text.tokenizer.encode(info["prompt"])
        assert obs.dtype == np.int64
        np.testing.assert_array_equal(obs[: len(ids)], ids)
        assert (obs[len(ids) :] == env.text.tokenizer.pad_id).all()
        task = env.text.tasks("train", 1, 0)[0]
        env._task = task
        _, reward, done, step_info = env.step(task.reference)
        assert (reward, done, step_info["status"], step_info["passed"]) == (1.0, True, "ok", 5)
        with pytest.raises(InvalidAction, match="reset"):
            env.step("    return 1\n")
    finally:
        env.close()


@pytest.mark.timeout(120)
def test_code_exec_as_text_serves_its_24_tasks_and_their_bodies_score_one():
    with make_text_env("CodeExec-v1") as env:
        tasks = env.tasks("train", 48, 0)
        assert len({t.id for t in tasks}) == 24
        assert all("\n\n" not in t.reference for t in tasks)
        assert max(len(env.tokenizer.encode(t.reference)) for t in tasks) <= env.max_new_tokens
        rng = np.random.default_rng(0)
        tasks += [env.perturb(t, rng) for t in tasks[:24]]
        scores = env.score_many(tasks, [t.reference for t in tasks])
        assert all(s.reward == 1.0 for s in scores)
        with pytest.raises(EnvError, match="no split 'heldout'"):
            env.tasks("heldout", 4)
