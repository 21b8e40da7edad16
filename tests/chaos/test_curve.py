"""The training curve's pure core: when training progressed again, thinning, recovery
statistics and the text plot."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from shoal.chaos.curve import (
    Recovery,
    Sample,
    held_to,
    incarnation_at,
    mean_return,
    plot,
    progressed_at,
    recovery_stats,
    thin,
)


def sample(t: float, version: int, steps: int, inc: str = "a") -> Sample:
    return Sample(t, steps, version, None, 0, inc)


def test_progress_needs_version_and_steps_to_rise_after_the_moment() -> None:
    samples = [sample(0, 1, 10), sample(1, 2, 20), sample(2, 2, 20), sample(3, 2, 30)]
    samples += [sample(4, 3, 40)]
    assert progressed_at(samples, 0.0) == 1
    # after t=1.5 the status first stalls, then only the steps rise, then both
    assert progressed_at(samples, 1.5) == 4
    assert progressed_at(samples, 4.0) is None


def test_progress_after_a_group_restart_must_come_from_a_new_incarnation() -> None:
    old = [sample(0, 5, 50), sample(1, 6, 60)]
    # the dead incarnation's last write rose; the new one resumed from step 3 and trained
    new = [sample(2, 7, 70), sample(3, 3, 30, "b"), sample(4, 3, 30, "b"), sample(5, 4, 35, "b")]
    samples = old + new
    assert progressed_at(samples, 1.0) == 2
    assert incarnation_at(samples, 1.5) == "a"
    assert progressed_at(samples, 1.0, "a") == 5
    assert incarnation_at(samples, -1.0) is None


@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.sampled_from("ab")), max_size=30),
    st.floats(0, 30),
)
def test_progress_is_a_rise_between_neighbours_after_the_moment(
    steps: list[tuple[int, int, str]], after: float
) -> None:
    samples, version, env_steps = [], 0, 0
    for t, (dv, ds, inc) in enumerate(steps):
        version, env_steps = version + dv, env_steps + ds
        samples.append(sample(float(t), version, env_steps, inc))
    at = progressed_at(samples, after, "a")
    if at is None:
        return
    i = int(at)
    assert at >= after
    assert i >= 1
    assert samples[i - 1].t >= after
    assert samples[i].incarnation == samples[i - 1].incarnation == "b"
    assert samples[i].version > samples[i - 1].version
    assert samples[i].env_steps > samples[i - 1].env_steps


@given(st.lists(st.floats(0, 1000, allow_nan=False), max_size=60), st.floats(0.1, 10))
def test_thin_keeps_the_first_per_period_and_the_last(times: list[float], every: float) -> None:
    samples = [sample(t, 0, 0) for t in sorted(times)]
    kept = thin(samples, every)
    assert len(kept) <= len(samples)
    if samples:
        assert kept[0] is samples[0]
        assert kept[-1] is samples[-1]
    gaps = [b.t - a.t for a, b in itertools.pairwise(kept[:-1])]
    assert all(g >= every for g in gaps)


def test_recovery_stats_per_kind_and_overall() -> None:
    records = [
        {"kind": "kill", "recovery_s": 1.0, "recovered": True},
        {"kind": "kill", "recovery_s": 3.0, "recovered": True},
        {"kind": "learner-kill", "recovery_s": 12.0, "recovered": True},
        {"kind": "learner-kill", "recovery_s": None, "recovered": False},
    ]
    stats = recovery_stats(records)
    assert stats["kill"] == {"faults": 2, "p50_s": 2.0, "max_s": 3.0, "unrecovered": 0}
    assert stats["learner-kill"]["p50_s"] == 12.0
    assert stats["learner-kill"]["unrecovered"] == 1
    assert stats["all"] == {"faults": 4, "p50_s": 3.0, "max_s": 12.0, "unrecovered": 1}
    assert recovery_stats([])["all"]["p50_s"] is None


def test_mean_return_skips_non_finite() -> None:
    assert mean_return([]) is None
    assert mean_return([1.0, 3.0, float("nan")]) == 2.0


def test_plot_marks_faults_and_spans_the_values() -> None:
    samples = [sample(float(t), t * 10, t) for t in range(0, 41, 2)]
    lines = plot(samples, [10.0, 30.0], "version", width=41, height=5)
    assert lines[0].startswith("400 |")
    assert lines[4].startswith("  0 |")
    marks = lines[6]
    assert marks.count("^") == 2
    assert marks.index("^") < marks.rindex("^")
    body = lines[:5]
    # one point per column: a gap between samples shows the last value (a step plot)
    columns = ["".join(row[row.index("|") + 1 + c] for row in body) for c in range(41)]
    assert all(col.count("*") == 1 for col in columns)
    assert plot([], [1.0]) == ["(no training samples)"]
    assert plot(samples, [], "mean_return") == ["(no mean_return samples)"]


def test_a_group_restart_before_training_recovered_masks_the_earlier_fault() -> None:
    """The smoke scenario's chain: a leader kill whose recovery a learner kill interrupts, a
    learner kill a node kill interrupts; the node kill recovers on its own."""
    chain = [
        Recovery(injected_at=2.0, bound_s=63.0, progress_s=58.8, restarts_group=False),
        Recovery(injected_at=5.0, bound_s=60.0, progress_s=55.8, restarts_group=True),
        Recovery(injected_at=16.0, bound_s=70.0, progress_s=44.8, restarts_group=True),
        Recovery(injected_at=28.0, bound_s=62.0, progress_s=32.8, restarts_group=False),
    ]
    assert held_to(chain) == [(1, 84.0), (2, 81.0), (None, 70.0), (None, 62.0)]


def test_a_fault_training_recovered_from_before_the_next_is_held_to_its_own_bound() -> None:
    recovered_first = [
        Recovery(injected_at=2.0, bound_s=10.0, progress_s=3.0, restarts_group=True),
        Recovery(injected_at=8.0, bound_s=60.0, progress_s=50.0, restarts_group=True),
    ]
    assert held_to(recovered_first) == [(None, 10.0), (None, 60.0)]


def test_a_fault_that_never_recovered_is_masked_only_by_a_later_group_restart() -> None:
    never = [
        Recovery(injected_at=1.0, bound_s=5.0, progress_s=None, restarts_group=False),
        Recovery(injected_at=3.0, bound_s=5.0, progress_s=None, restarts_group=False),
    ]
    assert held_to(never) == [(None, 5.0), (None, 5.0)]


recoveries = st.lists(
    st.builds(
        Recovery,
        injected_at=st.floats(0.0, 100.0),
        bound_s=st.floats(0.0, 100.0),
        progress_s=st.none() | st.floats(0.0, 200.0),
        restarts_group=st.booleans(),
    ),
    max_size=12,
)


@given(recoveries)
def test_masking_only_extends_bounds_and_every_chain_ends_on_its_own(
    faults: list[Recovery],
) -> None:
    held = held_to(faults)
    assert len(held) == len(faults)
    for fault, (masker, bound) in zip(faults, held, strict=True):
        assert bound >= fault.bound_s - 1e-3
        if masker is None:
            assert bound == round(fault.bound_s, 3)
            continue
        later = faults[masker]
        assert later.restarts_group
        assert later.injected_at > fault.injected_at
        if fault.progress_s is not None:
            assert later.injected_at < fault.injected_at + fault.progress_s
        chained = max(fault.injected_at + fault.bound_s, later.injected_at + held[masker][1])
        assert abs(fault.injected_at + bound - chained) < 1e-2
