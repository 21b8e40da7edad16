"""The intake: bounded, stale fragments dropped and counted, every fragment accounted once."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.learner.buffer import Admission, Intake, IntakeFull
from shoal.learner.errors import LearnerError
from shoal.learner.fragment import Fragment
from shoal.learner.seqranges import SeqRanges


def fragment(
    actor: str = "a", seq: int = 0, version: int = 0, t: int = 2, n: int = 3, source: str = ""
) -> Fragment:
    z = np.zeros((t, n), np.float32)
    return Fragment(
        actor_id=actor,
        seq=seq,
        policy_version=version,
        policy_source=source,
        env_hash="h",
        obs=np.zeros((t, n, 4), np.float32),
        actions=np.zeros((t, n), np.int64),
        logprobs=z,
        values=z,
        rewards=z,
        dones=np.zeros((t, n), bool),
        truncated=np.zeros((t, n), bool),
        bootstrap_value=np.zeros(n, np.float32),
        final_values=z,
        episode_returns=np.zeros(0, np.float32),
        episode_lengths=np.zeros(0, np.int32),
    )


def test_fifo_and_step_count() -> None:
    intake = Intake(capacity=4, max_staleness=1)
    for seq in range(3):
        assert intake.offer(fragment(seq=seq)) is Admission.ACCEPTED
    assert intake.queued_steps == 18
    assert [f.seq for f in intake.take(2)] == [0, 1]
    assert intake.accounts["a"].trained == 2
    assert intake.accounts["a"].trained_steps == 12


def test_full_intake_refuses_without_counting() -> None:
    intake = Intake(capacity=1, max_staleness=0)
    intake.offer(fragment(seq=0))
    with pytest.raises(IntakeFull, match="await put"):
        intake.offer(fragment(seq=1))
    assert intake.accounts["a"].received == 1
    assert len(intake.take(1)) == 1
    assert intake.offer(fragment(seq=1)) is Admission.ACCEPTED


def test_stale_on_arrival_and_while_queued_are_counted() -> None:
    intake = Intake(capacity=8, max_staleness=1)
    intake.set_version(3)
    assert intake.offer(fragment(seq=0, version=1)) is Admission.STALE
    assert intake.offer(fragment(seq=1, version=2)) is Admission.ACCEPTED
    assert intake.offer(fragment(seq=2, version=3)) is Admission.ACCEPTED
    assert intake.set_version(4) == 1
    assert [f.seq for f in intake.take(5)] == [2]
    account = intake.accounts["a"]
    assert (account.received, account.dropped_stale, account.trained) == (3, 2, 1)


def test_a_version_from_the_future_is_stale() -> None:
    intake = Intake(capacity=8, max_staleness=3)
    intake.set_version(2)
    assert intake.offer(fragment(seq=0, version=5)) is Admission.STALE
    assert intake.accounts["a"].dropped_stale == 1


def test_duplicates_and_gaps_are_counted() -> None:
    intake = Intake(capacity=8, max_staleness=5)
    intake.offer(fragment(seq=0))
    assert intake.offer(fragment(seq=0)) is Admission.DUPLICATE
    intake.offer(fragment(seq=3))
    account = intake.accounts["a"]
    assert account.duplicates == 1
    assert account.lost == 2
    assert account.next_seq == 4


def test_version_must_not_go_back() -> None:
    intake = Intake(capacity=1, max_staleness=0)
    intake.set_version(2)
    with pytest.raises(LearnerError, match="must not go back"):
        intake.set_version(1)


def test_bad_construction_and_impossible_waits() -> None:
    with pytest.raises(LearnerError, match="capacity"):
        Intake(capacity=0, max_staleness=0)
    with pytest.raises(LearnerError, match="max_staleness"):
        Intake(capacity=1, max_staleness=-1)
    with pytest.raises(LearnerError, match=r"raise intake\.capacity"):
        asyncio.run(Intake(capacity=2, max_staleness=0).get(3))


@pytest.mark.timeout(10)
def test_put_waits_for_room_and_get_waits_for_fragments() -> None:
    async def scenario() -> list[int]:
        intake = Intake(capacity=2, max_staleness=0)
        order: list[int] = []

        async def producer() -> None:
            for seq in range(6):
                await intake.put(fragment(seq=seq))
                assert len(intake) <= 2

        async def consumer() -> None:
            while len(order) < 6:
                order.extend(f.seq for f in await intake.get(2))

        await asyncio.gather(producer(), consumer())
        return order

    assert asyncio.run(scenario()) == [0, 1, 2, 3, 4, 5]


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("offer"), st.sampled_from("abc"), st.integers(0, 12), st.integers(0, 9)),
        st.tuples(st.just("take"), st.integers(0, 4)),
        st.tuples(st.just("version"), st.integers(0, 3)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(_ops, st.integers(1, 5), st.integers(0, 3))
def test_every_fragment_is_accounted_exactly_once(ops, capacity: int, staleness: int) -> None:
    intake = Intake(capacity=capacity, max_staleness=staleness)
    trained: set[tuple[str, int]] = set()
    for op in ops:
        if op[0] == "offer":
            _, actor, seq, lag = op
            try:
                intake.offer(fragment(actor, seq, max(0, intake.version - lag + 2)))
            except IntakeFull:
                assert len(intake) == capacity
        elif op[0] == "take":
            for f in intake.take(op[1]):
                assert 0 <= intake.version - f.policy_version <= staleness
                key = (f.actor_id, f.seq)
                assert key not in trained
                trained.add(key)
        else:
            intake.set_version(intake.version + op[1])
        assert len(intake) <= capacity
        for account in intake.accounts.values():
            assert account.received == (
                account.trained + account.dropped_stale + account.duplicates + account.queued
            )
        assert sum(a.queued for a in intake.accounts.values()) == len(intake)
    assert intake.totals()["trained"] == len(trained)
    _ledger_matches_counts(intake, trained)


def _ledger_matches_counts(intake: Intake, trained: set[tuple[str, int]]) -> None:
    """The ledger names the very fragments the counters count, each seq in one kind only."""
    ledger = {
        k: {a: SeqRanges.from_json(r) for a, r in v.items()} for k, v in intake.ledger().items()
    }
    assert {(a, s) for a, r in ledger["trained"].items() for s in r} == trained
    for actor, account in intake.accounts.items():
        kinds = {k: set(ledger[k].get(actor, SeqRanges())) for k in ("trained", "stale", "queued")}
        assert len(kinds["trained"]) == account.trained
        assert len(kinds["stale"]) == account.dropped_stale
        assert len(kinds["queued"]) == account.queued
        assert not kinds["trained"] & kinds["stale"]
        assert not kinds["queued"] & (kinds["trained"] | kinds["stale"])
        assert len(ledger["duplicate"].get(actor, SeqRanges())) <= account.duplicates


def test_a_restarted_learner_counts_versions_by_lineage() -> None:
    """Resumed at version 5 as incarnation "new": the old incarnation's versions up to 5 are
    the same weights (their lag counts), its later ones branched off and are stale whatever
    their number, and the new lineage's own versions count as usual."""
    intake = Intake(capacity=8, max_staleness=4)
    intake.set_lineage("new", 5)
    intake.set_version(7)
    assert intake.offer(fragment("a", 0, version=5, source="old")) is Admission.ACCEPTED
    assert intake.offer(fragment("a", 1, version=3, source="old")) is Admission.ACCEPTED
    assert intake.offer(fragment("a", 2, version=6, source="old")) is Admission.STALE
    assert intake.offer(fragment("a", 3, version=7, source="old")) is Admission.STALE
    assert intake.offer(fragment("a", 4, version=6, source="new")) is Admission.ACCEPTED
    assert intake.offer(fragment("a", 5, version=2, source="old")) is Admission.STALE  # lag 5


@given(
    lineage=st.integers(0, 20),
    current=st.integers(0, 40),
    version=st.integers(0, 40),
    same=st.booleans(),
    staleness=st.integers(0, 8),
)
def test_staleness_by_lineage_properties(lineage, current, version, same, staleness) -> None:
    intake = Intake(capacity=1, max_staleness=staleness)
    intake.set_lineage("me", lineage)
    intake.set_version(current)
    stale = intake.is_stale(fragment(version=version, source="me" if same else "other"))
    lag = current - version
    if not 0 <= lag <= staleness:
        assert stale
    elif same or version <= lineage:
        assert not stale
    else:
        assert stale
