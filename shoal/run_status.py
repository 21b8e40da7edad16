"""What a run reports: the ranks' status records turned into the progress line, the stop
rule and the summary (`TrainResult`), and the newest complete checkpoint it may name.

`shoal train` (shoal/train.py) and the job it submits (shoal/cluster_train.py) both use these;
neither imports the other for them.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.progress import ProgressLine, si
from shoal.rundir import RankStatus, RunDir, TrainError

if TYPE_CHECKING:
    from shoal.learner.config import TrainConfig


@dataclass
class TrainResult:
    """What a run achieved and where its outputs are (the `--json` summary)."""

    run_dir: str
    env_id: str
    solved: bool
    final_return: float | None
    target_return: float | None
    env_steps: int
    wall_s: float
    solve_s: float | None
    startup_s: float | None
    """Seconds from the start (of the embedded cluster, when there is one) until the first
    policy update: cluster start, placement, process start-up, imports, first fragment."""
    sps: float
    """Environment steps per second over the whole run, process start-up included."""
    learner_sps: float
    """Environment steps per second the learners received, from their start (steady state)."""
    policy_lag_median: float | None
    restarts: int
    """Restarts of the job's tasks by the coordinator (a learner group counts once)."""
    stopped_by: str
    checkpoint: str | None = None
    """The newest complete checkpoint of the run (manifest written, hash verified), or None."""
    checkpoint_step: int | None = None
    checkpoint_error: str | None = None
    """Why rank 0's newest checkpoint is not the one above (a full disk, say), or None."""
    best_checkpoint: str | None = None
    """The checkpoint saved at the highest recent mean return, kept beside the newest
    (learner/checkpoint_best.py; `shoal eval RUN --best`), or None when none recorded one."""
    best_return: float | None = None
    """That checkpoint's recent mean return when it was saved."""
    report: str | None = None
    report_html: str | None = None
    eval_mean_return: float | None = None
    intake: dict[str, int] = field(default_factory=dict)
    job_id: str | None = None
    """The coordinator job the run was."""
    cluster: dict[str, Any] = field(default_factory=dict)
    """Where it ran: `coordinators` (API URLs), `embedded` (started by this run, in its run
    directory) and, for an embedded one, `logs` (coordinator, node) and `task_logs`."""


