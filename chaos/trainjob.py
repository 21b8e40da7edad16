"""The one training job a scenario runs through its cluster, for the whole scenario.

`shoal train ENV --coordinators URLS --token-file TOKEN --run-dir CLUSTER_DIR/train --json`
runs as a child process: it submits its learner ranks and rollout workers to the scenario's
coordinators as one job, whose tasks the leader places on the node daemons and restarts when they fail.
Everything here is read from what the run writes into its directory (nodes share this host's
filesystem): rank 0's status file for the curve, `events.jsonl` for the job id and the pids of
every learner and rollout process, the accounting ledgers and checkpoints for the checks.
A pid is only ever signalled after its command line was checked to be that process of this run.

Methods block (files, signals, waiting); the runner calls them in a worker thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.chaos import invariants
from shoal.chaos.curve import Sample, mean_return
from shoal.chaos.errors import FaultError
from shoal.chaos.invariants import Verdict
from shoal.chaos.training import ledger_verdict, read_events, read_json
from shoal.errors import ConfigError

LEARNER_ENTRY = "shoal.learner.learner_main"
ROLLOUT_ENTRY = "shoal.learner.rollout_main"
STOP_WAIT_S = 90.0
MAX_RANKS = 4
MAX_WORKERS = 8


@dataclass(frozen=True)
class JobConfig:
    """The scenario's `[training]` table: a PPO job that keeps learning (Acrobot by default:
    no target it could reach and stop at) for as long as the scenario runs."""

    env: str = "acrobot"
    ranks: int = 2
    workers: int = 2
    checkpoint_interval_s: float = 2.0
    seed: int = 7
    start_within_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.env or not isinstance(self.env, str):
            raise ConfigError(f"training.env={self.env!r} must be an environment id or alias")
        if not 1 <= self.ranks <= MAX_RANKS:
            raise ConfigError(f"training.ranks={self.ranks!r} must be in 1..{MAX_RANKS}")
        if not self.ranks <= self.workers <= MAX_WORKERS:
            raise ConfigError(
                f"training.workers={self.workers!r} must be in {self.ranks}..{MAX_WORKERS} "
                "(every learner rank needs a rollout worker feeding it)"
            )
        for key in ("checkpoint_interval_s", "start_within_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"training.{key}={getattr(self, key)!r} must be > 0 seconds")


class ClusterJob:
    """Start the job, report on it while it runs, stop it in order, check what it recorded."""

    def __init__(self, cfg: JobConfig, cluster_dir: Path, time_limit_s: float) -> None:
        self.cfg = cfg
        self.cluster_dir = cluster_dir.resolve()
        self.run_dir = self.cluster_dir / "train"
        self.time_limit_s = time_limit_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.summary: dict[str, Any] = {}
        self.exit_code: int | None = None

    def _argv(self, urls: list[str], token_file: Path) -> list[str]:
        cfg = self.cfg
        return [
            sys.executable, "-m", "shoal", "train", cfg.env, "--json", "--quiet", "--no-eval",
            "--coordinators", ",".join(urls), "--token-file", str(token_file),
            "--run-dir", str(self.run_dir),
            "--ranks", str(cfg.ranks), "--workers", str(cfg.workers),
            "--checkpoint-interval", str(cfg.checkpoint_interval_s), "--seed", str(cfg.seed),
            "--target-return", "1e9", "--time-limit", str(self.time_limit_s),
        ]  # fmt: skip

    def start(self, urls: list[str], token_file: Path) -> None:
        """Start `shoal train` against the coordinators at `urls` (the cluster's API, or
        proxies in front of it) with the API token in `token_file`."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with (self.cluster_dir / "train.log").open("wb") as log:
            self.proc = subprocess.Popen(
                self._argv(urls, token_file),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )

    def wait_training(self) -> Sample:
        """Block until rank 0 has trained (a status with version > 0); the run exiting or the
        deadline passing first is a FaultError naming the log to read."""
        deadline = time.monotonic() + self.cfg.start_within_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise FaultError(
                    f"the training run exited before it trained; read {self.cluster_dir}/train.log"
                )
            sample = self.sample(0.0, 0)
            if sample is not None and sample.version > 0:
                return sample
            time.sleep(0.2)
        raise FaultError(
            f"the training job did not train within {self.cfg.start_within_s:g} s; read "
            f"{self.cluster_dir}/train.log and the node logs"
        )

    # -- reading the run ---------------------------------------------------------------------

    def sample(self, t: float, restarts: int) -> Sample | None:
        status = read_json(self.run_dir / "status-0.json")
        if not isinstance(status, dict) or "version" not in status:
            return None
        return Sample(
            t=round(t, 3),
            env_steps=int(status.get("env_steps", 0)),
            version=int(status["version"]),
            mean_return=mean_return(status.get("returns", [])),
            restarts=restarts,
            incarnation=str(status.get("incarnation", "")),
        )

    def job_id(self) -> str | None:
        ids = [e.get("job") for e in read_events(self.run_dir) if e.get("event") == "submitted"]
        return str(ids[-1]) if ids else None

    def learner_pid(self, rank: int) -> int:
        """The live process of learner rank `rank` (its newest `start` event)."""
        starts = [
            e
            for e in read_events(self.run_dir)
            if e.get("event") == "start" and e.get("process") == "learner" and e.get("rank") == rank
        ]
        for event in reversed(starts):
            pid = int(event.get("pid", 0))
            if self._is_ours(pid, LEARNER_ENTRY, None):
                return pid
        raise FaultError(f"learner rank {rank} of the job is not running (no live start event)")

    def rollout_pid(self, worker: int) -> int:
        """The live process of rollout worker `worker` (its `--worker N` on the command line)."""
        starts = [
            e
            for e in read_events(self.run_dir)
            if e.get("event") == "start" and e.get("process") == "rollout"
        ]
        for event in reversed(starts):
            pid = int(event.get("pid", 0))
            if self._is_ours(pid, ROLLOUT_ENTRY, ("--worker", str(worker))):
                return pid
        raise FaultError(f"rollout worker {worker} of the job is not running")

    def _is_ours(self, pid: int, entry: str, pair: tuple[str, str] | None) -> bool:
        """Whether `pid` lives and its command line is `entry` of this run (never signal a
        reused pid)."""
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        if state in ("Z", "X") or not any(a.startswith(entry) for a in argv):
            return False
        if str(self.run_dir) not in argv:
            return False
        return pair is None or any(argv[i : i + 2] == list(pair) for i in range(len(argv)))

    def kill(self, pid: int, what: str) -> str:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            raise FaultError(f"{what} (pid {pid}) exited before the SIGKILL") from None
        return f"SIGKILL {what} (pid {pid})"

    # -- stopping and checking ---------------------------------------------------------------

    def stop(self) -> None:
        """Stop the run (it stops its job and prints its JSON summary); a run that does not
        stop in time is killed with its group.

        The job's tasks are stopped by the coordinator, learner ranks first on every node (so
        rank 0 writes its final checkpoint and every rank its final ledger), and a group agrees
        at the start of each update whether to stop, so no rank waits in an all-reduce for a
        batch that never comes. Signalling the ranks here instead would be a failure while the
        job runs: the leader would restart them."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        self.exit_code = proc.returncode
        lines = [line for line in out.decode(errors="replace").splitlines() if line.startswith("{")]
        with contextlib.suppress(ValueError, IndexError):
            self.summary = json.loads(lines[-1])

    def verdicts(self, restarted: bool) -> dict[str, Verdict]:
        """The training invariants over everything the job recorded, across all its learner
        incarnations; `restarted` says a fault should have restarted the learner group."""
        events = read_events(self.run_dir)
        statuses = [
            read_json(self.run_dir / f"status-{rank}.json") or {} for rank in range(self.cfg.ranks)
        ]
        return {
            "resumed_from_checkpoint": invariants.restarts_resumed(events, restarted),
            "fragment_accounting": invariants.both(
                invariants.fragment_accounting([s.get("intake", {}) for s in statuses]),
                ledger_verdict(self.run_dir),
                "across all learner incarnations",
            ),
            "job_stopped_in_order": self._stopped_in_order(events),
        }

    def _stopped_in_order(self, events: list[dict[str, Any]]) -> Verdict:
        """The run exited with its summary, and the final learner incarnation stopped in
        order: rank 0's `stop` event (final checkpoint) comes after the last learner start."""
        starts = [i for i, e in enumerate(events) if e.get("process") == "learner"]
        last_start = max(starts, default=-1)
        stops = [e for i, e in enumerate(events) if e.get("event") == "stop" and i > last_start]
        held = (
            self.exit_code in (0, 1)
            and self.summary.get("stopped_by") == "interrupted"
            and bool(stops)
        )
        return Verdict(
            held,
            f"exit status {self.exit_code}, stopped by {self.summary.get('stopped_by')}, "
            f"{self.summary.get('env_steps')} env steps, final checkpoint step "
            f"{stops[-1].get('step') if stops else None}",
        )
