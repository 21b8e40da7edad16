"""`fragment_ledger`, the cross-restart accounting, on histories built to hold and then broken
in the ways the issue names (a seq both trained and dropped, an acknowledged seq missing)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from shoal.chaos.invariants import fragment_ledger
from shoal.learner.seqranges import SeqRanges

FATES = ("trained", "stale", "queued")


def ranges(seqs: list[int]) -> list[list[int]]:
    return SeqRanges((s, s + 1) for s in seqs).to_json()


@st.composite
def histories(draw: st.DrawFn) -> dict[str, Any]:
    """One actor, a dead learner incarnation then a final one: seqs [0, kill) went to the
    dead one (the last maybe in flight), [kill, n) to the final one; the dead one's checkpoint
    holds what it trained below `cut`."""
    n = draw(st.integers(1, 40))
    kill = draw(st.integers(0, n))
    cut = draw(st.integers(0, kill))
    in_flight = kill > 0 and draw(st.booleans())
    dead_fates = [draw(st.sampled_from(FATES)) for _ in range(kill)]
    final_fates = [draw(st.sampled_from(FATES)) for _ in range(kill, n)]
    dead = {f: [s for s, x in enumerate(dead_fates) if x == f] for f in FATES}
    final = {f: [kill + i for i, x in enumerate(final_fates) if x == f] for f in FATES}
    base = [s for s in dead["trained"] if s < cut]
    acked_dead = [s for s in range(kill - 1 if in_flight else kill)]
    return {
        "rollout": {
            "actor_id": "a#1",
            "sent": [[0, n]] if n else [],
            "acked": {
                "dead": {"accepted": ranges(acked_dead)},
                "fin": {"accepted": ranges(list(range(kill, n)))},
            },
        },
        "dead": {
            "incarnation": "dead",
            "final": False,
            "base": {},
            **{f: {"a#1": ranges(dead[f])} for f in FATES},
        },
        "final": {
            "incarnation": "fin",
            "final": True,
            "base": {"a#1": ranges(base)},
            **{f: {"a#1": ranges(final[f])} for f in FATES},
        },
        "checkpoint": {"a#1": ranges(sorted(base + final["trained"]))},
    }


def check(h: dict[str, Any]) -> Any:
    return fragment_ledger([h["rollout"]], [h["dead"], h["final"]], h["checkpoint"])


@given(histories())
def test_a_consistent_history_across_a_restart_holds(h: dict[str, Any]) -> None:
    verdict = check(h)
    assert verdict.held, verdict.detail
    assert "accounted once" in verdict.detail


@given(histories(), st.data())
def test_a_seq_both_trained_and_dropped_is_named(h: dict[str, Any], data: st.DataObject) -> None:
    trained = list(SeqRanges.from_json(h["final"]["trained"]["a#1"]))
    if not trained:
        return
    seq = data.draw(st.sampled_from(trained))
    stale = SeqRanges.from_json(h["final"]["stale"]["a#1"])
    stale.add(seq)
    h["final"]["stale"]["a#1"] = stale.to_json()
    verdict = check(h)
    assert not verdict.held
    assert f"actor a#1 seq {seq} both trained" in verdict.detail


@given(histories(), st.data())
def test_an_acknowledged_seq_missing_is_named(h: dict[str, Any], data: st.DataObject) -> None:
    gone = list(SeqRanges.from_json(h["final"]["queued"]["a#1"]))
    if not gone:
        return
    seq = data.draw(st.sampled_from(gone))
    h["final"]["queued"]["a#1"] = ranges([s for s in gone if s != seq])
    verdict = check(h)
    assert not verdict.held
    assert f"actor a#1 seq {seq} acknowledged (accepted) by final incarnation fin" in verdict.detail


def test_rolled_back_and_in_flight_are_counted_not_lost() -> None:
    rollout = {
        "actor_id": "a",
        "sent": [[0, 6]],
        "acked": {"d": {"accepted": [[0, 4]]}, "f": {"accepted": [[5, 6]]}},
    }
    dead = {"incarnation": "d", "final": False, "trained": {"a": [[0, 4]]}}
    final = {"incarnation": "f", "final": True, "base": {"a": [[0, 2]]}, "trained": {"a": [[5, 6]]}}
    verdict = fragment_ledger([rollout], [dead, final], {"a": [[0, 2], [5, 6]]})
    assert verdict.held, verdict.detail
    assert "3 trained" in verdict.detail
    assert "2 rolled back" in verdict.detail
    assert "1 in flight" in verdict.detail


def test_a_final_checkpoint_that_disagrees_is_named() -> None:
    final = {"incarnation": "f", "final": True, "base": {"a": [[0, 2]]}, "trained": {"a": [[2, 3]]}}
    verdict = fragment_ledger([], [final], {"a": [[0, 2]]})
    assert not verdict.held
    assert "actor a: the final checkpoint holds" in verdict.detail


def test_a_run_that_never_stopped_or_garbled_ledgers_fail_with_a_reason() -> None:
    assert "never stopped" in fragment_ledger([], [{"incarnation": "d", "final": False}]).detail
    bad = {"incarnation": "f", "final": True, "trained": {"a": "0-3"}}
    assert "malformed accounting ledger" in fragment_ledger([], [bad]).detail