class RunStatus:
    """What the learner ranks report in their status files, and what the run makes of it: the
    progress line, the stop rule and the summary."""

    def __init__(
        self, cfg: TrainConfig, env_id: str, run_dir: Path, progress: ProgressLine | None
    ) -> None:
        self.cfg = cfg
        self.env_id = env_id
        self.run_dir = run_dir
        self.progress = progress
        self.target = cfg.resolved_target(env_id)
        self.statuses: dict[int, RankStatus] = {}

    def read(self) -> None:
        """Each rank's newest status; one missing, torn or refused keeps the one before."""
        run = RunDir(self.run_dir)
        for rank in range(self.cfg.learner.ranks):
            with contextlib.suppress(OSError, ValueError):
                self.statuses[rank] = run.read_status(rank)

    def take_published(self, published: dict[str, Any]) -> None:
        """Rank 0's progress as it published it (learner_main `publish_progress`): the source
        when the ranks run on other hosts and their status files are out of reach. Its window
        of returns stands for the group's (rank 0 sees its own actors' episodes only)."""
        from shoal.learner.job_metrics import loss_name

        count, mean = published.get("returns"), published.get("recent_return")
        returns = (  # no more than the window it stands for, whatever count it claims
            [float(mean)] * min(count, self.cfg.target_window)
            if isinstance(mean, int | float) and isinstance(count, int)
            else []
        )
        record = {
            "version": published.get("version", 0),
            "env_steps": published.get("env_steps", 0),
            "sps": published.get("sps", 0.0),
            "returns": returns,
            "policy_lag_median": published.get("policy_lag"),
            "checkpoint": published.get("checkpoint"),
            "checkpoint_step": published.get("checkpoint_step"),
            "final": bool(published.get("final")),
            "metrics": {k: v for k, v in published.items() if loss_name(k)},
        }
        with contextlib.suppress(ValueError):  # a malformed publication keeps the one before
            self.statuses[0] = RankStatus.from_mapping(record)

    def recent_return(self) -> float | None:
        """Mean return over the last `target_window` episodes each rank saw (None before that)."""
        window = self.cfg.target_window
        returns = [r for s in self.statuses.values() for r in s.returns[-window:]]
        if len(returns) < window:
            return None
        return float(sum(returns) / len(returns))

    def env_steps(self) -> int:
        return sum(s.env_steps for s in self.statuses.values())

    def version(self) -> int:
        return max((s.version for s in self.statuses.values()), default=0)

    def policy_lag(self) -> float | None:
        lags = [s.policy_lag_median for s in self.statuses.values()]
        finite = [x for x in lags if x is not None]
        return max(finite) if finite else None

    def draw(self, elapsed: float) -> None:
        if self.progress is None:
            return
        ret = self.recent_return()
        steps = self.env_steps()
        lag = self.policy_lag()
        fraction = elapsed / self.cfg.time_limit_s
        if self.target is not None and ret is not None:
            fraction = max(
                fraction, min(1.0, max(0.0, ret) / self.target if self.target > 0 else 0)
            )
        text = (
            f"{self.env_id} steps {si(steps)} | {si(steps / elapsed if elapsed > 0 else 0)} sps | "
            f"return {'-' if ret is None else f'{ret:.1f}'}"
            f"{'' if self.target is None else f'/{self.target:g}'} | "
            f"lag {'-' if lag is None else f'{lag:.1f}'} | v{self.version()} | {elapsed:.1f}s"
        )
        self.progress.update(text, fraction)

    def stop_reason(self, elapsed: float) -> str | None:
        ret = self.recent_return()
        if self.target is not None and ret is not None and ret >= self.target:
            return "target"
        if elapsed >= self.cfg.time_limit_s:
            return "time_limit"
        if self.cfg.max_env_steps is not None and self.env_steps() >= self.cfg.max_env_steps:
            return "max_env_steps"
        return None

    def result(
        self,
        stopped_by: str,
        wall_s: float,
        solve_s: float | None,
        stop_return: float | None,
        startup_s: float | None,
    ) -> TrainResult:
        ret = self.recent_return()
        steps = self.env_steps()
        lead = self.statuses.get(0, RankStatus())
        checkpoint = self.complete_checkpoint()
        return TrainResult(
            run_dir=str(self.run_dir),
            env_id=self.env_id,
            solved=stopped_by == "target",
            final_return=stop_return if stopped_by == "target" else ret,
            target_return=self.target,
            env_steps=steps,
            wall_s=wall_s,
            solve_s=solve_s,
            startup_s=startup_s,
            sps=steps / wall_s if wall_s > 0 else 0.0,
            learner_sps=sum(s.sps for s in self.statuses.values()),
            policy_lag_median=self.policy_lag(),
            restarts=0,
            stopped_by=stopped_by,
            checkpoint=None if checkpoint is None else str(checkpoint.path),
            checkpoint_step=None if checkpoint is None else checkpoint.step,
            checkpoint_error=self.unwritten_checkpoint(checkpoint),
            intake=dict(lead.intake),
        )

    def complete_checkpoint(self) -> Any:
        """The newest complete checkpoint in the run's directory (CheckpointInfo), or None.
        Rank 0's status names the checkpoint it last began to write, which a full disk may
        never have let it finish: a run reports and records only what it has verified."""
        from shoal.learner.checkpoint import CheckpointManager
        from shoal.learner.job import checkpoint_dir

        directory = checkpoint_dir(self.cfg, self.run_dir)
        if not directory.is_dir():
            return None
        with CheckpointManager(directory) as manager:
            return manager.latest()

    def unwritten_checkpoint(self, complete: Any) -> str | None:
        """What to tell the user when rank 0 began a newer checkpoint than `complete`."""
        lead = self.statuses.get(0, RankStatus())
        step = lead.checkpoint_step
        if step is None or (complete is not None and complete.step >= step):
            return None
        error = lead.checkpoint_error
        return f"checkpoint step {step} was not written" + (
            f"; the last failed write: {error}" if error else ""
        )


def find_checkpoint(path: Path) -> Any:
    """The CheckpointInfo for a run dir, a checkpoints dir, or one checkpoint: its directory
    (format 2), its .pt file (format 1) or its manifest."""
    from shoal.learner.checkpoint import CheckpointManager

    if path.is_dir() and not _is_one_checkpoint(path):
        directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        with CheckpointManager(directory) as manager:
            info = manager.latest()
        if info is None:
            raise TrainError(f"no complete checkpoint in {directory}; train first or pick a file")
        return info
    if not path.exists():
        raise TrainError(f"checkpoint {path} does not exist")
    wanted = path.resolve()
    with CheckpointManager(path.parent) as manager:
        for info in manager.list_complete():
            if wanted in (info.path.resolve(), info.manifest.resolve()):
                return info
    raise TrainError(
        f"{path} is not a complete checkpoint (missing manifest or hash mismatch); "
        "pass a run directory to use its newest complete one"
    )


def _is_one_checkpoint(path: Path) -> bool:
    """A format-2 checkpoint's own directory (`ckpt-<step>/` beside `ckpt-<step>.json`)."""
    return bool(re.fullmatch(r"ckpt-\d{12}", path.name)) and path.with_suffix(".json").exists()
