"""CodeGen-v1: the seeded generator's invariants, and scoring through the real sandbox."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.envs.code_scoring import body_format_ok
from shoal.envs.codegen import (
    FAMILIES,
    HELD_OUT_VALUES,
    POOL_SPLITS,
    RL_VALUES,
    VALIDATION_VALUES,
    VALUE_SETS,
    CodeGenEnv,
    split_pools,
)
from shoal.envs.sandbox import SandboxPool
from shoal.envs.text_tasks import SPLITS, TextEnvError, TextTask, cut_at_stop, reward_of

MAX_PROMPT_BYTES = 160
ALL_SPLITS = (*SPLITS, *POOL_SPLITS)
VALUE_SPLITS = ("train", "heldout", "validation", "rl")
"""The splits of train families, each with its own parameter values."""


@pytest.fixture(scope="module")
def env():
    with CodeGenEnv(workers=2) as made:
        yield made


def _run_reference(task: TextTask, body: str | None = None) -> list[object]:
    """Our own generated reference (or a trivial body of ours), executed in-process (trusted
    code) for the pure checks."""
    scope: dict[str, object] = {}
    exec(task.prompt + (task.reference if body is None else body), scope)
    entry = scope[task.entry]
    return [eval(test.call, {task.entry: entry}) for test in task.tests]


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(ALL_SPLITS), st.integers(0, 2**32))
def test_generated_tasks_are_short_regular_and_their_references_are_right(split, seed):
    tasks = CodeGenEnv().tasks(split, 12, seed)
    for task in tasks:
        assert len(task.prompt.encode()) < MAX_PROMPT_BYTES, task.prompt
        assert task.prompt.startswith("def f(")
        assert task.prompt.endswith("\n")
        assert 15 <= len(task.reference) <= 80
        assert task.reference.startswith("    return ")
        assert len(task.tests) == 5
        assert len({t.call for t in task.tests}) == 5
        for test in task.tests:  # the hidden tests are never the two shown examples
            assert f"{test.call}=" not in task.prompt
        expected = [t.expected for t in task.tests]
        assert _run_reference(task) == expected
        assert body_format_ok(task.prompt, task.reference, task.entry)
        for trivial in (task.param("arg"), str(task.param("k"))):  # the tests tell them apart
            assert _run_reference(task, f"    return {trivial}\n") != expected, task


def test_the_same_seed_gives_the_same_tasks_and_another_seed_others():
    env = CodeGenEnv()
    assert env.tasks("train", 20, 5) == env.tasks("train", 20, 5)
    assert env.tasks("train", 20, 5) != env.tasks("train", 20, 6)
    assert env.tasks("train", 20, 5) != env.tasks("heldout", 20, 5)


def test_held_out_splits_share_nothing_with_train():
    env = CodeGenEnv()
    train = env.tasks("train", 2000, 0)
    heldout = env.tasks("heldout", 500, 0)
    families = env.tasks("heldout_families", 500, 0)
    train_pairs = {(t.family, t.param("k")) for t in train}
    assert not train_pairs & {(t.family, t.param("k")) for t in heldout}
    assert all(t.param("k") in HELD_OUT_VALUES for t in heldout)
    assert not {t.family for t in train} & {t.family for t in families}
    assert {t.family for t in heldout} <= {t.family for t in train}
    prompts = {t.prompt for t in train}
    assert not prompts & {t.prompt for t in heldout + families}
    assert {t.family for t in train} == {f.name for f in FAMILIES if not f.heldout}
    assert {t.family for t in families} == {f.name for f in FAMILIES if f.heldout}
    assert 6 <= len(FAMILIES) <= 10
    assert sum(f.heldout for f in FAMILIES) == 2


def test_the_value_sets_are_disjoint_and_the_test_and_validation_ask_the_same_families():
    sets = list(VALUE_SETS.values())
    assert sum(len(s) for s in sets) == len(frozenset().union(*sets))
    assert tuple(sets) == (HELD_OUT_VALUES, VALIDATION_VALUES, RL_VALUES)
    families = {split: [f.name for f, _ in split_pools(split)] for split in VALUE_SPLITS}
    assert families["validation"] == families["heldout"]
    assert set(families["rl"]) == set(families["heldout"])
    assert set(families["heldout"]) < set(families["train"])
    assert len(VALIDATION_VALUES) == len(HELD_OUT_VALUES)


def _digits(values) -> set[tuple[int, str]]:
    return {(place, digit) for v in values if v >= 10 for place, digit in enumerate(str(v))}


def test_every_reserved_value_combines_digits_train_uses_in_the_same_places():
    """A model that copies k digit by digit can reach each reserved value: every (place, digit)
    of a held-out, validation or rl value is in some two-digit train value."""
    train = set().union(*(values for _, values in split_pools("train")))
    assert _digits(frozenset().union(*VALUE_SETS.values())) <= _digits(train)
    assert all(v >= 10 for values in VALUE_SETS.values() for v in values)


@settings(max_examples=20, deadline=None)
@given(
    st.sampled_from(VALUE_SPLITS),
    st.sampled_from(VALUE_SPLITS),
    st.integers(0, 2**32),
    st.integers(0, 2**32),
)
def test_two_value_splits_never_share_a_family_and_value_or_a_prompt(one, other, seed, seed2):
    env = CodeGenEnv()
    a, b = env.tasks(one, 200, seed), env.tasks(other, 200, seed2)
    for split, tasks in ((one, a), (other, b)):
        reserved = VALUE_SETS.get(split)
        for task in tasks:
            k = task.param("k")
            if reserved is None:
                assert all(k not in values for values in VALUE_SETS.values()), task.id
            else:
                assert k in reserved, task.id
    if one != other:
        assert not {(t.family, t.param("k")) for t in a} & {(t.family, t.param("k")) for t in b}
        assert not {t.prompt for t in a} & {t.prompt for t in b}


def test_pool_splits_are_not_test_splits_and_draw_on_their_own_streams():
    env = CodeGenEnv()
    assert not set(POOL_SPLITS) & set(env.splits)
    assert env.tasks("rl", 20, 4) == env.tasks("rl", 20, 4) != env.tasks("rl", 20, 5)
    assert env.tasks("validation", 20, 4) != env.tasks("rl", 20, 4)
    for bad in ({"count": 0}, {"count": True}, {"seed": -1}, {"seed": 1.5}):
        with pytest.raises(TextEnvError, match="expected an integer"):
            env.tasks("rl", **{"count": 3, "seed": 0, **bad})


@pytest.mark.timeout(120)
def test_every_reference_scores_one_in_the_sandbox_in_every_split_and_family(env):
    tasks = [t for split in ALL_SPLITS for t in env.tasks(split, 40, 3)]
    rng = np.random.default_rng(0)
    tasks += [env.perturb(t, rng) for t in tasks[::4]]
    assert {t.family for t in tasks} == {f.name for f in FAMILIES}
    scores = env.score_many(tasks, [t.reference for t in tasks])
    bad = [(t.id, s) for t, s in zip(tasks, scores) if s.reward != 1.0]
    assert not bad
    assert all(s.status == "ok" and s.passed == s.total == 5 and s.format_ok for s in scores)
    assert all(s.failing_test is None for s in scores)


HOSTILE = {
    "infinite loop": "    while True:\n        pass\n",
    "huge output": "    print('x' * 10**7)\n    return x + 3\n",
    "syntax error": "    return (x +\n",
    "os.system": "    import os\n    os.system('echo pwned > /tmp/pwned')\n",
    "fork bomb": "    import os\n    while True:\n        os.fork()\n",
    "memory hog": "    a = [0] * 10**10\n    return a\n",
    "exit at import": "    pass\nraise SystemExit(0)\n",
    "dedent": "return x + 3\n",
    "lone surrogate": "    return '\ud800'\n",
    "nul byte": "    return 1\x00\n",
    "too long": "    return " + "(" * 3000 + ")" * 3000 + "\n",
    "empty": "",
}
RAISING = {
    "exit": ("    raise SystemExit(0)\n", "SystemExit"),
    "recursion": ("    return f(x)\n", "RecursionError"),
}


@pytest.mark.timeout(120)
def test_hostile_completions_score_zero_with_a_status_and_never_raise(env):
    task = next(t for t in env.tasks("train", 50, 0) if t.family == "add")
    names = list(HOSTILE)
    scores = env.score_many([task] * len(names), [HOSTILE[n] for n in names])
    for name, score in zip(names, scores):
        assert score.reward == 0.0, (name, score)
        assert score.status, (name, score)
        assert score.message, (name, score)
        assert score.passed == 0
        assert score.total == 5
        assert score.failing_test is not None
    by_name = dict(zip(names, scores))
    assert by_name["infinite loop"].status in ("timeout", "cpu_limit")
    assert by_name["huge output"].status == "output_limit"
    assert by_name["syntax error"].status == "syntax_error"
    assert not by_name["os.system"].format_ok


@pytest.mark.timeout(60)
def test_a_function_that_raises_fails_its_tests_naming_the_exception(env):
    """It is a well-formed wrong answer: at most the format term."""
    task = next(t for t in env.tasks("train", 50, 0) if t.family == "add")
    scores = env.score_many([task] * len(RAISING), [body for body, _ in RAISING.values()])
    for (_, error), score in zip(RAISING.values(), scores):
        assert (score.status, score.passed, score.reward) == ("ok", 0, pytest.approx(0.1))
        assert error in score.failing_test


@pytest.mark.timeout(60)
def test_the_format_term_and_partial_credit_follow_the_documented_formula(env):
    task = next(t for t in env.tasks("train", 50, 0) if t.family == "min")
    k = task.param("k")
    wrong, partial = "    return 'no'\n", f"    return {k}\n"
    scores = env.score_many([task] * 3, [wrong, partial, task.reference + "\n\nignored"])
    passed = scores[1].passed
    assert scores[0].reward == pytest.approx(0.1)
    assert scores[0].format_ok
    assert scores[0].failing_test.startswith("f(")
    assert "expected" in scores[0].failing_test
    assert scores[1].reward == pytest.approx(0.9 * passed / 5 + 0.1)
    assert scores[2].reward == 1.0  # the text after the stop string is cut off
    too_long = env.score_many([task], ["    " + "#" * 5000 + "\n"])[0]
    assert (too_long.status, too_long.reward) == ("too_long", 0.0)


@pytest.mark.timeout(60)
def test_one_score_many_is_one_run_many_call(env, monkeypatch):
    calls = []
    real = SandboxPool.run_many

    def counting(self, episodes, timeout=None):
        calls.append(len(episodes))
        return real(self, episodes, timeout)

    monkeypatch.setattr(SandboxPool, "run_many", counting)
    tasks = env.tasks("train", 24, 9)
    env.score_many(tasks, [t.reference for t in tasks])
    assert calls == [24]


def test_perturbation_keeps_the_tests_and_changes_the_prompt():
    env = CodeGenEnv()
    rng = np.random.default_rng(1)
    for task in env.tasks("train", 50, 2):
        perturbed = env.perturb(task, rng)
        assert perturbed.prompt != task.prompt
        assert perturbed.tests == task.tests
        assert perturbed.family == task.family
        assert _run_reference(perturbed) == [t.expected for t in task.tests]


def test_bad_requests_name_what_is_valid():
    env = CodeGenEnv()
    with pytest.raises(TextEnvError, match="no split 'test'"):
        env.tasks("test", 3)
    with pytest.raises(TextEnvError, match="count=0"):
        env.tasks("train", 0)
    task = env.tasks("train", 1)[0]
    with pytest.raises(TextEnvError, match="one task per completion"):
        env.score_many([task], [])
    with pytest.raises(TextEnvError, match="completions are str"):
        env.score_many([task], [b"    return 1\n"])
    assert env.score_many([], []) == []


def test_spaces_and_manifest_describe_a_causal_lm_environment():
    env = CodeGenEnv(max_new_tokens=48)
    assert env.observation_space.shape == (192 + 48,)
    assert env.observation_space.dtype == np.int64
    assert env.action_space.n == 259
    manifest = env.manifest()
    assert (manifest["generator"], manifest["version"]) == ("codegen", 2)
    assert manifest["params"]["validation_values"] == sorted(VALIDATION_VALUES)
    assert manifest["params"]["rl_values"] == sorted(RL_VALUES)
    assert len(manifest["params"]["families"]) == len(FAMILIES)
    assert env.digest() == CodeGenEnv(max_new_tokens=48).digest()
    assert env.digest() != CodeGenEnv(max_new_tokens=64).digest()
    assert all(len(env.prompt_ids(t)) < MAX_PROMPT_BYTES for t in env.tasks("train", 50))


def test_tasks_survive_a_json_round_trip_and_bad_records_are_refused():
    import json

    from shoal.envs.text_tasks import BadTask, task_from_dict, task_to_dict

    env = CodeGenEnv()
    tasks = [t for split in SPLITS for t in env.tasks(split, 10, 4)]
    back = [task_from_dict(json.loads(json.dumps(task_to_dict(t)))) for t in tasks]
    assert back == tasks
    assert env.perturb(back[0], np.random.default_rng(0)).tests == tasks[0].tests
    record = task_to_dict(tasks[0])
    for broken in (
        [],
        {**record, "prompt": 5},
        {**record, "tests": [["f(1)"]]},
        {**record, "id": "x" * 70000},
    ):
        with pytest.raises(BadTask):
            task_from_dict(broken)


@given(st.text(max_size=300))
def test_the_format_check_never_raises_and_rejects_what_is_not_a_body(body):
    prompt = "def f(x):\n    # return x plus 1\n"
    ok = body_format_ok(prompt, body, "f")
    if ok:
        assert all(line.startswith((" ", "\t")) for line in body.splitlines() if line.strip())
        assert "import" in body or "__" not in body


@given(st.text(max_size=100), st.lists(st.text(min_size=1, max_size=3), max_size=3))
def test_cutting_at_a_stop_keeps_a_prefix_that_holds_at_most_one_stop_at_its_end(text, stops):
    cut = cut_at_stop(text, stops)
    assert text.startswith(cut)
    inner = cut[:-1]
    assert not any(stop in inner for stop in stops)


@given(st.integers(0, 50), st.integers(1, 50), st.booleans(), st.sampled_from(["ok", "timeout"]))
def test_the_reward_is_in_range_and_one_only_for_a_full_pass_in_format(passed, total, fmt, status):
    passed = min(passed, total)
    reward = reward_of(passed, total, status, fmt)
    assert 0.0 <= reward <= 1.0
    assert (reward == 1.0) == (status == "ok" and passed == total and fmt)
    if status != "ok":
        assert reward == 0.0


def test_a_body_with_a_syntax_warning_is_scored_without_printing_it() -> None:
    """`1x` makes the parser warn: the model's output is judged, never echoed on the console."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not body_format_ok("def f(x):\n", "    return 1x\n", "f")
