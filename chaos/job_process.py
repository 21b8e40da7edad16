"""The one training job a scenario runs through its cluster, for the whole scenario.

`shoal train ENV --coordinators URLS --token-file TOKEN --run-dir CLUSTER_DIR/train --json`
runs as a child process: it submits its learner ranks and rollout workers to the scenario's
coordinators as one job, whose tasks the leader places on the node daemons and restarts when they fail.
Everything here is read from what the run wrote: rank 0's status file for the curve,
`events.jsonl` for the job id and the pids of every learner and rollout process, the
accounting ledgers and checkpoints for the checks. Where the nodes share this host's run
directory the tasks write into the run's own directory. Where they are hosts of their own
(`storage` given: `shoal chaos run --hosts`), no host shares it: each task writes into its
node's job directory (CLUSTER_DIR/nodes/<node>/jobs/<job>/, all readable on this one machine,
so they are gathered from every node), and checkpoints go to the storage every host mounts.
A pid is only ever signalled after it was checked to be that process of this run (its command
line, or on a host of its own its job directory).

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
from shoal.chaos.job_files import gathered_ledger_verdict, read_events
from shoal.errors import ConfigError
from shoal.rundir import RankStatus, RunDir
from shoal.runtime.tls import TLS_DIR_ENV

LEARNER_ENTRY = "shoal.learner.learner_main"
ROLLOUT_ENTRY = "shoal.learner.rollout_main"
STOP_WAIT_S = 90.0
MAX_RANKS = 4
MAX_WORKERS = 8
MAX_GPUS_PER_RANK = 64
# With `spread`, each rollout worker asks for this share of a host's CPUs: no two fit on one.
SPREAD_SHARE = 0.6
NODES_DIR = "nodes"
"""Under the cluster's directory: each node daemon's data directory (`nodes/<node>`)."""
MAX_ENVIRON_BYTES = 1 << 20


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
    gpus_per_rank: int = 0
    spread: bool = False
    """Every rollout worker on a host of its own (each asks for most of a host's CPUs), so the
    job's links cross hosts and a fault on one host is a fault between hosts."""

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
        if not 0 <= self.gpus_per_rank <= MAX_GPUS_PER_RANK:
            raise ConfigError(
                f"training.gpus_per_rank={self.gpus_per_rank!r} must be in 0..{MAX_GPUS_PER_RANK}"
            )


class ClusterJob:
    """Start the job, report on it while it runs, stop it in order, check what it recorded."""

    def __init__(
        self,
        cfg: JobConfig,
        cluster_dir: Path,
        time_limit_s: float,
        storage: Path | None = None,
        tls_dir: Path | None = None,
    ) -> None:
        """`storage`: the directory every host mounts (a `--hosts` cluster's), where the
        job's checkpoints go; None where the nodes share this host's run directory.
        `tls_dir`: the cluster's CA, for an https API (`$SHOAL_TLS_DIR` of the run)."""
        self.tls_dir = tls_dir
        self.cfg = cfg
        self.cluster_dir = cluster_dir.resolve()
        self.run_dir = self.cluster_dir / "train"
        self.time_limit_s = time_limit_s
        self.shared = storage is None
        self.checkpoints = (
            RunDir(self.run_dir).checkpoints
            if storage is None
            else storage.resolve() / self.run_dir.name / "checkpoints"
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.summary: dict[str, Any] = {}
        self.exit_code: int | None = None
        self._job_id: str | None = None

    def _argv(self, urls: list[str], token_file: Path) -> list[str]:
        cfg = self.cfg
        argv = [
            sys.executable, "-m", "shoal", "train", cfg.env, "--json", "--quiet", "--no-eval",
            "--coordinators", ",".join(urls), "--token-file", str(token_file),
            "--run-dir", str(self.run_dir),
            "--ranks", str(cfg.ranks), "--workers", str(cfg.workers),
            "--checkpoint-interval", str(cfg.checkpoint_interval_s), "--seed", str(cfg.seed),
            "--target-return", "1e9", "--time-limit", str(self.time_limit_s),
            "--gpus-per-rank", str(cfg.gpus_per_rank),
        ]  # fmt: skip
        if not self.shared:
            argv += ["--checkpoint-storage", str(self.checkpoints)]
        return argv

    def environment(self, host_cpus: float | None) -> dict[str, str]:
        """The run's environment: this one's, the cluster's CA where it has one, and with
        `spread` each rollout worker asking for SPREAD_SHARE of `host_cpus` (the smallest
        host's CPUs)."""
        env = dict(os.environ)
        if self.tls_dir is not None:
            env[TLS_DIR_ENV] = str(self.tls_dir)
        if self.cfg.spread:
            if not host_cpus:
                raise FaultError("training.spread needs the hosts' CPU counts; no node gave one")
            env["SHOAL_ROLLOUT_CPUS_PER_WORKER"] = f"{SPREAD_SHARE * host_cpus:.3f}"
        return env

    def start(self, urls: list[str], token_file: Path, host_cpus: float | None = None) -> None:
        """Start `shoal train` against the coordinators at `urls` (the cluster's API, or
        proxies in front of it) with the API token in `token_file`; `host_cpus`: the
        smallest node's CPUs (what `spread` shares out)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        env = self.environment(host_cpus)
        with (self.cluster_dir / "train.log").open("wb") as log:
            self.proc = subprocess.Popen(
                self._argv(urls, token_file),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
                env=env,
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

    def output_dirs(self) -> list[Path]:
        """Where the job's tasks wrote: the run directory, and (on hosts of their own) every
        node's job directory."""
        job = self.job_id()
        if job is None:
            return [self.run_dir]
        return [self.run_dir, *sorted(self.cluster_dir.glob(f"{NODES_DIR}/*/jobs/{job}"))]

    def events(self) -> list[dict[str, Any]]:
        """Every directory's events.jsonl, merged in the order of their times (each line is
        stamped by the process that wrote it, all on this one machine's clock)."""
        merged = [e for d in self.output_dirs() for e in read_events(d)]
        return sorted(merged, key=_event_time)

    def newest_status(self, rank: int) -> RankStatus | None:
        """Rank `rank`'s status most recently written in any output directory (a rank that
        moved host leaves its old status behind, older), or None: none yet, or one that is
        not a status record (torn, foreign)."""
        found = []
        for directory in self.output_dirs():
            run = RunDir(directory)
            with contextlib.suppress(OSError):
                found.append((os.stat(run.status(rank)).st_mtime_ns, run))
        if not found:
            return None
        try:
            return max(found, key=lambda f: f[0])[1].read_status(rank)
        except (OSError, ValueError):
            return None

    def newest_checkpoint(self) -> int:
        """The step of the newest complete checkpoint in the job's storage (0: none yet)."""
        from shoal.learner.checkpoint import CheckpointManager

        if not self.checkpoints.is_dir():
            return 0
        with CheckpointManager(self.checkpoints) as manager:
            info = manager.latest()
        return 0 if info is None else int(info.step)

    def checkpoints_forward(self, observed: list[int]) -> Verdict:
        """The job's own checkpoints, read from its storage: the newest complete one never
        went back while the run was sampled (`observed`), and the newest one rank 0 reported
        (its `checkpoint` events) is still there, or a newer one, at the end."""
        acknowledged = [
            int(e.get("step", 0)) for e in self.events() if e.get("event") == "checkpoint"
        ]
        final = self.newest_checkpoint()
        verdict = invariants.checkpoints_forward(acknowledged, observed, final)
        return Verdict(verdict.held, f"{verdict.detail} in {self.checkpoints}")

    def sample(self, t: float, restarts: int) -> Sample | None:
        status = self.newest_status(0)
        if status is None or "version" not in status.record:
            return None
        return Sample(
            t=round(t, 3),
            env_steps=status.env_steps,
            version=status.version,
            mean_return=mean_return(status.returns),
            restarts=restarts,
            incarnation=str(status.get("incarnation", "")),
        )

    def job_id(self) -> str | None:
        if self._job_id is None:
            ids = [e.get("job") for e in read_events(self.run_dir) if e.get("event") == "submitted"]
            self._job_id = str(ids[-1]) if ids else None
        return self._job_id

    def learner_pid(self, rank: int) -> int:
        """The live process of learner rank `rank` (its newest `start` event)."""
        starts = [
            e
            for e in self.events()
            if e.get("event") == "start" and e.get("process") == "learner" and e.get("rank") == rank
        ]
        for event in reversed(starts):
            pid = int(event.get("pid", 0))
            if self._is_ours(pid, LEARNER_ENTRY, None):
                return pid
        raise FaultError(f"learner rank {rank} of the job is not running (no live start event)")

    def live_learners(self) -> list[int]:
        """Every live learner process of this run, whether or not it has announced its start
        yet (a rank still joining its group has not)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and self._is_ours(int(entry.name), LEARNER_ENTRY, None):
                pids.append(int(entry.name))
        return sorted(pids)

    def rollout_pid(self, worker: int) -> int:
        """The live process of rollout worker `worker` (its `--worker N` on the command line)."""
        starts = [
            e for e in self.events() if e.get("event") == "start" and e.get("process") == "rollout"
        ]
        for event in reversed(starts):
            pid = int(event.get("pid", 0))
            if self._is_ours(pid, ROLLOUT_ENTRY, ("--worker", str(worker))):
                return pid
        raise FaultError(f"rollout worker {worker} of the job is not running")

    def _is_ours(self, pid: int, entry: str, pair: tuple[str, str] | None) -> bool:
        """Whether `pid` lives and its command line is `entry` of this run (never signal a
        reused pid): it names the run directory, or on a host of its own its node gave it
        one of this job's directories (`SHOAL_JOB_DIR`)."""
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        if state in ("Z", "X") or not any(a.startswith(entry) for a in argv):
            return False
        if str(self.run_dir) not in argv and _job_dir(pid) not in self.output_dirs():
            return False
        return pair is None or any(argv[i : i + 2] == list(pair) for i in range(len(argv)))

    def kill(self, pid: int, what: str, sig: int = signal.SIGKILL) -> str:
        name = signal.Signals(sig).name
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            raise FaultError(f"{what} (pid {pid}) exited before the {name}") from None
        return f"{name} {what} (pid {pid})"

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
        events = self.events()
        statuses = [self.newest_status(rank) for rank in range(self.cfg.ranks)]
        folders = [RunDir(d).accounting for d in self.output_dirs()]
        return {
            "resumed_from_checkpoint": invariants.restarts_resumed(events, restarted),
            "fragment_accounting": invariants.both(
                invariants.fragment_accounting(
                    [{} if s is None else dict(s.intake) for s in statuses]
                ),
                gathered_ledger_verdict(folders, self.checkpoints),
                "across all learner incarnations" + ("" if self.shared else " and hosts"),
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


def _event_time(event: dict[str, Any]) -> float:
    value = event.get("time")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _job_dir(pid: int) -> Path | None:
    """The job directory a node daemon gave process `pid` (its SHOAL_JOB_DIR), if any."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            environ = handle.read(MAX_ENVIRON_BYTES)
    except OSError:
        return None
    for item in environ.split(b"\0"):
        if item.startswith(b"SHOAL_JOB_DIR="):
            return Path(item.removeprefix(b"SHOAL_JOB_DIR=").decode(errors="replace"))
    return None
