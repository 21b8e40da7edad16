"""pass@k: the unbiased estimator's properties, and split evaluation with its failure breakdown."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.learner.lm_eval import (
    EvalError,
    SplitResult,
    clustered_standard_error,
    compare,
    evaluate_split,
    paired_difference,
    pass_at_k,
    tasks_digest,
    write_report,
)

counts = st.integers(1, 30).flatmap(
    lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))
)


@given(counts)
def test_pass_at_k_is_the_closed_form(nck):
    n, c, k = nck
    expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@given(counts)
def test_pass_at_k_is_monotone_and_bounded(nck):
    n, c, k = nck
    value = pass_at_k(n, c, k)
    assert 0.0 <= value <= 1.0
    if k < n:
        assert pass_at_k(n, c, k + 1) >= value - 1e-12
    if c < n:
        assert pass_at_k(n, c + 1, k) >= value - 1e-12
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    assert (value == 0.0) == (c == 0)


@given(st.integers(1, 7).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))))
@settings(max_examples=30)
def test_pass_at_k_is_unbiased_over_every_subset(nc):
    """The estimator equals the fraction of k-subsets of the n samples holding a pass."""
    n, c = nc
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets))


@pytest.mark.parametrize(("n", "c", "k"), [(0, 0, 1), (3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)])
def test_impossible_counts_are_refused(n, c, k):
    with pytest.raises(EvalError, match="pass_at_k needs"):
        pass_at_k(n, c, k)


@pytest.fixture(scope="module")
def codegen():
    from shoal.envs.text_registry import make_text_env

    env = make_text_env("CodeGen-v1")
    yield env
    env.close()


def test_a_split_scores_every_sample_and_breaks_failures_down(codegen, tmp_path):
    tasks = codegen.tasks("heldout", 4, seed=1)
    wrong = {0: "    return (\n", 1: "    return 0\n", 2: "    while True:\n        pass\n"}

    def sample(batch, n):
        return [[t.reference if i == 3 else wrong[i] for i in range(n)] for t in batch]

    result = evaluate_split(codegen, "heldout", tasks, sample, n=4, ks=(1, 2, 4))
    assert (result.tasks, result.samples_per_task) == (4, 4)
    assert result.pass_at["1"] == pytest.approx(0.25)
    assert result.pass_at["4"] == pytest.approx(1.0)
    assert result.outcomes["passed"] == 4
    assert result.passes == [1, 1, 1, 1]
    assert result.pass_at_1_se == 0.0  # every task at 0.25
    assert result.outcomes["syntax_error"] == 4
    assert result.outcomes.get("timeout", 0) + result.outcomes.get("cpu_limit", 0) == 4
    assert sum(result.outcomes.values()) == 16
    assert result.outcomes.get("wrong_answer", 0) <= 4  # `return 0` passes a test that wants 0
    assert {e["outcome"] for e in result.examples} <= set(result.outcomes) - {"passed"}
    json_path, html_path = write_report({"rl": {"heldout": result}}, {"env_id": "CodeGen-v1"},
                                        tmp_path)  # fmt: skip
    report = json.loads(json_path.read_text())
    assert report["policies"]["rl"]["heldout"]["outcomes"] == result.outcomes
    page = html_path.read_text()
    assert "pass@1" in page
    assert "syntax_error" in page
    assert "<script" not in page


def test_the_standard_error_is_over_tasks_and_passes_are_in_task_order(codegen):
    tasks = codegen.tasks("heldout", 3, seed=2)
    good = {tasks[0].id, tasks[2].id}

    def sample(batch, n):
        return [[t.reference if t.id in good else "    return 0\n"] * n for t in batch]

    result = evaluate_split(codegen, "heldout", tasks, sample, n=2, ks=(1,))
    assert result.passes == [2, 0, 2]
    assert result.pass_at_1_se == pytest.approx(np.std([1, 0, 1], ddof=1) / np.sqrt(3))


def test_a_sampler_that_drops_samples_is_refused(codegen):
    tasks = codegen.tasks("heldout", 2, seed=1)
    with pytest.raises(EvalError, match="2 completions for each of 2 tasks"):
        evaluate_split(codegen, "heldout", tasks, lambda ts, n: [["x"]] * len(ts), n=2, ks=(1,))
    with pytest.raises(EvalError, match="every k"):
        evaluate_split(codegen, "heldout", tasks, lambda ts, n: [["x"] * n] * len(ts), 2, (3,))


def _result(passes, n, digest="d", split="heldout", families=()):
    return SplitResult(
        split=split, tasks=len(passes), samples_per_task=n,
        pass_at={"1": sum(passes) / n / max(1, len(passes))}, mean_reward=0.0, format_rate=1.0,
        outcomes={}, family_pass_at_1={}, passes=list(passes), tasks_digest=digest,
        families=list(families),
    )  # fmt: skip


values = st.lists(st.floats(-1, 1), min_size=2, max_size=40)


@given(values)
def test_one_cluster_per_value_is_the_plain_standard_error(xs):
    plain = np.std(xs, ddof=1) / math.sqrt(len(xs))
    clustered = clustered_standard_error(xs, [str(i) for i in range(len(xs))])
    assert clustered == pytest.approx(plain, abs=1e-12)


@given(
    values.flatmap(
        lambda xs: st.tuples(
            st.just(xs), st.lists(st.sampled_from("abcd"), min_size=len(xs), max_size=len(xs))
        )
    )
)
def test_a_clustered_error_ignores_labels_and_scales_with_the_values(case):
    xs, labels = case
    se = clustered_standard_error(xs, labels)
    if len(set(labels)) < 2:
        assert math.isnan(se)
        return
    renamed = clustered_standard_error(xs, [label.upper() for label in labels])
    assert renamed == pytest.approx(se, abs=1e-12)
    assert clustered_standard_error([3 * x for x in xs], labels) == pytest.approx(3 * se, abs=1e-9)
    assert se >= 0.0


def test_a_family_that_moves_together_widens_the_clustered_error():
    """Two families, each all gain or all loss: per task it looks certain, by family it is two
    draws."""
    deltas = [0.5] * 10 + [-0.25] * 10
    families = ["add"] * 10 + ["sub"] * 10
    clustered = clustered_standard_error(deltas, families)
    assert clustered == pytest.approx(math.sqrt(2 * (3.75**2 + 3.75**2)) / 20)  # 0.375
    assert clustered > 4 * np.std(deltas, ddof=1) / math.sqrt(20)


paired_passes = st.integers(1, 8).flatmap(
    lambda n: st.tuples(
        st.just(n),
        st.lists(st.tuples(st.integers(0, n), st.integers(0, n)), min_size=1, max_size=60),
    )
)


@given(paired_passes)
def test_a_paired_difference_is_the_difference_of_the_means_task_by_task(case):
    n, pairs = case
    ours, theirs = _result([a for a, _ in pairs], n), _result([b for _, b in pairs], n)
    d = paired_difference("rl", ours, "student", theirs)
    assert d.difference == pytest.approx(ours.pass_at["1"] - theirs.pass_at["1"], abs=1e-12)
    assert d.tasks == len(pairs)
    assert d.better == sum(a > b for a, b in pairs)
    assert d.worse == sum(a < b for a, b in pairs)
    back = paired_difference("student", theirs, "rl", ours)
    assert back.difference == pytest.approx(-d.difference, abs=1e-12)
    if len(pairs) == 1:
        assert math.isnan(d.se)
    else:
        deltas = [(a - b) / n for a, b in pairs]
        assert d.se == pytest.approx(np.std(deltas, ddof=1) / math.sqrt(len(pairs)), abs=1e-12)
    same = paired_difference("rl", ours, "rl", ours)
    assert (same.difference, same.better, same.worse) == (0.0, 0, 0)
    assert math.isnan(d.se_by_family)  # no families recorded: one cluster


def test_results_on_other_tasks_are_not_compared():
    with pytest.raises(EvalError, match="not evaluated on the same heldout tasks"):
        paired_difference("rl", _result([1, 2], 4, "a"), "student", _result([1, 2], 4, "b"))
    with pytest.raises(EvalError, match="no per-task passes"):
        paired_difference("rl", _result([], 4), "student", _result([], 4))
    assert tasks_digest(["a", "b"]) != tasks_digest(["b", "a"])


def test_the_report_compares_rl_with_the_student_and_the_student_with_the_teacher(tmp_path):
    families = ("add", "add", "sub")
    results = {
        "teacher": {"heldout": _result([4, 4, 2], 4, families=families)},
        "student": {"heldout": _result([2, 1, 2], 4, families=families)},
        "rl": {"heldout": _result([4, 0, 3], 4, families=families), "train_dist": _result([4], 4)},
    }
    pairs = [(d.policy, d.baseline, d.split) for d in compare(results)]
    assert pairs == [("rl", "student", "heldout"), ("student", "teacher", "heldout")]
    json_path, html_path = write_report(results, {"env_id": "CodeGen-v1"}, tmp_path)
    first = json.loads(json_path.read_text())["comparisons"][0]
    assert first["difference"] == pytest.approx((2 / 4 - 1 / 4 + 1 / 4) / 3)
    assert (first["better"], first["worse"], first["families"]) == (2, 1, 2)
    assert first["se_by_family"] == pytest.approx(
        clustered_standard_error([0.5, -0.25, 0.25], families)
    )
    assert "pass@1 differences, task by task" in html_path.read_text()
    alone, _ = write_report({"rl": results["rl"]}, {}, tmp_path / "alone")
    assert json.loads(alone.read_text())["comparisons"] == []
