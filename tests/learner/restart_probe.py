"""Measure learner group restarts on a real `shoal up` cluster (not a test: run it by hand).

    .venv/bin/python tests/learner/restart_probe.py --trials 3 --kinds rank0,rank1,both,during,node

A 2-rank CartPole job trains through a cluster of one replica and `--nodes` node daemons; each
trial kills something and times kill -> training again: rank 0's status (written 4x/s, polled
every 50 ms) shows a new incarnation whose policy version moved past the step it resumed from. The
kinds: `rank0`/`rank1` SIGKILL one rank; `both` SIGKILLs both at once; `during` SIGKILLs rank
1, then SIGKILLs the replacement rank 1 as soon as its process exists (before its group has
formed); `node` SIGKILLs the node daemon running the ranks and starts it again 5 s later (as
the chaos `node-kill` fault does). Per trial it prints the start-up phases of the new rank 0
(seconds after the kill) from its status file, then a p50/max table per kind. --json FILE
writes every trial.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shoal.cli import main as shoal_main
from shoal.local import LocalCluster

KINDS = ("rank0", "rank1", "both", "during", "node")
NODE_DOWN_S = 5.0
TRIAL_LIMIT_S = 150.0


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def events(run_dir: Path) -> list[dict[str, Any]]:
    try:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def learner_pids(run_dir: Path) -> dict[int, int]:
    """Rank -> pid of every live learner process of this run (from /proc, not events: a rank
    that has not joined its group has logged nothing yet)."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"shoal.learner.learner_main:main" not in cmdline
            or str(run_dir).encode() not in cmdline
        ):
            continue
        for item in environ:
            if item.startswith(b"SHOAL_GROUP_RANK="):
                found[int(item.split(b"=", 1)[1])] = int(entry.name)
    return found


def training_again(run_dir: Path, old: set[str]) -> dict[str, Any] | None:
    """Rank 0's status once a new incarnation has trained: its policy version is past the
    step its start event resumed from (read the same way from trees without `phases`)."""
    status = read_json(run_dir / "status-0.json")
    if status is None or status.get("incarnation") in old:
        return None
    starts = [
        e
        for e in events(run_dir)
        if e.get("event") == "start" and e.get("incarnation") == status.get("incarnation")
    ]
    return status if starts and status.get("version", 0) > starts[0].get("step", 0) else None


def wait_for(what: str, check: Any, limit: float, proc: subprocess.Popen[str]) -> Any:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        if proc.poll() is not None:
            raise SystemExit(f"shoal train exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.05)
    raise TimeoutError(f"no {what} within {limit:.0f} s")


def incarnations(run_dir: Path) -> set[str]:
    return {
        str(e["incarnation"])
        for e in events(run_dir)
        if e.get("event") == "start" and e.get("process") == "learner"
    }


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def learners_node(cluster: LocalCluster) -> str:
    """The node daemon whose children are the learner ranks."""
    ranks = set(learner_pids(RUN_DIR).values())
    for spec in cluster.specs():
        if spec.kind != "node":
            continue
        pid = cluster.pid(spec.name)
        if pid is not None and ranks & children(pid):
            return spec.name
    raise RuntimeError("no node daemon runs the learner ranks")


def children(pid: int) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                out.add(int(entry.name))
    return out


def inject(kind: str, cluster: LocalCluster, run_dir: Path) -> float:
    """Do the trial's damage; returns the kill's time (epoch seconds)."""
    pids = learner_pids(run_dir)
    if kind == "node":
        name = learners_node(cluster)
        at = time.time()
        cluster.kill(name)
        time.sleep(NODE_DOWN_S)
        cluster.start(name)
        return at
    victims = {"rank0": [0], "rank1": [1], "both": [0, 1], "during": [1]}[kind]
    at = time.time()
    for rank in victims:
        kill(pids[rank])
    if kind == "during":
        old = set(pids.values())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = learner_pids(run_dir).get(1)
            if new is not None and new not in old:
                time.sleep(0.3)  # inside its start-up: imports or the rendezvous
                kill(new)
                break
            time.sleep(0.02)
    return at


def trial(kind: str, cluster: LocalCluster, run_dir: Path, proc: subprocess.Popen[str]) -> dict:
    old = incarnations(run_dir)
    at = inject(kind, cluster, run_dir)
    status = wait_for("training again", lambda: training_again(run_dir, old), TRIAL_LIMIT_S, proc)
    seen = time.time() - at
    phases = {k: round(v - at, 2) for k, v in status.get("phases", {}).items()}
    return {"kind": kind, "recovery_s": round(seen, 2), "phases": phases}


RUN_DIR = Path()


def main() -> int:
    global RUN_DIR
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--restart-window",
        type=float,
        default=1.0,
        help="the job's restart window (s): the leader's back-off doubles per counted restart "
        "in it, so a short one times the restart itself (default 1)",
    )
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="restart-probe-") as tmp:
        base = Path(tmp)
        cluster_dir, RUN_DIR = base / "cluster", base / "run"
        argv = ["up", "--replicas", "1", "--nodes", str(args.nodes), "--timeout", "60"]
        assert shoal_main([*argv, "--run-dir", str(cluster_dir)]) == 0
        cluster = LocalCluster(cluster_dir)
        train = [
            sys.executable, "-m", "shoal", "train", "cartpole", "--cluster", str(cluster_dir),
            "--run-dir", str(RUN_DIR), "--ranks", "2", "--workers", "2", "--time-limit", "3600",
            "--target-return", "100000", "--checkpoint-interval", "1", "--quiet", "--json",
            "--no-eval", "--max-restarts", "1000", "--restart-window", str(args.restart_window),
        ]  # fmt: skip
        proc = subprocess.Popen(train, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for("training", lambda: training_again(RUN_DIR, set()), 120, proc)
            for n in range(args.trials):
                for kind in kinds:
                    time.sleep(3)  # a checkpoint or two of the new incarnation
                    try:
                        row = trial(kind, cluster, RUN_DIR, proc)
                    except TimeoutError as exc:
                        row = {"kind": kind, "recovery_s": None, "error": str(exc)}
                    results.append(row)
                    print(n, json.dumps(row), flush=True)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            cluster.stop_all()
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
            keep = Path(os.environ.get("PROBE_KEEP", ""))
            if keep != Path():
                subprocess.run(["cp", "-r", str(base), str(keep)], check=False)
    print(f"{'kind':8} {'n':>3} {'p50 s':>7} {'max s':>7} failed")
    for kind in kinds:
        times = [r["recovery_s"] for r in results if r["kind"] == kind]
        ok = [t for t in times if t is not None]
        p50 = f"{statistics.median(ok):7.2f}" if ok else "      -"
        top = f"{max(ok):7.2f}" if ok else "      -"
        print(f"{kind:8} {len(times):3} {p50} {top} {len(times) - len(ok)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
