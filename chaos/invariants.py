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
