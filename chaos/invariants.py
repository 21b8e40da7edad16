"""The invariants a chaos run checks, each a function from what was observed to a verdict.
Pure except `leaked_processes` and `busy_ports`, which look at /proc and try to bind."""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.chaos.history import Operation
from shoal.chaos.linearizability import KeyValueModel, check
from shoal.learner.errors import LearnerError
from shoal.learner.seqranges import SeqRanges, ranges_by_actor


@dataclass(frozen=True)
class Verdict:
    held: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"held": self.held, "detail": self.detail}


def linearizable(ops: Sequence[Operation]) -> Verdict:
    """No acknowledged write lost, no stale or invented read: the history fits a map."""
    result = check(ops, KeyValueModel())
    return Verdict(result.ok, result.describe())


def digests_equal(views: dict[str, dict[str, Any] | None]) -> Verdict:
    """Every replica answered and shows the same state digest at the same commit index."""
    missing = sorted(name for name, view in views.items() if view is None)
    if missing:
        return Verdict(False, f"replicas {missing} did not answer GET /v1/cluster")
    seen = {name: (str(v.get("digest")), v.get("commit_index")) for name, v in views.items() if v}
    if len({digest for digest, _ in seen.values()}) == 1:
        (digest, index) = next(iter(seen.values()))
        return Verdict(True, f"{len(seen)} replicas at commit {index}, digest {digest[:12]}")
    shown = ", ".join(f"{n}: {d[:12]}@{i}" for n, (d, i) in sorted(seen.items()))
    return Verdict(False, f"replicas disagree: {shown}")


def checkpoints_forward(
    acknowledged: Sequence[int], observed: Sequence[int], final: int
) -> Verdict:
    """The newest complete checkpoint never moves back, and the newest acknowledged one is
    still there at the end."""
    for before, after in itertools.pairwise(observed):
        if after < before:
            return Verdict(False, f"newest complete checkpoint went back from {before} to {after}")
    newest = max(acknowledged, default=0)
    if final < newest:
        return Verdict(False, f"acknowledged checkpoint step {newest} lost; newest now {final}")
    return Verdict(
        True, f"{len(acknowledged)} checkpoints, {len(observed)} watches, newest step {final}"
    )


def recovered(faults: Sequence[dict[str, Any]]) -> Verdict:
    """Every fault made was recovered within its bound. A fault this machine could not make
    (`unsupported`: a kernel without netem, say) was never injected: it is named, not
    counted either way."""
    made = [f for f in faults if not f.get("unsupported")]
    unmade = [f"{f['kind']} {f['target']}" for f in faults if f.get("unsupported")]
    missing = f"; unsupported here, so not made: {unmade}" if unmade else ""
    late = [f"{f['kind']} {f['target']}" for f in made if not f["recovered"]]
    if late:
        return Verdict(False, f"not recovered within their bounds: {late}{missing}")
    worst = max((f["recovery_s"] or 0.0 for f in made), default=0.0)
    return Verdict(True, f"{len(made)} faults recovered, slowest in {worst:.2f} s{missing}")


def leaked_processes(run_dir: Path) -> list[int]:
    """Live processes whose command line names the run directory, except this process and
    its ancestors (`shoal chaos run --run-dir DIR` names it too)."""
    marker = str(run_dir.resolve()).encode()
    ours = _self_and_ancestors()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in ours:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in cmdline and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def _self_and_ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return pids


def busy_ports(ports: Sequence[int], host: str = "127.0.0.1") -> list[int]:
    """Those of `ports` on `host` that something still listens on or holds."""
    busy = []
    for port in ports:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                busy.append(port)
    return busy


def no_leaks(processes: Sequence[int], ports: Sequence[int]) -> Verdict:
    if processes or ports:
        return Verdict(False, f"left behind: processes {list(processes)}, ports {list(ports)}")
    return Verdict(True, "no process or port left behind")


ACCOUNT_PARTS = ("trained", "dropped_stale", "duplicates", "queued")


