"""`shoal train`: the run directory, what the learner ranks report, and the final evaluation.

Every run is a coordinator job (shoal/cluster_train.py, `ClusterRun`): its learner ranks and
rollout workers are tasks that a node daemon runs as child processes. With a `shoal up` cluster
the job goes there; otherwise `train` starts an embedded cluster of its own in the run
directory (one coordinator replica and one node daemon, shoal/local.py `embedded_cluster`)
and stops it when the run is over, however it ends. This module lays out the run directory
(job.json, checkpoints/, reports/), turns the
ranks' status files into the progress line, the stop decision and the summary, and evaluates
the final checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.errors import ShoalError
from shoal.progress import ProgressLine, si

if TYPE_CHECKING:
    from shoal.cluster_train import ClusterRun, Coordinators
    from shoal.learner.config import TrainConfig
    from shoal.local import LocalCluster

MIN_FREE_BYTES = 16 << 20
"""Free space a run directory needs to start: journals, logs and a few small checkpoints."""


class TrainError(ShoalError):
    """The run could not start, or its job failed; the message names the log to read."""


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
    report: str | None = None
    report_html: str | None = None
    eval_mean_return: float | None = None
    intake: dict[str, int] = field(default_factory=dict)
    job_id: str | None = None
    """The coordinator job the run was."""
    cluster: dict[str, Any] = field(default_factory=dict)
    """Where it ran: `coordinators` (API URLs), `embedded` (started by this run, in its run
    directory) and, for an embedded one, `logs` (coordinator, node) and `task_logs`."""


def interrupt_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM stops a run in order, exactly like Ctrl-C."""
    raise KeyboardInterrupt


