"""The node agent's pure pacing and ordering: the first registration retries at a steady
short period (an embedded run waits on it), later ones double; tasks stopped together stop
learner ranks first, then the rest."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from shoal.agent_policy import FIRST_REGISTRATION_PERIOD_S, registration_backoff, stop_waves

KINDS = st.sampled_from(["learner-rank", "rollout-worker", "echo"])


@given(st.integers(1, 50), st.floats(1.0, 60.0))
def test_the_first_registration_retries_at_a_steady_short_period(tries: int, most: float) -> None:
    backoff = registration_backoff(True, most)
    assert [backoff.take() for _ in range(tries)] == [FIRST_REGISTRATION_PERIOD_S] * tries


@given(st.integers(1, 30), st.floats(1.0, 60.0))
def test_later_registrations_double_up_to_the_limit(tries: int, most: float) -> None:
    backoff = registration_backoff(False, most)
    pauses = [backoff.take() for _ in range(tries)]
    assert pauses[0] == FIRST_REGISTRATION_PERIOD_S
    assert all(b == min(most, a * 2) for a, b in itertools.pairwise(pauses))
    assert max(pauses) <= most


@given(st.lists(KINDS, max_size=12))
def test_learner_ranks_stop_in_the_first_wave_and_nothing_is_lost(kinds: list[str]) -> None:
    tasks = list(enumerate(kinds))
    waves = stop_waves(tasks, lambda t: t[1])
    assert all(waves)
    assert sorted(t for wave in waves for t in wave) == tasks
    learners = [t for t in tasks if t[1] == "learner-rank"]
    if learners:
        assert waves[0] == learners
        assert all(t[1] != "learner-rank" for wave in waves[1:] for t in wave)
    else:
        assert len(waves) <= 1
