"""Countdown-v1: the generator's split rules and the exact checker, which executes nothing."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.envs.countdown import (
    HELD_OUT_DIVISOR,
    MAX_TARGET,
    CountdownEnv,
    ExpressionError,
    check,
    evaluate,
)
from shoal.envs.text_tasks import SPLITS

ENV = CountdownEnv()


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(SPLITS), st.integers(0, 2**32))
def test_every_reference_is_exactly_right_and_splits_follow_their_rules(split, seed):
    tasks = ENV.tasks(split, 10, seed)
    for task, score in zip(tasks, ENV.score_many(tasks, [t.reference for t in tasks])):
        assert (score.reward, score.status, score.passed, score.format_ok) == (1.0, "ok", 1, True)
        target, numbers = task.param("target"), task.param("numbers")
        assert 0 < target <= MAX_TARGET
        assert task.answer == str(target)
        assert len(task.prompt.encode()) < 48
        if split == "heldout_families":
            assert len(numbers) == 4
        else:
            assert len(numbers) == 3
            assert (target % HELD_OUT_DIVISOR == 0) == (split == "heldout")


def _tree():
    leaf = st.integers(0, 99).map(str)
    return st.recursive(
        leaf,
        lambda kids: st.tuples(kids, st.sampled_from("+-*"), kids).map(
            lambda t: f"({t[0]}){t[1]}({t[2]})"
        ),
        max_leaves=6,
    )


@given(_tree())
def test_the_evaluator_agrees_with_python_on_allowed_expressions(text):
    value, literals = evaluate(text)
    assert value == eval(text)  # our own generated arithmetic: trusted
    assert literals == [int(n) for n in re.findall(r"\d+", text)]


@given(st.text(max_size=200))
def test_the_checker_never_raises_and_scores_in_range(text):
    task = ENV.tasks("train", 1, 0)[0]
    score = check(task, text)
    assert 0.0 <= score.reward <= 1.0
    assert score.status in ("ok", "syntax_error")
    try:
        evaluate(text)
    except ExpressionError:
        assert score.status == "syntax_error"


HOSTILE = [
    "9**9**9",
    "__import__('os').system('echo pwned')",
    "(" * 5000 + "1" + ")" * 5000,
    "lambda: 1",
    "-3+5+2",
    "3/5",
    "[1, 2]",
    "",
    "1" * 80,
]


def test_hostile_completions_score_zero_with_a_status():
    task = ENV.tasks("train", 1, 0)[0]
    for score in ENV.score_many([task] * len(HOSTILE), HOSTILE):
        assert (score.reward, score.passed, score.status) == (0.0, 0, "syntax_error")
        assert score.message
        assert not score.format_ok


def test_wrong_numbers_or_a_wrong_value_earn_only_the_format_term():
    task = ENV.tasks("train", 1, 3)[0]
    numbers = list(task.param("numbers"))
    wrong_numbers = "+".join(str(n) for n in [*numbers, 1])
    wrong_value = "+".join(map(str, numbers)) + "\n"
    if eval(wrong_value) == task.param("target"):
        wrong_value = "*".join(map(str, numbers))
    scores = ENV.score_many([task, task], [wrong_numbers, wrong_value])
    assert scores[0].reward == pytest.approx(0.1)
    assert "each exactly once" in scores[0].message
    assert scores[1].reward == pytest.approx(0.1)
    assert scores[1].failing_test.startswith("equals")
    assert ENV.score_many([task], [task.reference.strip() + "\nrest"])[0].reward == 1.0


def test_perturbation_reorders_the_numbers_and_keeps_the_problem():
    rng = np.random.default_rng(0)
    for task in ENV.tasks("heldout_families", 30, 1):
        perturbed = ENV.perturb(task, rng)
        assert perturbed.prompt != task.prompt
        assert Counter(perturbed.param("numbers")) == Counter(task.param("numbers"))
        assert perturbed.answer == task.answer
        assert check(perturbed, perturbed.reference).reward == 1.0


def test_the_manifest_names_the_generator():
    manifest = ENV.manifest()
    assert (manifest["env"], manifest["generator"], manifest["version"]) == (
        "Countdown-v1",
        "countdown",
        1,
    )
    assert ENV.digest() == CountdownEnv().digest()
    assert ENV.digest() != CountdownEnv(max_new_tokens=8).digest()