def make_run_dir(root: Path, env_id: str) -> Path:
    """runs/<UTC timestamp>-<env>[-n] with checkpoints/ and reports/."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    base = root / f"{stamp}-{env_id.replace('/', '_').replace(':', '_')}"
    run_dir = base
    n = 1
    while run_dir.exists():
        n += 1
        run_dir = base.with_name(f"{base.name}-{n}")
    return _fresh_dir(run_dir)


def _fresh_dir(run_dir: Path) -> Path:
    """An explicitly named run directory; reusing one resumes from its checkpoints."""
    try:
        for sub in ("checkpoints", "reports"):
            (run_dir / sub).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TrainError(f"cannot create run directory {run_dir}: {exc.strerror}") from exc
    return run_dir


def check_room(run_dir: Path) -> None:
    """Refuse a run directory on a nearly full disk before anything starts: the embedded
    coordinator's Raft journal, the logs and the checkpoints all go there, and a replica
    that finds no room for its journal stops."""
    free = shutil.disk_usage(run_dir).free
    if free < MIN_FREE_BYTES:
        raise TrainError(
            f"run directory {run_dir} has {free} bytes free, less than the {MIN_FREE_BYTES} a "
            "run needs to start; free space or choose a --run-dir on a larger disk"
        )


def write_job_record(run_dir: Path, cfg: TrainConfig, env_id: str, extra: dict[str, Any]) -> None:
    """job.json: the resolved config the job was submitted with, plus `extra` (its id and
    coordinators), for whoever looks at the run later. The tasks do not read it: they get
    the same through the coordinators (learner/job.py)."""
    job = {"env_id": env_id, "config": asdict(cfg), **extra}
    (run_dir / "job.json").write_text(json.dumps(job, indent=1))


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
        self.statuses: dict[int, dict[str, Any]] = {}

    def read(self) -> None:
        for rank in range(self.cfg.learner.ranks):
            path = self.run_dir / f"status-{rank}.json"
            with contextlib.suppress(OSError, ValueError):
                self.statuses[rank] = json.loads(path.read_text())

    def take_published(self, published: dict[str, Any]) -> None:
        """Rank 0's progress as it published it (learner_main `publish_progress`): the source
        when the ranks run on other hosts and their status files are out of reach. Its window
        of returns stands for the group's (rank 0 sees its own actors' episodes only)."""
        from shoal.learner.job_metrics import loss_name

        count, mean = published.get("returns"), published.get("recent_return")
        returns = (
            [float(mean)] * int(count)
            if isinstance(mean, int | float) and isinstance(count, int)
            else []
        )
        self.statuses[0] = {
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

    def recent_return(self) -> float | None:
        """Mean return over the last `target_window` episodes each rank saw (None before that)."""
        window = self.cfg.target_window
        returns = [r for s in self.statuses.values() for r in s.get("returns", [])[-window:]]
        if len(returns) < window:
            return None
        return float(sum(returns) / len(returns))

    def env_steps(self) -> int:
        return int(sum(s.get("env_steps", 0) for s in self.statuses.values()))

    def version(self) -> int:
        return int(max((s.get("version", 0) for s in self.statuses.values()), default=0))

    def policy_lag(self) -> float | None:
        lags = [s.get("policy_lag_median") for s in self.statuses.values()]
        finite = [float(x) for x in lags if isinstance(x, int | float) and math.isfinite(x)]
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
        lead = self.statuses.get(0, {})
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
            learner_sps=float(sum(s.get("sps", 0.0) for s in self.statuses.values())),
            policy_lag_median=self.policy_lag(),
            restarts=0,
            stopped_by=stopped_by,
            checkpoint=None if checkpoint is None else str(checkpoint.path),
            checkpoint_step=None if checkpoint is None else checkpoint.step,
            checkpoint_error=self.unwritten_checkpoint(checkpoint),
            intake={k: int(v) for k, v in lead.get("intake", {}).items()},
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
        lead = self.statuses.get(0, {})
        step = lead.get("checkpoint_step")
        if not isinstance(step, int) or (complete is not None and complete.step >= step):
            return None
        error = lead.get("checkpoint_error")
        return f"checkpoint step {step} was not written" + (
            f"; the last failed write: {error}" if error else ""
        )


# -- checkpoints → policies → evaluation ------------------------------------------------------


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


def load_policy(path: Path) -> tuple[Any, dict[str, Any], Any]:
    """(the policy with the checkpoint's weights, its trainer state, its CheckpointInfo). Either
    format, whatever number of ranks saved it; no process group needed."""
    from shoal.learner.checkpoint import CheckpointManager
    from shoal.learner.checkpoint_files import LEGACY_FORMAT
    from shoal.learner.errors import PolicyError
    from shoal.learner.models import model_from_spec

    info = find_checkpoint(path)
    with CheckpointManager(info.path.parent) as manager:
        if info.format == LEGACY_FORMAT:
            state = manager.load_legacy(info)
            trainer = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
        else:
            trainer = manager.load_trainer(info)
        try:
            model = model_from_spec(trainer["policy_spec"])
        except (KeyError, PolicyError) as exc:
            raise TrainError(f"{info.path} is not a shoal training checkpoint ({exc})") from exc
        if info.format == LEGACY_FORMAT:
            weights = state.get("model")
            if not isinstance(weights, dict):
                raise TrainError(f"{info.path} is not a shoal training checkpoint (no model)")
        else:
            weights = {"model": model.state_dict()}
            manager.load_tensors(info, weights)
            weights = weights["model"]
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        raise TrainError(f"{info.path}'s weights do not fit its policy_spec: {exc}") from None
    model.eval()
    return model, trainer, info


def evaluate_checkpoint(
    path: Path,
    env_id: str,
    episodes: int,
    out_dir: Path,
    seed: int = 12345,
    env_kwargs: dict[str, Any] | None = None,
    success_threshold: float | None = None,
) -> tuple[Any, Path, Path]:
    """Evaluate the policy in a checkpoint deterministically; returns (result, json, html)."""
    import numpy as np

    from shoal.envs.evaluation import EvalOptions, evaluate, write_report

    model, _, _ = load_policy(path)

    def policy(obs: np.ndarray) -> np.ndarray:
        actions, _, _ = model.act(obs, deterministic=True)
        return actions

    options = EvalOptions(
        episodes=episodes, num_envs=min(episodes, 32), success_threshold=success_threshold
    )
    result = evaluate(
        policy, env_id, episodes=episodes, seed=seed, env_kwargs=env_kwargs, options=options
    )
    json_path, html_path = write_report(result, out_dir)
    return result, json_path, html_path


def _check_env(env_id: str, cfg: TrainConfig) -> None:
    """Make one copy here, so bad env_kwargs are one clear error, not a crash-looping worker."""
    from shoal.envs.vector import make_vector

    try:
        env = make_vector(env_id, 1, seed=cfg.seed, **cfg.env_kwargs)
    except TypeError as exc:
        raise TrainError(f"env_kwargs {cfg.env_kwargs!r} don't fit {env_id}: {exc}") from None
    try:
        if env.single_observation_space.shape is None:
            raise TrainError(
                f"{env_id} has no fixed observation shape; shoal's MLP policy needs one"
            )
    finally:
        env.close()


def train(
    cfg: TrainConfig,
    *,
    run_dir: Path | None = None,
    runs_root: Path = Path("runs"),
    progress: ProgressLine | None = None,
    evaluate_at_end: bool = True,
    on_poll: Callable[[ClusterRun], None] | None = None,
    coordinators: Coordinators | None = None,
    max_restarts: int = 5,
    restart_window_s: float = 600.0,
) -> TrainResult:
    """Run `cfg` (a TrainConfig) to its target or limit; checkpoint, evaluate, report. The
    processes are a job on `coordinators`' cluster, or on an embedded one started here.
    `max_restarts` restarts of its tasks within `restart_window_s` seconds, and one more
    failure fails the job."""
    from shoal.cluster_train import ClusterRun, RestartPolicy

    RestartPolicy(max_restarts, restart_window_s)  # refused before any process starts
    from shoal.envs import registry

    env_id = registry.spec(cfg.env_id).id  # unknown ids fail here, before any process starts
    _check_env(env_id, cfg)
    if cfg.learner.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise TrainError("learner.backend = 'nccl' needs CUDA, which this machine lacks")
    run_dir = make_run_dir(runs_root, env_id) if run_dir is None else _fresh_dir(run_dir)
    run_dir = run_dir.resolve()  # the nodes' tasks run elsewhere than here: absolute paths only
    check_room(run_dir)
    previous = signal.signal(signal.SIGTERM, interrupt_on_sigterm)
    try:
        with _cluster(run_dir, coordinators) as (where, local, started):
            run = ClusterRun(
                cfg,
                env_id,
                run_dir,
                where,
                progress=progress,
                max_restarts=max_restarts,
                restart_window_s=restart_window_s,
                on_poll=on_poll,
                embedded=local,
            )
            result = run.run(started)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if progress is not None:
        progress.close()
    if evaluate_at_end and result.checkpoint is not None:
        eval_result, json_path, html_path = evaluate_checkpoint(
            Path(result.checkpoint),
            env_id,
            cfg.eval.episodes,
            run_dir / "reports",
            seed=cfg.seed + 12345,
            env_kwargs=cfg.env_kwargs,
            success_threshold=run.status.target,
        )
        result.report = str(json_path)
        result.report_html = str(html_path)
        result.eval_mean_return = float(eval_result.mean_return)
        if run.embedded is None:  # a cluster that outlives the run: its events keep the report
            run.record_report(result)
    (run_dir / "result.json").write_text(json.dumps(asdict(result), indent=1))
    return result


@contextlib.contextmanager
def _cluster(
    run_dir: Path, coordinators: Coordinators | None
) -> Iterator[tuple[Coordinators, LocalCluster | None, float]]:
    """(the cluster to submit to, the embedded cluster if it is one, when the run started):
    `coordinators` as given, or an embedded cluster in `run_dir`, started before the rest of
    the run's start-up so the two overlap, and ready (a leader) on entry; it is stopped when
    the block ends."""
    from shoal.cluster_train import Coordinators
    from shoal.local import LocalClusterError, embedded_cluster

    if coordinators is not None:
        started = time.monotonic()
        _warm_imports()
        yield coordinators, None, started
        return
    started = time.monotonic()
    try:
        with embedded_cluster(run_dir) as local:
            where = Coordinators(local.api_urls(), local.run_dir / "api-token")
            _warm_imports()
            local.wait_ready(timeout=60.0)
            yield where, local, started
    except LocalClusterError as exc:
        raise TrainError(f"the embedded cluster did not start: {exc}") from exc


def _warm_imports() -> None:
    """What the run imports anyway (torch; the API client; the learner's helpers), done while
    the embedded cluster starts up rather than after it is ready."""
    import importlib

    import torch

    for module in ("shoal.raft.client", "shoal.learner.learner_main", "shoal.learner.group"):
        importlib.import_module(module)
    # Small batches on many threads spin more than they compute; the children do the same.
    torch.set_num_threads(1)
