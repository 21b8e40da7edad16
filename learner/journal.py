"""Accounting records that survive the process: one JSON line per event, appended with a single
os.write on an O_APPEND file descriptor before the event is acted on.

A write(2) that returned is in the kernel's page cache, which outlives a SIGKILLed process
(only a host crash loses it, and fsync per record would cost far more than the fragment), so a
rollout actor that records each acknowledgement this way before it counts it never has an
acknowledged fragment missing from its record, where the periodic JSON snapshot
(`rollout-<actor id>.json`) can be a second behind. One write per line and O_APPEND keep lines
whole; a reader still skips a torn last line (a full disk can cut one short).

A full disk (ENOSPC, EDQUOT, or EFBIG past the process's file size limit) does not stop the
process: the lines that found no room are held in memory, in order, and written ahead of the next
append once there is room again (the rest of a cut line first, so it ends up whole). While lines
are held a SIGKILL loses them: the journal says so in `held` and `full_writes`, which a learner
rank shows in its status, and it logs when it starts and stops holding.

The journal of a rollout actor is `rollout-<actor id>.jsonl` beside its snapshot:
  {"actor_id": "...", "sent": [], "acked": {}}      first line (what a snapshot starts as)
  {"sent": 12}                                      fragment 12 pushed
  {"acked": 12, "incarnation": "ab12", "admission": "accepted"}   the learner's reply
`rollout_ledger` rebuilds the snapshot's form from those lines; `rollout_ledgers` reads a whole
accounting folder, preferring each actor's journal to its snapshot.

A learner rank's journal is `learner-<rank>-<incarnation>.jsonl`, written by its intake:
  {"rank": 0, "incarnation": "ab12"}                       first line
  {"resumed_from": ".../ckpt-000000000040.pt", "base": {actor: ranges}}   after a restore
  {"actor": "rollout-0-0#1f", "seq": 7, "kind": "accepted"}   admitted (before the reply)
  {"actor": "rollout-0-0#1f", "seq": 7, "kind": "trained"}    or "stale", "duplicate"
`learner_ledger` rebuilds the snapshot's form (queued = accepted, neither trained nor stale);
`learner_ledgers` prefers a rank's final snapshot (written at an orderly stop), then its journal.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shoal.learner.diskfull import is_disk_full
from shoal.learner.errors import LearnerError
from shoal.learner.seqranges import SeqRanges, ranges_json

log = logging.getLogger(__name__)


class Journal:
    """An append-only JSON-lines file; one owner, one `append` per record."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._held = bytearray()
        self.full_writes = 0
        """Appends that found the disk full (their lines were held)."""
        try:
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            raise LearnerError(
                f"cannot open the accounting journal {path}: {exc.strerror}; "
                "make the run directory's accounting/ writable"
            ) from exc

    @property
    def held(self) -> int:
        """Bytes waiting for room on the disk; 0 when everything appended is written."""
        return len(self._held)

    def append(self, record: dict[str, Any]) -> None:
        """Write one line; when this returns with nothing `held`, a SIGKILL of this process
        cannot lose it."""
        if self._fd is None:
            raise LearnerError(f"the accounting journal {self.path} is closed")
        was_holding = bool(self._held)
        self._held += (json.dumps(record, separators=(",", ":")) + "\n").encode()
        if not self._write_held(self._fd):
            self.full_writes += 1
            if not was_holding:
                log.warning(
                    "the disk is full: holding %s's lines in memory until there is room", self.path
                )
        elif was_holding:
            log.warning("%s: the held lines are written, the disk has room again", self.path)

    def _write_held(self, fd: int) -> bool:
        """Write what is held (a write may take part of it); False if the disk ran out of room."""
        while self._held:
            try:
                written = os.write(fd, self._held)
            except OSError as exc:
                if is_disk_full(exc):
                    return False
                raise
            del self._held[:written]
        return True

    def close(self) -> None:
        """Close; lines still held for want of room are lost, and logged as such."""
        if self._fd is not None:
            if not self._write_held(self._fd):
                log.error(
                    "%s: %d bytes never found room on the disk and are lost", self.path, self.held
                )
            os.close(self._fd)
            self._fd = None


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a journal; a torn or unreadable line is skipped, never fatal."""
    records = []
    for line in path.read_bytes().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def rollout_ledger(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """A rollout actor's journal as its ledger: `{"actor_id", "sent", "acked"}`, the acked
    ranges per learner incarnation and admission (the form the JSON snapshot has)."""
    actor_id = ""
    sent = SeqRanges()
    acked: dict[str, dict[str, SeqRanges]] = {}
    for record in records:
        if "actor_id" in record:
            actor_id = str(record["actor_id"])
        elif "sent" in record:
            sent.add(_seq(record, "sent"))
        elif "acked" in record:
            kinds = acked.setdefault(str(record.get("incarnation")), {})
            kinds.setdefault(str(record.get("admission")), SeqRanges()).add(_seq(record, "acked"))
    return {
        "actor_id": actor_id,
        "sent": sent.to_json(),
        "acked": {inc: ranges_json(kinds) for inc, kinds in acked.items()},
    }


def open_learner_journal(folder: Path, rank: int, incarnation: str) -> Journal:
    """A learner incarnation's journal in `folder`, its first line naming rank and incarnation."""
    folder.mkdir(parents=True, exist_ok=True)
    journal = Journal(folder / f"learner-{rank}-{incarnation}.jsonl")
    journal.append({"rank": rank, "incarnation": incarnation})
    return journal


