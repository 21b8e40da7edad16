"""Sets of sequence numbers kept as sorted, disjoint, half-open ranges.

An actor's fragments arrive in sequence order, so what a learner trained on (or dropped) is
almost always one or a few runs of consecutive numbers: appending the next number extends the
last range in O(1), which keeps the accounting off the hot path's cost, and the JSON form stays
a handful of pairs however long the run.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from typing import Any

from shoal.learner.errors import LearnerError

RangesJson = list[list[int]]


class SeqRanges:
    """A set of non-negative ints as sorted disjoint [lo, hi) ranges, adjacent ones merged."""

    def __init__(self, ranges: Iterable[tuple[int, int] | list[int]] = ()) -> None:
        self._ranges: list[list[int]] = []
        for lo, hi in ranges:
            self.add_range(lo, hi)

    def __repr__(self) -> str:
        return f"SeqRanges({self.to_json()})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SeqRanges) and self._ranges == other._ranges

    def __hash__(self) -> int:
        return hash(tuple(map(tuple, self._ranges)))

    def __len__(self) -> int:
        return sum(hi - lo for lo, hi in self._ranges)

    def __contains__(self, seq: object) -> bool:
        if not isinstance(seq, int):
            return False
        i = bisect.bisect_right(self._ranges, seq, key=lambda r: r[0]) - 1
        return i >= 0 and seq < self._ranges[i][1]

    def __iter__(self) -> Iterator[int]:
        for lo, hi in self._ranges:
            yield from range(lo, hi)

    def add(self, seq: int) -> None:
        """Add one number; the next one after the last range costs O(1)."""
        last = self._ranges[-1] if self._ranges else None
        if last is not None and last[1] == seq:
            last[1] += 1
        elif last is None or last[1] < seq:
            self._ranges.append([seq, seq + 1])
        else:
            self.add_range(seq, seq + 1)

    def add_range(self, lo: int, hi: int) -> None:
        """Add [lo, hi), merging every range it overlaps or touches."""
        if lo < 0 or hi < lo:
            raise LearnerError(f"sequence range [{lo}, {hi}) must have 0 <= lo <= hi")
        if lo == hi:
            return
        ranges = self._ranges
        first = bisect.bisect_left(ranges, lo, key=lambda r: r[1])
        last = first
        while last < len(ranges) and ranges[last][0] <= hi:
            lo, hi = min(lo, ranges[last][0]), max(hi, ranges[last][1])
            last += 1
        ranges[first:last] = [[lo, hi]]

    def update(self, other: SeqRanges) -> None:
        for lo, hi in other._ranges:
            self.add_range(lo, hi)

    def to_json(self) -> RangesJson:
        return [list(r) for r in self._ranges]

    @classmethod
    def from_json(cls, value: Any) -> SeqRanges:
        """From `to_json`'s form; anything else is a LearnerError naming the bad entry."""
        if not isinstance(value, list):
            raise LearnerError(f"sequence ranges must be a list of [lo, hi] pairs, got {value!r}")
        out = cls()
        for pair in value:
            if (
                not isinstance(pair, list | tuple)
                or len(pair) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
            ):
                raise LearnerError(f"sequence range {pair!r} is not an [lo, hi] pair of ints")
            out.add_range(pair[0], pair[1])
        return out


def ranges_by_actor(value: Any) -> dict[str, SeqRanges]:
    """`{actor_id: ranges_json}` (as written to checkpoints and ledgers) → SeqRanges per actor."""
    if not isinstance(value, dict):
        raise LearnerError(f"per-actor sequence ranges must be a JSON object, got {value!r}")
    return {str(actor): SeqRanges.from_json(ranges) for actor, ranges in value.items()}


def ranges_json(value: dict[str, SeqRanges]) -> dict[str, RangesJson]:
    return {actor: ranges.to_json() for actor, ranges in sorted(value.items()) if len(ranges)}
