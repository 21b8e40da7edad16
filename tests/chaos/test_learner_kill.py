"""The per-incarnation fragment accounting, pure. The faults that restart learners, on a real
training job through a cluster, run in the smoke scenario (tests/chaos/test_cli_chaos.py); the
restart checks are in test_invariants.py."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shoal.chaos.invariants import fragment_accounting

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