FATES = ("accepted", "trained", "stale", "duplicate")
HEADER = ("rank", "incarnation", "resumed_from", "base")


def learner_ledger(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """A learner incarnation's journal as its ledger, in the snapshot's form (`final` is False:
    only the snapshot written at an orderly stop is final)."""
    ledger: dict[str, Any] = {"rank": None, "incarnation": "", "final": False}
    ledger.update({"resumed_from": None, "base": {}})
    seqs: dict[str, dict[str, SeqRanges]] = {fate: {} for fate in FATES}
    for record in records:
        if "kind" not in record:
            ledger.update({k: v for k, v in record.items() if k in HEADER})
            continue
        if record["kind"] not in seqs:
            raise LearnerError(f"malformed journal record {record!r}: kind is not one of {FATES}")
        actor = str(record.get("actor"))
        seqs[record["kind"]].setdefault(actor, SeqRanges()).add(_seq(record, "seq"))
    queued = {
        actor: SeqRanges((seq, seq + 1) for seq in accepted if not _fated(seqs, actor, seq))
        for actor, accepted in seqs["accepted"].items()
    }
    return {
        **ledger,
        "trained": ranges_json(seqs["trained"]),
        "stale": ranges_json(seqs["stale"]),
        "duplicate": ranges_json(seqs["duplicate"]),
        "queued": ranges_json(queued),
    }


def _fated(seqs: dict[str, dict[str, SeqRanges]], actor: str, seq: int) -> bool:
    return any(seq in seqs[fate].get(actor, ()) for fate in ("trained", "stale"))


def learner_ledgers(folder: Path) -> list[dict[str, Any]]:
    """Every learner incarnation's ledger in an accounting folder: its snapshot if that is the
    final one (complete), else its journal (complete to the last fragment, even after a
    SIGKILL), else whatever snapshot there is."""
    ledgers = []
    names = {p.stem for p in folder.glob("learner-*.json")}
    names |= {p.stem for p in folder.glob("learner-*.jsonl")}
    for name in sorted(names):
        snapshot = _read_json(folder / f"{name}.json")
        journal = folder / f"{name}.jsonl"
        if snapshot.get("final") is not True and journal.exists():
            ledgers.append(learner_ledger(read_lines(journal)))
        else:
            ledgers.append(snapshot)
    return ledgers


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _seq(record: dict[str, Any], key: str) -> int:
    seq = record[key]
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise LearnerError(f"malformed journal record {record!r}: {key} must be an int >= 0")
    return seq


def rollout_ledgers(folder: Path) -> list[dict[str, Any]]:
    """Every rollout actor's ledger in an accounting folder: from its journal where it has
    one (complete to the last acknowledgement even after a SIGKILL), else its snapshot."""
    ledgers = []
    journals = {p.with_suffix(".json") for p in folder.glob("rollout-*.jsonl")}
    for path in sorted(folder.glob("rollout-*.jsonl")):
        ledgers.append(rollout_ledger(read_lines(path)))
    for path in sorted(folder.glob("rollout-*.json")):
        if path not in journals:
            ledgers.append(_read_json(path))
    return ledgers
