"""The checker accepts what a real register can produce and names what it cannot."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.chaos.errors import HistoryError
from shoal.chaos.history import HistoryRecorder, Operation
from shoal.chaos.linearizability import KeyValueModel, RegisterModel, check, check_partition


def w(client: str, value: int, invoke: float, complete: float | None, key: str = "x"):
    return Operation(client, "write", key, value, invoke, complete)


def r(client: str, value: int | None, invoke: float, complete: float, key: str = "x"):
    return Operation(client, "read", key, value, invoke, complete)


def test_stale_read_after_acknowledged_write_is_refused() -> None:
    ops = [w("a", 1, 0, 1), w("a", 2, 2, 3), r("b", 1, 4, 5)]
    result = check(ops, RegisterModel())
    assert not result.ok
    (cex,) = result.counterexamples
    assert cex.blocked == ops[2]
    assert cex.state == 2
    assert "b read x=1" in result.describe()
    assert "holds 2" in result.describe()


def test_lost_write_is_refused() -> None:
    ops = [w("a", 7, 0, 1), r("b", None, 2, 3)]
    result = check(ops)
    assert not result.ok
    assert result.counterexamples[0].blocked.kind == "read"


def test_read_of_a_never_written_value_is_refused() -> None:
    ops = [w("a", 1, 0, 5), r("b", 9, 1, 2)]
    result = check(ops)
    assert not result.ok
    assert "x=9" in result.describe()


def test_concurrent_write_may_be_seen_or_not() -> None:
    ops = [w("a", 1, 0, 1), w("a", 2, 2, 10), r("b", 2, 3, 4), r("c", 2, 5, 6)]
    assert check(ops).ok
    ops = [w("a", 1, 0, 1), w("a", 2, 2, 10), r("b", 1, 3, 4), r("c", 2, 5, 6)]
    assert check(ops).ok


def test_reads_cannot_flip_back_after_a_newer_value_was_seen() -> None:
    ops = [w("a", 1, 0, 1), w("a", 2, 2, 10), r("b", 2, 3, 4), r("c", 1, 5, 6)]
    assert not check(ops).ok


def test_pending_write_may_take_effect_late_or_never() -> None:
    never = [w("a", 1, 0, 1), w("a", 2, 2, None), r("b", 1, 50, 51)]
    assert check(never).ok
    late = [w("a", 1, 0, 1), w("a", 2, 2, None), r("b", 1, 50, 51), r("b", 2, 60, 61)]
    assert check(late).ok
    before_invoke = [w("a", 1, 0, 1), r("b", 2, 2, 3), w("a", 2, 4, None)]
    assert not check(before_invoke).ok


def test_keys_are_checked_independently() -> None:
    ops = [w("a", 1, 0, 1, "x"), w("a", 1, 0, 1, "y"), r("b", 1, 2, 3, "x"), r("b", 5, 2, 3, "y")]
    result = check(ops, KeyValueModel())
    assert result.partitions == 2
    assert [c.key for c in result.counterexamples] == ["y"]


def test_register_model_ignores_keys() -> None:
    ops = [w("a", 1, 0, 1, "x"), r("b", 1, 2, 3, "y")]
    assert check(ops, RegisterModel()).ok
    assert not check(ops, KeyValueModel()).ok


def test_bad_operations_are_refused() -> None:
    with pytest.raises(HistoryError, match="before its invocation"):
        w("a", 1, 5, 4)
    with pytest.raises(HistoryError, match="unknown"):
        Operation("a", "cas", "x", 1, 0, 1)


def test_recorder_keeps_pending_writes_drops_pending_reads_and_discards() -> None:
    ticks = iter(range(100))
    rec = HistoryRecorder(clock=lambda: float(next(ticks)))
    done = rec.invoke("a", "write", "x", 1)
    rec.complete(done)
    rec.invoke("a", "write", "x", 2)
    rec.invoke("b", "read", "x")
    refused = rec.invoke("c", "write", "x", 3)
    rec.discard(refused)
    read = rec.invoke("d", "read", "x")
    rec.complete(read, 1)
    ops = rec.operations()
    assert [(o.kind, o.value, o.pending) for o in ops] == [
        ("write", 1, False),
        ("write", 2, True),
        ("read", 1, False),
    ]
    with pytest.raises(HistoryError, match="already finished"):
        rec.complete(done)


@st.composite
def sequential_histories(draw: st.DrawFn) -> list[Operation]:
    """Operations applied one by one to a real map at points 0, 1, 2, ...; each operation's
    interval is stretched around its point at random, so intervals overlap freely. Some
    writes stay pending (took effect, answer lost), some pending writes never took effect."""
    store: dict[str, int] = {}
    ops = []
    count = draw(st.integers(1, 24))
    for point in range(count):
        key = draw(st.sampled_from("xy"))
        before = draw(st.floats(0, 3))
        after = draw(st.floats(0, 3))
        client = f"c{point}"
        if draw(st.booleans()):
            value = draw(st.integers(0, 3))
            store[key] = value
            lost = draw(st.integers(0, 4)) == 0
            ops.append(w(client, value, point - before, None if lost else point + after, key))
        else:
            ops.append(r(client, store.get(key), point - before, point + after, key))
        if draw(st.integers(0, 6)) == 0:
            ops.append(w(f"ghost{point}", 99, point - before, None, key))
    return ops


@settings(max_examples=300, deadline=None)
@given(sequential_histories())
def test_histories_of_a_real_sequential_map_are_accepted(ops: list[Operation]) -> None:
    result = check(ops, KeyValueModel())
    assert result.ok, result.describe()


def test_pending_reads_say_nothing() -> None:
    ops = [w("a", 1, 0, 1), Operation("b", "read", "x", None, 2, None)]
    assert check(ops).ok


def test_many_unseen_pending_writes_stay_cheap() -> None:
    ops = [w("a", 0, 0, 1)]
    ops += [w(f"p{i}", 100 + i, 2 + i, None) for i in range(200)]
    ops += [r("b", 0, 300, 301)]
    assert check(ops).ok
    assert not check([*ops, r("b", 5, 302, 303)]).ok


_small_ops = st.lists(
    st.builds(
        lambda kind, value, start, length, pending: Operation(
            "c",
            kind,
            "x",
            value,
            start,
            None if pending and kind == "write" else start + length,
        ),
        st.sampled_from(["read", "write"]),
        st.sampled_from([None, 1, 2]),
        st.floats(0, 10),
        st.floats(0, 4),
        st.booleans(),
    ),
    max_size=8,
)


@settings(max_examples=200, deadline=None)
@given(_small_ops)
def test_memoisation_never_changes_the_verdict(ops: list[Operation]) -> None:
    """Any small history, linearizable or not: the memoised search agrees with the plain one."""
    model = RegisterModel()
    memo = check_partition(model, "x", ops)
    plain = check_partition(model, "x", ops, memoise=False)
    assert (memo is None) == (plain is None)
