"""Training under a fault: a real embedded training run (`shoal train ... --json` as a child
process) whose learner rank is killed with SIGKILL mid-run, then checked.

What is measured and checked, from what the run records in its directory:
  * recovery: seconds from the SIGKILL until the killed rank's new incarnation (another
    `incarnation` in status-<rank>.json) trains past the step it resumed from;
  * the run restarted its learners (a `restart` event), every rank resumed from a checkpoint
    (`start` events naming `resumed_from`), and it ended in order (exit 0, JSON summary);
  * fragment accounting, per status snapshot (`fragment_accounting` in chaos/invariants.py);
  * fragment accounting across the restart, by sequence number (`fragment_ledger`): the rollout
    actors' acknowledged seqs against every learner incarnation's ledger and the final
    checkpoint's trained ranges (`ledger_verdict` reads them from the run directory).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.chaos import invariants
from shoal.chaos.errors import FaultError
from shoal.chaos.invariants import Verdict
from shoal.errors import ConfigError

POLL_S = 0.1


@dataclass(frozen=True)
class LearnerKillConfig:
    """A short CartPole run with `ranks` learner ranks; `rank` is killed once a checkpoint
    exists and the rank has trained past it (so the kill loses real work)."""

    env: str = "cartpole"
    ranks: int = 2
    rank: int = 1
    workers: int = 2
    checkpoint_interval_s: float = 1.0
    start_within_s: float = 120.0
    recover_within_s: float = 60.0
    seed: int = 7

    def __post_init__(self) -> None:
        if not 1 <= self.ranks <= 8:
            raise ConfigError(f"ranks={self.ranks} must be in 1..8")
        if not 0 <= self.rank < self.ranks:
            raise ConfigError(
                f"rank={self.rank} must be in 0..{self.ranks - 1} (ranks={self.ranks})"
            )
        if not self.ranks <= self.workers <= 16:
            raise ConfigError(
                f"workers={self.workers} must be in {self.ranks}..16: a rank no rollout worker "
                "feeds never trains, and its peers wait for it in every all-reduce"
            )
        for key in ("checkpoint_interval_s", "start_within_s", "recover_within_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{key}={getattr(self, key)!r} must be > 0 seconds")


@dataclass
class LearnerKillReport:
    ok: bool = False
    run_dir: str = ""
    killed_pid: int | None = None
    checkpoint_step: int | None = None
    """The newest complete checkpoint when the rank was killed."""
    step_at_kill: int | None = None
    resumed_step: int | None = None
    killed_at: float | None = None
    """time.monotonic() of the SIGKILL."""
    recovery_s: float | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    invariants: dict[str, invariants.Verdict] = field(default_factory=dict)
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["invariants"] = {k: v.to_dict() for k, v in self.invariants.items()}
        return out


def read_json(path: Path) -> Any:
    """A JSON file written atomically by the run, or None while it does not exist yet."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    events = []
    with contextlib.suppress(OSError):
        for line in (run_dir / "events.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return events


def newest_checkpoint_step(run_dir: Path) -> int | None:
    """The step of the newest checkpoint whose manifest is on disk (manifests come last)."""
    steps = [
        int(p.stem.removeprefix("ckpt-"))
        for p in (run_dir / "checkpoints").glob("ckpt-*.json")
        if p.stem.removeprefix("ckpt-").isdigit()
    ]
    return max(steps, default=None)


def ledger_verdict(run_dir: Path) -> Verdict:
    """`fragment_ledger` over what the run wrote to run_dir/accounting and its newest
    checkpoint (loaded, to compare its `trained_ranges` with the final incarnations' history)."""
    from shoal.learner.checkpoint import CheckpointManager

    folder = run_dir / "accounting"
    rollouts = [read_json(p) or {} for p in sorted(folder.glob("rollout-*.json"))]
    learners = [read_json(p) or {} for p in sorted(folder.glob("learner-*.json"))]
    with CheckpointManager(run_dir / "checkpoints") as manager:
        info = manager.latest()
        state = None if info is None else manager.load(info)
    final = None if state is None else state.get("trained_ranges", {})
    return invariants.fragment_ledger(rollouts, learners, final)


def learner_pid(run_dir: Path, rank: int) -> int:
    """The rank's pid from its pid file, checked against its command line (never signal a
    reused pid)."""
    path = run_dir / "pids" / f"learner-{rank}.pid"
    try:
        pid = int(path.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, ValueError):
        raise FaultError(f"learner rank {rank} is not running (no live pid in {path})") from None
    if "learner_main" not in cmdline or str(run_dir) not in cmdline:
        raise FaultError(f"pid {pid} in {path} is not learner rank {rank} of {run_dir}")
    return pid


class LearnerKill:
    """Start the run, kill the rank, watch it recover, stop the run in order, check."""

    def __init__(self, cfg: LearnerKillConfig, work_dir: Path) -> None:
        """The run directory is `work_dir/run`; the run's own output goes to `work_dir/train.log`."""
        self.cfg = cfg
        self.work_dir = work_dir.resolve()
        self.run_dir = self.work_dir / "run"
        self.report = LearnerKillReport(run_dir=str(self.run_dir))

    def _argv(self) -> list[str]:
        cfg = self.cfg
        return [
            sys.executable, "-m", "shoal", "train", cfg.env, "--json", "--quiet", "--no-eval",
            "--run-dir", str(self.run_dir), "--ranks", str(cfg.ranks),
            "--workers", str(cfg.workers), "--checkpoint-interval", str(cfg.checkpoint_interval_s),
            "--seed", str(cfg.seed), "--target-return", "1e9",
            "--time-limit", str(cfg.start_within_s + cfg.recover_within_s + 60),
        ]  # fmt: skip

    def run(self) -> LearnerKillReport:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        with (self.work_dir / "train.log").open("wb") as log:
            proc = subprocess.Popen(
                self._argv(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        try:
            self._kill_and_watch(proc)
        except FaultError as exc:
            self.report.detail = str(exc)
        finally:
            out = self._stop(proc)
        self._check(proc.returncode, out)
        return self.report

    def _status(self) -> dict[str, Any]:
        return read_json(self.run_dir / f"status-{self.cfg.rank}.json") or {}

    def _wait(
        self, proc: subprocess.Popen[bytes], within: float, what: str, ready: Callable[[], Any]
    ) -> Any:
        """Poll `ready` until it returns something true; the run exiting first is a FaultError."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise FaultError(f"the training run exited ({proc.returncode}) while {what}")
            value = ready()
            if value:
                return value
            time.sleep(POLL_S)
        raise FaultError(f"gave up after {within:g} s {what}")

    def _kill_and_watch(self, proc: subprocess.Popen[bytes]) -> None:
        cfg, report = self.cfg, self.report

        def trained_past_checkpoint() -> dict[str, Any] | None:
            step = newest_checkpoint_step(self.run_dir)
            status = self._status()
            return status if step is not None and status.get("version", 0) > step else None

        before = self._wait(
            proc, cfg.start_within_s, "waiting for a checkpoint", trained_past_checkpoint
        )
        report.killed_pid = learner_pid(self.run_dir, cfg.rank)
        report.checkpoint_step = newest_checkpoint_step(self.run_dir)
        report.step_at_kill = int(self._status().get("version", before["version"]))
        os.kill(report.killed_pid, signal.SIGKILL)
        killed_at = report.killed_at = time.monotonic()

        def recovered() -> bool:
            status = self._status()
            resumed = self._resumed_step(report.killed_pid)
            if status.get("incarnation") in (None, before["incarnation"]) or resumed is None:
                return False
            report.resumed_step = resumed
            return int(status.get("version", 0)) > resumed

        self._wait(proc, cfg.recover_within_s, "waiting for the rank to recover", recovered)
        report.recovery_s = round(time.monotonic() - killed_at, 3)

    def _resumed_step(self, killed_pid: int | None) -> int | None:
        """The step the killed rank's next incarnation started from (its `start` event)."""
        starts = [
            e
            for e in read_events(self.run_dir)
            if e.get("event") == "start" and e.get("rank") == self.cfg.rank
        ]
        if not starts or starts[-1].get("pid") == killed_pid:
            return None
        return int(starts[-1].get("step", 0))

    def _stop(self, proc: subprocess.Popen[bytes]) -> str:
        """SIGTERM stops a run in order (final checkpoint, children reaped)."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        return out.decode(errors="replace")

    def _check(self, code: int | None, out: str) -> None:
        report = self.report
        lines = [line for line in out.splitlines() if line.startswith("{")]
        with contextlib.suppress(ValueError, IndexError):
            report.summary = json.loads(lines[-1])
        events = read_events(self.run_dir)
        statuses = [
            read_json(self.run_dir / f"status-{rank}.json") or {} for rank in range(self.cfg.ranks)
        ]
        report.invariants = {
            "learner_recovered": invariants.Verdict(
                report.recovery_s is not None and report.recovery_s <= self.cfg.recover_within_s,
                report.detail
                or f"rank {self.cfg.rank} trained past step "
                f"{report.resumed_step} {report.recovery_s} s after SIGKILL",
            ),
            "resumed_from_checkpoint": invariants.resumed_from_checkpoint(
                events, self.cfg.ranks, report.checkpoint_step
            ),
            "fragment_accounting": _both(
                invariants.fragment_accounting([s.get("intake", {}) for s in statuses]),
                ledger_verdict(self.run_dir),
            ),
            "stopped_in_order": _stopped_in_order(code, report.summary, events),
        }
        report.ok = all(v.held for v in report.invariants.values())


def _both(per_incarnation: Verdict, across_restarts: Verdict) -> Verdict:
    """The scenario's one `fragment_accounting` verdict: the counters of each incarnation and
    the sequence-number ledger across the restart must both hold."""
    return Verdict(
        per_incarnation.held and across_restarts.held,
        f"{per_incarnation.detail}; across the restart: {across_restarts.detail}",
    )


def _stopped_in_order(
    code: int | None, summary: dict[str, Any], events: list[dict[str, Any]]
) -> Verdict:
    """SIGTERM ended the run as an interrupt: a JSON summary that counts the restart, and rank
    0's final checkpoint (a `stop` event). `shoal train` exits 1 for "not solved"."""
    stops = [e for e in events if e.get("event") == "stop"]
    held = (
        code in (0, 1)
        and summary.get("stopped_by") == "interrupted"
        and int(summary.get("restarts", 0)) >= 1
        and bool(stops)
    )
    return Verdict(
        held,
        f"exit status {code}, stopped by {summary.get('stopped_by')}, "
        f"restarts {summary.get('restarts')}, final checkpoint step "
        f"{stops[-1].get('step') if stops else None}",
    )
