"""Is a recorded history linearizable? Wing and Gong's search with Lowe's memoisation, as
Porcupine does it.

The history becomes a list of call and return events in time order. The search walks it: at a
call it tries to let that operation take effect now (the model must accept it); at a return
whose call was not linearized yet it backtracks, because that operation must have taken effect
before it returned. A cache of (set of linearized operations, model state) prunes every
configuration already explored, which keeps real histories of a few clients polynomial.
Operations on different keys never interact, so the key-value model checks each key on its own
(P-compositionality). A pending operation returns "at infinity": it may take effect any time
after its call, or never (taking effect after everything else is unobservable).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from shoal.chaos.history import Operation


class RegisterModel:
    """A single register: reads return the last value written (None before any write)."""

    initial: Hashable = None

    def step(self, state: Hashable, op: Operation) -> tuple[bool, Hashable]:
        if op.kind == "write":
            return True, op.value
        return op.value == state, state

    def partition(self, ops: Sequence[Operation]) -> dict[str, list[Operation]]:
        return {"register": list(ops)}

    def prune(self, ops: Sequence[Operation]) -> list[Operation]:
        """Drop pending reads (they observed nothing) and pending writes whose value no read
        returned. Such a write may always be linearized last, where nobody sees it, so
        dropping it changes no verdict; keeping it doubles the search for every one of them
        (a chaos run leaves many)."""
        seen = {op.value for op in ops if op.kind == "read" and not op.pending}
        return [op for op in ops if not op.pending or (op.kind == "write" and op.value in seen)]


class KeyValueModel(RegisterModel):
    """A map of independent registers, checked key by key."""

    def partition(self, ops: Sequence[Operation]) -> dict[str, list[Operation]]:
        parts: dict[str, list[Operation]] = {}
        for op in ops:
            parts.setdefault(op.key, []).append(op)
        return parts


@dataclass(frozen=True)
class Counterexample:
    """Why one partition is not linearizable: the longest legal order the search found, and
    the operation that could not follow it (it returned before it could take effect)."""

    key: str
    linearized: list[Operation]
    blocked: Operation
    state: Hashable

    def describe(self) -> str:
        order = "; ".join(op.describe() for op in self.linearized[-5:]) or "nothing"
        return (
            f"key {self.key!r} is not linearizable: after the longest legal order "
            f"({len(self.linearized)} ops, last: {order}) the register holds {self.state!r}, "
            f"but {self.blocked.describe()} cannot take effect before it returned"
        )


@dataclass
class CheckResult:
    ok: bool
    partitions: int
    operations: int
    counterexamples: list[Counterexample] = field(default_factory=list)

    def describe(self) -> str:
        if self.ok:
            return f"linearizable: {self.operations} operations on {self.partitions} keys"
        return "; ".join(c.describe() for c in self.counterexamples)


class _Entry:
    """A call or return event in a doubly linked list the search lifts entries out of."""

    __slots__ = ("index", "is_call", "match", "next", "prev")

    def __init__(self, index: int, is_call: bool) -> None:
        self.index = index
        self.is_call = is_call
        self.match: _Entry = self
        self.prev: _Entry = self
        self.next: _Entry = self


def _event_list(ops: Sequence[Operation]) -> tuple[_Entry, _Entry]:
    """Sentinel head and tail around call/return events sorted by time; at equal times calls
    come first, so touching intervals count as concurrent (never a false alarm)."""
    events: list[tuple[float, int, _Entry]] = []
    for i, op in enumerate(ops):
        call, ret = _Entry(i, True), _Entry(i, False)
        call.match = ret
        end = math.inf if op.complete is None else op.complete
        events += [(op.invoke, 0, call), (end, 1, ret)]
    events.sort(key=lambda e: (e[0], e[1], e[2].index))
    head, tail = _Entry(-1, False), _Entry(-1, False)
    prev = head
    for _, _, entry in [*events, (math.inf, 2, tail)]:
        prev.next, entry.prev = entry, prev
        prev = entry
    return head, tail


def _lift(call: _Entry) -> None:
    for entry in (call, call.match):
        entry.prev.next = entry.next
        entry.next.prev = entry.prev


def _unlift(call: _Entry) -> None:
    for entry in (call.match, call):
        entry.prev.next = entry
        entry.next.prev = entry


def check_partition(
    model: RegisterModel, key: str, ops: Sequence[Operation], memoise: bool = True
) -> Counterexample | None:
    """None if `ops` (one key) is linearizable, else the counterexample. `memoise=False` is
    Wing and Gong's plain search, kept as the benchmark's baseline."""
    ops = model.prune(ops)
    head, tail = _event_list(ops)
    entry = head.next
    state = model.initial
    linearized = 0
    stack: list[tuple[_Entry, Hashable]] = []
    seen: set[tuple[int, Hashable]] = set()
    best: tuple[list[int], Hashable] = ([], state)
    while head.next is not tail:
        if entry.is_call:
            legal, after = model.step(state, ops[entry.index])
            bits = linearized | (1 << entry.index)
            if legal and (bits, after) not in seen:
                if memoise:
                    seen.add((bits, after))
                stack.append((entry, state))
                state, linearized = after, bits
                _lift(entry)
                if len(stack) > len(best[0]):
                    best = ([e.index for e, _ in stack], state)
                entry = head.next
                continue
            entry = entry.next
            continue
        if not stack:
            return _counterexample(key, ops, best)
        call, state = stack.pop()
        linearized &= ~(1 << call.index)
        _unlift(call)
        entry = call.next
    return None


def _counterexample(
    key: str, ops: Sequence[Operation], best: tuple[list[int], Hashable]
) -> Counterexample:
    order, state = best
    done = set(order)
    rest = [op for i, op in enumerate(ops) if i not in done]
    blocked = min(rest, key=lambda op: math.inf if op.complete is None else op.complete)
    return Counterexample(key, [ops[i] for i in order], blocked, state)


def check(ops: Sequence[Operation], model: RegisterModel | None = None) -> CheckResult:
    """Check a whole history (default: the key-value model), every key on its own."""
    model = model or KeyValueModel()
    parts = model.partition(ops)
    found = [c for key, part in parts.items() if (c := check_partition(model, key, part))]
    return CheckResult(not found, len(parts), len(ops), found)