def fragment_accounting(intakes: Sequence[dict[str, int]]) -> Verdict:
    """Each learner rank's intake (status-<rank>.json) accounts for every fragment it received
    exactly once: received == trained + dropped_stale + duplicates + queued, none negative.
    A fragment trained on and also counted as dropped (or neither) breaks the sum."""
    problems = []
    for rank, intake in enumerate(intakes):
        if not intake or "received" not in intake:
            problems.append(f"rank {rank} recorded no intake counters")
            continue
        parts = {key: int(intake.get(key, 0)) for key in ACCOUNT_PARTS}
        negative = sorted(k for k, v in {**parts, "received": intake["received"]}.items() if v < 0)
        if negative:
            problems.append(f"rank {rank} has negative counters {negative}")
        elif sum(parts.values()) != int(intake["received"]):
            problems.append(
                f"rank {rank} received {intake['received']} fragments but accounts for "
                f"{sum(parts.values())} ({parts})"
            )
    if problems:
        return Verdict(False, "; ".join(problems))
    received = sum(int(i["received"]) for i in intakes)
    trained = sum(int(i.get("trained", 0)) for i in intakes)
    dropped = sum(int(i.get("dropped_stale", 0)) for i in intakes)
    return Verdict(
        True,
        f"{len(intakes)} ranks: {received} fragments received, each counted once "
        f"({trained} trained, {dropped} dropped as stale)",
    )


SHOWN_PROBLEMS = 5


def fragment_ledger(
    rollouts: Sequence[dict[str, Any]],
    learners: Sequence[dict[str, Any]],
    final_checkpoint: dict[str, Any] | None = None,
) -> Verdict:
    """Every fragment a rollout actor had acknowledged is accounted for exactly once, across
    learner restarts (issue #7).

    Inputs are what the run wrote: each rollout actor's ledger (`sent` ranges; `acked`, per
    learner incarnation, per admission), each learner incarnation's ledger (`final` once it
    stopped in order; `base`, the resumed checkpoint's trained ranges; `trained`, `stale`,
    `duplicate`, `queued`), and the final checkpoint's `trained_ranges`.

    The effective history is the final incarnations' `base` plus what they trained. Each
    acknowledged seq is then exactly one of: trained (in the effective history), dropped as
    stale (by any incarnation, or so admitted), a duplicate, refused by a closing learner,
    rolled back (acknowledged by a dead incarnation and not in the checkpoint its successor
    resumed from: work since the last checkpoint, the loss the issue allows), or queued at the
    final stop. A seq trained in the effective history and also dropped, one both trained and
    dropped by one incarnation, an acknowledged seq of a final incarnation in none of these, or
    a final checkpoint that disagrees with the effective history is reported by actor and seq.
    Seqs sent but never acknowledged were in flight at a kill or the stop, and are counted.
    """
    try:
        return _ledger_verdict(rollouts, learners, final_checkpoint)
    except (LearnerError, KeyError, TypeError) as exc:
        return Verdict(False, f"malformed accounting ledger: {exc!r}")


def _union(ledgers: Sequence[dict[str, Any]], *kinds: str) -> dict[str, SeqRanges]:
    out: dict[str, SeqRanges] = {}
    for ledger in ledgers:
        for kind in kinds:
            for actor, seqs in ranges_by_actor(ledger.get(kind, {})).items():
                out.setdefault(actor, SeqRanges()).update(seqs)
    return out


def _ledger_verdict(
    rollouts: Sequence[dict[str, Any]],
    learners: Sequence[dict[str, Any]],
    final_checkpoint: dict[str, Any] | None,
) -> Verdict:
    finals = [ledger for ledger in learners if ledger.get("final")]
    if not finals:
        return Verdict(False, "no learner incarnation wrote a final ledger: the run never stopped")
    final_ids = {str(ledger["incarnation"]) for ledger in finals}
    effective = _union(finals, "base", "trained")
    dropped = _union(learners, "stale")
    queued = _union(finals, "queued")
    empty = SeqRanges()
    problems: list[str] = []
    for ledger in learners:
        trained, stale = _union([ledger], "trained"), _union([ledger], "stale")
        for actor, seqs in trained.items():
            both = [s for s in stale.get(actor, empty) if s in seqs]
            problems += [
                f"actor {actor} seq {s} both trained and dropped as stale by learner "
                f"incarnation {ledger['incarnation']}"
                for s in both
            ]
    for actor, seqs in effective.items():
        problems += [
            f"actor {actor} seq {s} both trained (effective history) and dropped as stale"
            for s in dropped.get(actor, empty)
            if s in seqs
        ]
    if final_checkpoint is not None:
        saved = ranges_by_actor(final_checkpoint)
        for actor in sorted(set(saved) | set(effective)):
            if saved.get(actor, empty) != effective.get(actor, empty):
                problems.append(
                    f"actor {actor}: the final checkpoint holds {saved.get(actor, empty)} but the "
                    f"final incarnations' history is {effective.get(actor, empty)}"
                )
    counts = dict.fromkeys(
        ("trained", "stale", "duplicate", "refused", "rolled back", "queued", "in flight"), 0
    )
    for rollout in rollouts:
        actor = str(rollout["actor_id"])
        acked_all = SeqRanges()
        for incarnation, kinds in rollout.get("acked", {}).items():
            for admission, seqs in ranges_by_actor(kinds).items():
                acked_all.update(seqs)
                for seq in seqs:
                    fate = _fate(
                        seq,
                        admission,
                        incarnation in final_ids,
                        effective.get(actor, empty),
                        dropped.get(actor, empty),
                        queued.get(actor, empty),
                    )
                    if fate is None:
                        problems.append(
                            f"actor {actor} seq {seq} acknowledged ({admission}) by final "
                            f"incarnation {incarnation} is neither trained, dropped nor queued"
                        )
                    else:
                        counts[fate] += 1
        counts["in flight"] += sum(
            1 for s in SeqRanges.from_json(rollout.get("sent", [])) if s not in acked_all
        )
    if problems:
        more = len(problems) - SHOWN_PROBLEMS
        tail = f"; and {more} more" if more > 0 else ""
        return Verdict(False, "; ".join(problems[:SHOWN_PROBLEMS]) + tail)
    shown = ", ".join(f"{n} {fate}" for fate, n in counts.items())
    return Verdict(
        True,
        f"{len(rollouts)} rollout actors, {len(learners)} learner incarnations: every "
        f"acknowledged fragment accounted once ({shown})",
    )


