"""The checks of a learner-kill fault, pure, and its bad settings. The fault itself, on a real
training run, runs in the smoke scenario (tests/chaos/test_cli_chaos.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.chaos.invariants import fragment_accounting, resumed_from_checkpoint
from shoal.chaos.training import LearnerKillConfig
from shoal.errors import ConfigError

counts = st.integers(0, 10_000)


@given(st.lists(st.tuples(counts, counts, counts, counts), min_size=1, max_size=4))
def test_intakes_whose_parts_sum_to_received_hold(parts: list[tuple[int, ...]]) -> None:
    intakes = [
        {
            "received": sum(p),
            "trained": p[0],
            "dropped_stale": p[1],
            "duplicates": p[2],
            "queued": p[3],
        }
        for p in parts
    ]
    assert fragment_accounting(intakes).held


@given(counts, counts, st.integers(1, 50), st.sampled_from(["trained", "dropped_stale"]))
def test_a_fragment_counted_twice_or_not_at_all_breaks_the_sum(
    trained: int, dropped: int, off: int, key: str
) -> None:
    intake = {"received": trained + dropped, "trained": trained, "dropped_stale": dropped}
    for delta in (off, -off):
        bad = dict(intake, **{key: intake[key] + delta})
        if bad[key] >= 0:
            verdict = fragment_accounting([bad])
            assert not verdict.held
            assert "rank 0" in verdict.detail


def test_a_rank_without_counters_fails_the_accounting() -> None:
    assert "rank 1 recorded no intake counters" in fragment_accounting([{"received": 0}, {}]).detail


def test_resumed_from_checkpoint_needs_every_rank_back_from_a_checkpoint() -> None:
    start = {"event": "start", "process": "learner"}
    events = [
        {**start, "rank": 0, "step": 0, "resumed_from": None},
        {"event": "restart", "why": "learner-1 exited"},
        {**start, "rank": 0, "step": 12, "resumed_from": "ckpt-12"},
    ]
    assert "ranks [1] never started" in resumed_from_checkpoint(events, 2, 12).detail
    events.append({**start, "rank": 1, "step": 12, "resumed_from": "ckpt-12"})
    assert resumed_from_checkpoint(events, 2, 12).held
    assert not resumed_from_checkpoint(events, 2, 15).held
    assert "no learner restart" in resumed_from_checkpoint(events[:1], 1, None).detail


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ranks": 2, "rank": 2}, "rank=2 must be in 0..1"),
        ({"ranks": 0}, "ranks=0 must be in 1..8"),
        ({"recover_within_s": 0}, "recover_within_s=0 must be > 0"),
        ({"ranks": 2, "workers": 1}, "workers=1 must be in 2..16"),
    ],
)
def test_bad_learner_kill_settings_are_named(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LearnerKillConfig(**kwargs)
