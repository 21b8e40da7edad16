"""The learner's intake: a bounded queue of fragments with a staleness filter and exact accounting.

Rollout actors push fragments faster or slower than the learner trains; the intake absorbs the
difference up to `capacity` fragments and then stops consuming, so the actor's mailbox and the
transport's credit fill up and the rollout actors wait (back-pressure, never unbounded memory).
A fragment produced by a policy more than `max_staleness` versions behind the learner (or claiming
a version the learner has not reached: a leftover from before a restart) is dropped and counted,
never silently. Every fragment an actor sends is accounted exactly once, by the
actor's sequence numbers: trained on, dropped as stale, dropped as a duplicate, or still queued;
a jump in sequence numbers is counted as lost in transit. The chaos checker reads these counters.
Beside the counts, `ledger()` names the numbers themselves (as compact ranges), so a checker can
follow one fragment across a learner restart (see `fragment_ledger` in chaos/invariants.py).

With a `journal` (learner/journal.py), every admission and every fate (trained, stale,
duplicate) is also appended there as it happens, before the actor's push is answered, so the
ledger of a learner killed with SIGKILL can be rebuilt to its last fragment.

The counting core (`offer`, `take`, `set_version`) is synchronous and pure but for that journal;
`put` and `get` add waiting on top for the learner's event loop. All methods run on that one
loop's thread.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from dataclasses import asdict, dataclass

from shoal.learner.errors import LearnerError
from shoal.learner.journal import Journal
from shoal.learner.seqranges import SeqRanges, ranges_json
from shoal.learner.sequences import AnyFragment


class IntakeFull(LearnerError):
    """`offer` found the intake at capacity; use `await put(...)` to wait for room."""


class Admission(enum.Enum):
    ACCEPTED = "accepted"
    STALE = "stale"
    DUPLICATE = "duplicate"


@dataclass
class ActorAccount:
    """What became of one rollout actor's fragments, by count.

    Invariant: received == trained + dropped_stale + duplicates + queued.
    `lost` counts sequence numbers that never arrived (skipped), which is not in `received`.
    """

    received: int = 0
    trained: int = 0
    dropped_stale: int = 0
    duplicates: int = 0
    queued: int = 0
    lost: int = 0
    next_seq: int = 0
    trained_steps: int = 0


class Intake:
    """A bounded FIFO of fragments that filters stale ones and keeps per-actor accounts."""

    def __init__(self, capacity: int, max_staleness: int, journal: Journal | None = None) -> None:
        if capacity < 1:
            raise LearnerError(f"intake capacity must be >= 1 fragment, got {capacity}")
        if max_staleness < 0:
            raise LearnerError(f"max_staleness must be >= 0 versions, got {max_staleness}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.version = 0
        self.source = ""
        self.lineage_version = 0
        self.accounts: dict[str, ActorAccount] = {}
        self.trained_seqs: dict[str, SeqRanges] = {}
        self.stale_seqs: dict[str, SeqRanges] = {}
        self.duplicate_seqs: dict[str, SeqRanges] = {}
        self._queue: deque[AnyFragment] = deque()
        self._queued_steps = 0
        self._changed = asyncio.Event()
        self.journal = journal

    def __len__(self) -> int:
        return len(self._queue)

    def __repr__(self) -> str:
        return (
            f"<Intake queued={len(self._queue)}/{self.capacity} version={self.version} "
            f"actors={len(self.accounts)}>"
        )

    @property
    def queued_steps(self) -> int:
        return self._queued_steps

    def set_lineage(self, source: str, version: int) -> None:
        """This learner's weights are `source`'s, which started from version `version` (the
        checkpoint it resumed from; 0 for a fresh start, every rank initialised alike)."""
        self.source = source
        self.lineage_version = version

    def is_stale(self, fragment: AnyFragment) -> bool:
        """Too old, newer than this learner, or made by another incarnation's weights past
        the version this learner resumed from: versions up to that one are the same weights
        in both lineages, later ones branched off (the old incarnation went on without a
        checkpoint), so their number says nothing about how stale they are."""
        lag = self.version - fragment.policy_version
        foreign = fragment.policy_source != self.source
        branched = foreign and fragment.policy_version > self.lineage_version
        return lag > self.max_staleness or lag < 0 or branched

    def offer(self, fragment: AnyFragment) -> Admission:
        """Admit or drop one fragment now; raises IntakeFull (counting nothing) when full."""
        account = self.accounts.setdefault(fragment.actor_id, ActorAccount())
        if fragment.seq < account.next_seq:
            account.received += 1
            account.duplicates += 1
            self._mark("duplicate", self.duplicate_seqs, fragment)
            return Admission.DUPLICATE
        if self.is_stale(fragment):
            self._advance(account, fragment.seq)
            account.received += 1
            account.dropped_stale += 1
            self._mark("stale", self.stale_seqs, fragment)
            return Admission.STALE
        if len(self._queue) >= self.capacity:
            raise IntakeFull(
                f"intake holds {self.capacity} fragments already; await put() to wait for room"
            )
        self._advance(account, fragment.seq)
        account.received += 1
        account.queued += 1
        self._record("accepted", fragment)
        self._queue.append(fragment)
        self._queued_steps += fragment.num_steps
        self._changed.set()
        return Admission.ACCEPTED

    def take(self, count: int) -> list[AnyFragment]:
        """Pop up to `count` fresh fragments (oldest first) and count them as trained on."""
        taken: list[AnyFragment] = []
        while self._queue and len(taken) < count:
            fragment = self._pop()
            account = self.accounts[fragment.actor_id]
            if self.is_stale(fragment):
                account.dropped_stale += 1
                self._mark("stale", self.stale_seqs, fragment)
                continue
            account.trained += 1
            self._mark("trained", self.trained_seqs, fragment)
            account.trained_steps += fragment.num_steps
            taken.append(fragment)
        self._changed.set()
        return taken

    def set_version(self, version: int) -> int:
        """Advance the learner's policy version; drops queued fragments it made stale, returns how many."""
        if version < self.version:
            raise LearnerError(f"policy version must not go back: {self.version} → {version}")
        self.version = version
        kept: deque[AnyFragment] = deque()
        dropped = 0
        while self._queue:
            fragment = self._pop()
            if self.is_stale(fragment):
                self.accounts[fragment.actor_id].dropped_stale += 1
                self._mark("stale", self.stale_seqs, fragment)
                dropped += 1
            else:
                kept.append(fragment)
                self.accounts[fragment.actor_id].queued += 1
                self._queued_steps += fragment.num_steps
        self._queue = kept
        self._changed.set()
        return dropped

    async def put(self, fragment: AnyFragment) -> Admission:
        """Like `offer`, but wait while the intake is full (this is what back-pressures actors)."""
        while True:
            try:
                return self.offer(fragment)
            except IntakeFull:
                await self._wait_change()

    async def get(self, count: int) -> list[AnyFragment]:
        """Wait until `count` fresh fragments are queued, then `take` them."""
        if not 1 <= count <= self.capacity:
            raise LearnerError(
                f"cannot wait for {count} fragments from an intake of capacity {self.capacity}; "
                "raise intake.capacity or lower fragments_per_update"
            )
        while len(self._queue) < count:
            await self._wait_change()
        taken = self.take(count)
        while len(taken) < count:
            # Some were stale when taken; wait for replacements.
            await self._wait_change()
            taken.extend(self.take(count - len(taken)))
        return taken

    def totals(self) -> dict[str, int]:
        """Every counter summed over actors (for progress lines and the chaos checker)."""
        total = ActorAccount()
        for account in self.accounts.values():
            for key, value in asdict(account).items():
                setattr(total, key, getattr(total, key) + value)
        out = asdict(total)
        del out["next_seq"]
        return out

    def ledger(self) -> dict[str, dict[str, list[list[int]]]]:
        """Per kind, per actor, the sequence numbers as [lo, hi) ranges: what this intake
        trained on, dropped as stale, dropped as duplicates, and holds queued right now."""
        queued: dict[str, SeqRanges] = {}
        for fragment in self._queue:
            _mark(queued, fragment)
        return {
            "trained": ranges_json(self.trained_seqs),
            "stale": ranges_json(self.stale_seqs),
            "duplicate": ranges_json(self.duplicate_seqs),
            "queued": ranges_json(queued),
        }

    def _mark(self, kind: str, seqs: dict[str, SeqRanges], fragment: AnyFragment) -> None:
        _mark(seqs, fragment)
        self._record(kind, fragment)

    def _record(self, kind: str, fragment: AnyFragment) -> None:
        if self.journal is not None:
            self.journal.append({"actor": fragment.actor_id, "seq": fragment.seq, "kind": kind})

    def _pop(self) -> AnyFragment:
        fragment = self._queue.popleft()
        self.accounts[fragment.actor_id].queued -= 1
        self._queued_steps -= fragment.num_steps
        return fragment

    def _advance(self, account: ActorAccount, seq: int) -> None:
        account.lost += seq - account.next_seq
        account.next_seq = seq + 1

    async def _wait_change(self) -> None:
        self._changed.clear()
        await self._changed.wait()


def _mark(seqs: dict[str, SeqRanges], fragment: AnyFragment) -> None:
    seqs.setdefault(fragment.actor_id, SeqRanges()).add(fragment.seq)
