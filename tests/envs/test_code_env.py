"""The code-execution environments, run for real through the registry and the sandbox."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.envs import code_env
from shoal.envs.code_env import (
    NUM_CANDIDATES,
    CodeChoiceVector,
    candidate_rewards,
    reference_action,
    reference_policy,
)
from shoal.envs.code_tasks import BASIC, UnknownTaskSuite, suite
from shoal.envs.errors import InvalidAction
from shoal.envs.evaluation import EvalOptions, evaluate
from shoal.envs.registry import make
from shoal.envs.vector import make_vector


@pytest.fixture(scope="module")
def table():
    return candidate_rewards(BASIC)


@pytest.fixture(autouse=True)
def _hash_store_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "shoal-home"))


def test_the_basic_suite_has_twenty_distinct_tasks_with_four_candidates():
    assert len(BASIC) >= 20
    assert len({t.id for t in BASIC}) == len(BASIC)
    for task in BASIC:
        assert len(task.candidates()) == NUM_CANDIDATES
        assert task.candidates()[reference_action(task)] == task.reference
    assert len({reference_action(t) for t in BASIC}) > 1  # the reference is not always action 0


@pytest.mark.timeout(120)
def test_references_pass_every_test_and_buggy_candidates_do_not(table):
    for task, row in zip(BASIC, table):
        ref = reference_action(task)
        assert row[ref] == 1.0, task.id
        assert all(row[c] < 1.0 for c in range(NUM_CANDIDATES) if c != ref), (task.id, row)


@pytest.mark.timeout(60)
def test_code_exec_runs_the_submitted_program_in_the_sandbox():
    env = make("CodeExec-v1")
    try:
        env.seed(7)
        obs, info = env.reset()
        task = BASIC[info["task_index"]]
        assert obs.shape == (len(BASIC),)
        assert obs[info["task_index"]] == 1.0
        assert info["prompt"] == task.prompt
        _, reward, done, step_info = env.step(task.reference)
        assert (reward, done, step_info["status"]) == (1.0, True, "ok")
        env.reset()
        _, reward, _, step_info = env.step("while True:\n    pass\n")
        assert reward == 0.0
        assert step_info["status"] in ("cpu_limit", "timeout")  # whichever a loaded box hits first
        env.reset()
        with pytest.raises(InvalidAction, match="Python source strings"):
            env.step(b"print(1)")
    finally:
        env.close()


@pytest.mark.timeout(120)
def test_code_exec_fails_a_step_whose_program_attacks_the_result_channel():
    """What made step() raise in the rollout worker (a string error field, a 200,000-deep
    array) now costs that episode, with its reason in info; the next step still works."""
    attacks = [
        'import os\nos.write(3, b\'{"event": "test", "index": 0, "error": "boom"}\\n\')\n',
        "import os\nos.write(3, b'[' * 200000 + b'\\n')\n",
        'import os\nos.write(3, b\'{"event": "done"}\\n\')\n',
    ]
    env = make("CodeExec-v1")
    try:
        env.seed(3)
        for attack in attacks:
            _, info = env.reset()
            task = BASIC[info["task_index"]]
            _, reward, done, step_info = env.step(attack + task.reference)
            assert (reward, done, step_info["status"]) == (0.0, True, "channel_violation")
            assert "result channel" in step_info["message"]
            assert step_info["passed"] == 0
        _, info = env.reset()
        _, reward, _, step_info = env.step(BASIC[info["task_index"]].reference)
        assert (reward, step_info["status"]) == (1.0, "ok")
    finally:
        env.close()


def test_stepping_before_reset_is_refused():
    env = code_env.CodeExecEnv()
    with pytest.raises(InvalidAction, match="call reset"):
        env.step("pass")
    env.close()


@pytest.mark.timeout(60)
def test_code_choice_vector_pays_the_table_reward(table):
    vec = make_vector("CodeChoice-v1", 6, seed=0)
    assert isinstance(vec, CodeChoiceVector)
    obs = vec.reset(seed=1)
    assert obs.shape == (6, len(BASIC))
    tasks = obs.argmax(axis=1)
    step = vec.step(reference_policy()(obs))
    assert step.reward.tolist() == [1.0] * 6
    assert step.done.all()
    assert not step.truncated.any()
    assert (step.final_obs.argmax(axis=1) == tasks).all()
    wrong = np.zeros(6, dtype=np.int64)
    tasks = step.obs.argmax(axis=1)
    assert np.array_equal(vec.step(wrong).reward, table[tasks, 0])
    with pytest.raises(InvalidAction):
        vec.step(np.full(6, NUM_CANDIDATES))


@pytest.mark.timeout(120)
def test_evaluating_the_reference_policy_gives_exact_counts():
    opts = EvalOptions(num_envs=4, success_threshold=1.0, obs_noise=(), action_noise=(0.0, 1.0))
    result = evaluate(reference_policy(), "CodeChoice-v1", episodes=10, seed=0, options=opts)
    m = result.metrics
    assert m.episodes == 10
    assert m.returns == [1.0] * 10
    assert m.lengths == [1] * 10
    assert m.success_rate == 1.0
    assert m.env_steps == 12  # quotas 3,3,2,2: three steps of four slots
    random_play = result.action_noise[1].metrics
    assert random_play.episodes == 10
    assert random_play.mean_return < 1.0


def test_an_unknown_suite_names_the_known_ones():
    with pytest.raises(UnknownTaskSuite, match=r"choose one of \['basic'\]"):
        suite("advanced")


@pytest.mark.timeout(60)
def test_a_linear_softmax_policy_learns_code_choice_by_policy_gradient():
    """The discrete variant is learnable from its reward alone (what PPO will do, minus PPO)."""
    vec = make_vector("CodeChoice-v1", 64, seed=0)
    rng = np.random.default_rng(0)
    weights = np.zeros((len(BASIC), NUM_CANDIDATES))
    obs = vec.reset()
    for _ in range(300):
        logits = obs @ weights
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        actions = np.array([rng.choice(NUM_CANDIDATES, p=p) for p in probs])
        step = vec.step(actions)
        advantage = step.reward - step.reward.mean()
        grad = -probs
        grad[np.arange(64), actions] += 1.0
        weights += 0.5 * obs.T @ (grad * advantage[:, None])
        obs = step.obs
    greedy = (obs @ weights).argmax(axis=1)
    assert np.array_equal(greedy, reference_policy()(obs))
