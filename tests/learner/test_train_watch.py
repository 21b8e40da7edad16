"""JobWatch: when the job's state ends a run. A lone bad answer (a replica replaying its log
says the job does not exist) never does; `needed` consecutive ones do; silence only after
`patience_s` without any answer."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.cluster_train import JobWatch
from shoal.errors import ConfigError

RUNNING: dict[str, Any] = {"state": "running", "tasks": []}
FAILED: dict[str, Any] = {"state": "failed", "message": "boom", "tasks": [{"node": "n2"}]}
ANSWERS = st.sampled_from(["running", "failed", "missing"])
SHAPES: dict[str, dict[str, Any] | None] = {"running": RUNNING, "failed": FAILED, "missing": None}


@given(st.lists(ANSWERS, max_size=40), st.integers(1, 5))
def test_the_run_ends_exactly_at_the_needed_run_of_bad_answers(
    answers: list[str], needed: int
) -> None:
    watch = JobWatch(needed=needed)
    streak = 0
    for i, answer in enumerate(answers):
        streak = 0 if answer == "running" else streak + 1
        reason = watch.answer("j", SHAPES[answer], float(i))
        assert (reason is not None) == (streak >= needed)
        assert watch.doubtful == (streak > 0)


def test_the_reason_names_the_failure_or_the_missing_job() -> None:
    watch = JobWatch(needed=2)
    assert watch.answer("j", FAILED, 0.0) is None
    failed = watch.answer("j", FAILED, 0.1)
    assert failed == "job j failed: boom; read its tasks' logs on node(s) n2"
    watch = JobWatch(needed=1)
    assert watch.answer("j", None, 0.0) == "job j no longer exists on the coordinators (1 answers)"


@given(st.lists(st.floats(0.0, 200.0), min_size=1, max_size=20), st.floats(1.0, 100.0))
def test_silence_ends_the_run_only_after_patience_since_the_last_answer(
    gaps: list[float], patience: float
) -> None:
    watch = JobWatch(patience_s=patience)
    watch.answer("j", RUNNING, 0.0)
    now = 0.0
    for gap in gaps:
        now += gap
        reason = watch.silence("unreachable", now)
        assert (reason is not None) == (now >= patience)
        if reason is not None:
            assert "unreachable" in reason


def test_silence_before_any_answer_counts_from_the_first_try() -> None:
    watch = JobWatch(patience_s=10.0)
    assert watch.silence("down", 100.0) is None
    assert watch.silence("down", 109.0) is None
    assert watch.silence("down", 110.0) is not None


@pytest.mark.parametrize(("key", "value"), [("needed", 0), ("patience_s", 0.0)])
def test_bad_settings_are_refused_by_name(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=key):
        JobWatch(**{key: value})