def _fate(
    seq: int,
    admission: str,
    final: bool,
    effective: SeqRanges,
    dropped: SeqRanges,
    queued: SeqRanges,
) -> str | None:
    """What became of one acknowledged seq, or None if nothing accounts for it."""
    if seq in effective:
        return "trained"
    if seq in dropped or admission == "stale":
        return "stale"
    if admission == "duplicate":
        return "duplicate"
    if admission in ("rejected", "closed"):
        return "refused"
    if not final:
        return "rolled back"
    if seq in queued:
        return "queued"
    return None


def both(first: Verdict, second: Verdict, second_label: str) -> Verdict:
    """One verdict that holds only if both do, with both details."""
    return Verdict(first.held and second.held, f"{first.detail}; {second_label}: {second.detail}")


def restarts_resumed(events: Sequence[dict[str, Any]], restarted: bool) -> Verdict:
    """Every learner start after a rank's first (a restart, in a cluster job) resumed from a
    checkpoint (`resumed_from`) at a step no older than the newest checkpoint recorded before
    it (a `checkpoint` event comes after its manifest, so a later start could have seen it).
    With `restarted`, the run must also show at least one such restart."""
    newest, seen, restarts = 0, set(), 0
    behind = []
    for event in events:
        if event.get("event") == "checkpoint":
            newest = max(newest, int(event.get("step", 0)))
        if event.get("event") != "start" or event.get("process") != "learner":
            continue
        rank = int(event.get("rank", -1))
        if rank not in seen:
            seen.add(rank)
            continue
        restarts += 1
        if not event.get("resumed_from") or int(event.get("step", -1)) < newest:
            behind.append(f"rank {rank} at step {event.get('step')} (newest checkpoint {newest})")
    if behind:
        return Verdict(
            False, "learner restarts without the newest checkpoint: " + "; ".join(behind)
        )
    if restarted and not restarts:
        return Verdict(False, "a fault hit the learners but no learner rank ever started again")
    return Verdict(
        True, f"{restarts} learner rank restarts, each resumed from the newest checkpoint"
    )


def training_progress(faults: Sequence[dict[str, Any]]) -> Verdict:
    """After every fault the job trained again (policy version and env steps rose) within
    that fault's bound; each fault gives `progress_s` (None: never), `bound_s` and, when a
    later group restart interrupted its recovery, `masked_by` (its bound is then that fault's
    deadline: chaos/curve.py `held_to`)."""
    late = [
        f"{f['kind']} {f['target']} ({f['progress_s']} s > {f['bound_s']:g} s)"
        if f["progress_s"] is not None
        else f"{f['kind']} {f['target']} (never)"
        for f in faults
        if f["progress_s"] is None or f["progress_s"] > f["bound_s"]
    ]
    if late:
        return Verdict(False, f"training did not progress again in time after: {late}")
    slowest = max((float(f["progress_s"]) for f in faults), default=0.0)
    masked = [f"{f['kind']} {f['target']}" for f in faults if f.get("masked_by")]
    also = f"; masked by a later group restart: {masked}" if masked else ""
    return Verdict(
        True,
        f"training progressed after each of {len(faults)} faults, slowest {slowest:.2f} s{also}",
    )
