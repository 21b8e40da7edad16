"""The RL stage's validation split (disjoint from train and every evaluation split), its
best-by-validation choice (the student is kept when RL only worsens validation), and the parser
of the validation record the evaluation stage reads back from disk."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.envs.codegen import RL_VALUES, VALIDATION_VALUES, CodeGenEnv
from shoal.envs.countdown import CountdownEnv
from shoal.learner.errors import PipelineError
from shoal.learner.lm_config import EvalStageConfig, LMPipelineConfig, RLStageConfig
from shoal.learner.lm_pipeline import EVAL_SPLITS, draw_splits, new_policy
from shoal.learner.lm_rl import PromptPool, train_rl
from shoal.learner.lm_validation import (
    BestByValidation,
    parse_record,
    pool_split,
    validation_seed,
    validation_tasks,
)
from shoal.learner.models import ModelConfig
from shoal.learner.token_ppo import TokenRLConfig

TINY_LM = ModelConfig(family="causal-lm", hidden_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, intermediate_size=64, max_positions=256)  # fmt: skip


@pytest.fixture(scope="module")
def env():
    codegen = CodeGenEnv(max_new_tokens=12)
    yield codegen
    codegen.close()


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_validation_split_shares_no_prompt_with_train_or_evaluation(env, seed):
    cfg = LMPipelineConfig(seed=seed, train_tasks=300, rl=RLStageConfig(val_tasks=32),
                           eval=EvalStageConfig(tasks=32))  # fmt: skip
    splits = draw_splits(env, cfg)
    validation = [t.prompt for t in splits["validation"]]
    assert len(validation) == len(set(validation)) == 32
    for name in ("train", *EVAL_SPLITS):
        assert not set(validation) & {t.prompt for t in splits[name]}, name
    train_families = {t.family for t in splits["train"]}
    assert {t.family for t in splits["validation"]} <= train_families
    assert all(t.param("k") in VALIDATION_VALUES for t in splits["validation"])
    assert validation_seed(seed) not in (seed, seed + 1)


def test_the_splits_come_from_the_pools_an_env_offers_and_train_elsewhere(env):
    assert pool_split(env, "validation") == "validation"
    assert pool_split(env, "rl") == "rl"
    countdown = CountdownEnv()
    assert pool_split(countdown, "validation") == pool_split(countdown, "rl") == "train"
    prompts = PromptPool(env, "rl")
    assert all(t.param("k") in RL_VALUES for t in prompts.tasks("train", 50, 1))
    assert prompts.tasks("heldout", 5, 1) == env.tasks("heldout", 5, 1)
    assert prompts.tokenizer is env.tokenizer


def test_too_few_new_prompts_is_named(env):
    taken = [env.tasks("validation", 2000, validation_seed(3))]
    with pytest.raises(PipelineError, match=r"lower pipeline\.rl\.val_tasks"):
        validation_tasks(env, 500, 3, taken)


@given(st.lists(st.floats(0, 1), min_size=1, max_size=30))
def test_the_best_point_is_the_first_maximum_and_the_student_unless_beaten(scores):
    best = BestByValidation()
    kept = [best.record(step * 10, score) for step, score in enumerate(scores)]
    top = max(scores)
    assert best.best_score == top
    assert best.best_step == 10 * scores.index(top)
    summary = best.summary()
    assert summary["kept_student"] == (not any(s > scores[0] for s in scores[1:]))
    assert summary["validation_student"] == scores[0]
    assert sum(kept) == len({i for i, s in enumerate(scores) if s > max(scores[:i], default=-1)})
    assert parse_record(json.dumps(summary).encode()) == json.loads(json.dumps(summary))


def _closeness(start: dict[str, np.ndarray]):
    """A validation score every update lowers: 1 / (1 + distance of the weights from `start`),
    a real measurement of the policy that is 1 only at the student's own weights."""

    def score(policy) -> float:
        now = policy.get_weights()
        distance = sum(float(np.abs(now[k] - start[k]).sum()) for k in start)
        return 1.0 / (1.0 + distance)

    return score


def _train(env, policy, validate, steps: int = 5):
    """Real RL updates; an untrained model's rewards are all 0, so the entropy bonus is what
    moves its weights at every update."""
    cfg = RLStageConfig(steps=steps, prompts_per_step=2, max_new_tokens=8, val_every=2,
                        token=TokenRLConfig(group_size=2, lr=1e-2, ent_coef=0.1))  # fmt: skip
    return train_rl(policy, env, "test", cfg, seed=0, validate=validate)


def test_rl_that_only_worsens_validation_keeps_the_student(env):
    policy = new_policy(TINY_LM, env.tokenizer)
    student = policy.get_weights()
    metrics = _train(env, policy, _closeness(student))
    assert metrics["prompt_split"] == "rl"
    assert [step for step, _ in metrics["validation_curve"]] == [0, 2, 4, 5]
    assert metrics["validation_curve"][0][1] == 1.0
    assert all(score < 1.0 for _, score in metrics["validation_curve"][1:])
    assert metrics["kept_student"]
    assert metrics["selected_step"] == 0
    assert metrics["validation_selected"] == metrics["validation_student"] == 1.0
    assert all(np.array_equal(v, student[k]) for k, v in policy.get_weights().items())


def test_rl_that_improves_validation_keeps_its_best_update(env):
    policy = new_policy(TINY_LM, env.tokenizer)
    closeness = _closeness(policy.get_weights())
    metrics = _train(env, policy, lambda p: 1.0 - closeness(p))
    curve = metrics["validation_curve"]
    top = max(score for _, score in curve)
    assert not metrics["kept_student"]
    assert metrics["selected_step"] == next(step for step, score in curve if score == top) > 0
    assert metrics["validation_selected"] == top > metrics["validation_student"] == 0.0
    assert 1.0 - closeness(policy) == top


@given(st.binary(max_size=300))
def test_the_record_parser_takes_any_bytes(data):
    try:
        record = parse_record(data)
    except PipelineError:
        return
    assert record["validation_curve"]


@pytest.mark.parametrize(
    "record",
    [
        [],
        {"validation_curve": []},
        {"validation_curve": [[0, 2.0]], "validation_student": 0.1, "validation_selected": 0.1,
         "selected_step": 0, "kept_student": True},
        {"validation_curve": [[0, 0.1]], "validation_student": 0.1, "validation_selected": 0.1,
         "selected_step": -1, "kept_student": True},
        {"validation_curve": [[0, 0.1]], "validation_student": 0.1, "validation_selected": 0.1,
         "selected_step": 0, "kept_student": 1},
    ],
)  # fmt: skip
def test_a_malformed_record_is_refused(record):
    with pytest.raises(PipelineError, match="rerun stage rl"):
        parse_record(json.dumps(record).encode())
    with pytest.raises(PipelineError, match="more than the limit"):
        parse_record(b" " * (1 << 21))
