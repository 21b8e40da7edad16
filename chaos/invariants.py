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
    late = [f"{f['kind']} {f['target']}" for f in faults if not f["recovered"]]
    if late:
        return Verdict(False, f"not recovered within their bounds: {late}")
    worst = max((f["recovery_s"] or 0.0 for f in faults), default=0.0)
    return Verdict(True, f"{len(faults)} faults recovered, slowest in {worst:.2f} s")


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


def busy_ports(ports: Sequence[int]) -> list[int]:
    """Those of `ports` on 127.0.0.1 that something still listens on or holds."""
    busy = []
    for port in ports:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
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


def resumed_from_checkpoint(
    events: Sequence[dict[str, Any]], ranks: int, checkpoint_step: int | None
) -> Verdict:
    """After a restart every rank started again from a checkpoint no older than the newest one
    complete when the fault hit (a rank starting from scratch would retrain lost work)."""
    restarts = [i for i, e in enumerate(events) if e.get("event") == "restart"]
    if not restarts:
        return Verdict(False, "the run recorded no learner restart")
    later = [e for e in events[restarts[0] :] if e.get("event") == "start"]
    by_rank = {int(e.get("rank", -1)): e for e in later if e.get("process") == "learner"}
    missing = sorted(set(range(ranks)) - set(by_rank))
    if missing:
        return Verdict(False, f"ranks {missing} never started again after the restart")
    floor = checkpoint_step if checkpoint_step is not None else 0
    behind = {
        rank: e.get("step")
        for rank, e in by_rank.items()
        if not e.get("resumed_from") or int(e.get("step", -1)) < floor
    }
    if behind:
        return Verdict(
            False, f"ranks restarted without the checkpoint at step {floor}: steps {behind}"
        )
    steps = sorted({int(e["step"]) for e in by_rank.values()})
    return Verdict(True, f"{ranks} ranks resumed from checkpoint step(s) {steps} (>= {floor})")
