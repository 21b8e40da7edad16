"""The embedded local run behind `shoal train`: learner ranks and rollout workers as child processes.

`LocalRun` lays out a run directory (per-process logs, pid files, the cluster token readable by
its owner only, checkpoints/, reports/), starts every learner rank and rollout worker as a real
process talking over the transport on 127.0.0.1, and watches them: it draws the progress bar
from the ranks' status files, stops at the target return, the time limit or the step budget,
and restarts what dies — a dead learner rank takes its whole group down, which is started again
and resumes from the newest complete checkpoint; a dead rollout worker is started again alone.
On stop, the learners are asked to finish first (so rank 0 writes the final checkpoint), then
the rollout workers; anything still alive after a grace period is killed, and every child is
reaped, so no process outlives the run. Then the final checkpoint is evaluated.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.errors import ShoalError
from shoal.local import free_port
from shoal.progress import ProgressLine, si

if TYPE_CHECKING:
    from shoal.cluster_train import Coordinators
    from shoal.learner.config import TrainConfig

POLL_S = 0.05
STOP_GRACE_S = 20.0
LEARNER_NAME = "learner"


class TrainError(ShoalError):
    """The local run could not start, or kept failing; the message names the log to read."""


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
    """Seconds from the start until the first policy update (process start-up, imports, first
    fragment)."""
    sps: float
    """Environment steps per second over the whole run, process start-up included."""
    learner_sps: float
    """Environment steps per second the learners received, from their start (steady state)."""
    policy_lag_median: float | None
    restarts: int
    stopped_by: str
    checkpoint: str | None = None
    checkpoint_step: int | None = None
    report: str | None = None
    report_html: str | None = None
    eval_mean_return: float | None = None
    intake: dict[str, int] = field(default_factory=dict)
    job_id: str | None = None
    """The coordinator job the run was, when it ran through a cluster."""


@dataclass
class _Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the `shoal train` process dies (Linux)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def make_run_dir(root: Path, env_id: str) -> Path:
    """runs/<UTC timestamp>-<env>[-n] with logs/, pids/, checkpoints/, reports/."""
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
        for sub in ("logs", "pids", "checkpoints", "reports"):
            (run_dir / sub).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TrainError(f"cannot create run directory {run_dir}: {exc.strerror}") from exc
    return run_dir


def write_token(run_dir: Path) -> None:
    """A fresh cluster token, created with mode 0600 so only this user can read it."""
    path = run_dir / "cluster.token"
    if path.exists():
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_hex(32) + "\n")


class LocalRun:
    """One embedded training run; `run()` blocks until it is over and everything is reaped."""

    def __init__(
        self,
        cfg: TrainConfig,
        env_id: str,
        run_dir: Path,
        progress: ProgressLine | None = None,
        max_restarts: int = 5,
        on_poll: Callable[[LocalRun], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.env_id = env_id
        self.run_dir = run_dir
        self.progress = progress
        self.max_restarts = max_restarts
        self.on_poll = on_poll
        self.target = cfg.resolved_target(env_id)
        self.restarts = 0
        self.learners: list[_Child] = []
        self.rollouts: list[_Child] = []
        self.statuses: dict[int, dict[str, Any]] = {}
        self.started = 0.0
        self.solve_s: float | None = None
        self.stop_return: float | None = None
        self.startup_s: float | None = None

    # -- layout ------------------------------------------------------------------------------

    def _learner_ports(self) -> list[int]:
        return [free_port() for _ in range(self.cfg.learner.ranks)]

    def _write_job(self, learner_ports: list[int]) -> None:
        from shoal.learner.group import assign

        cfg = self.cfg
        names = [
            f"rollout-{w}-{a}"
            for w in range(cfg.rollout.workers)
            for a in range(cfg.rollout.actors_per_worker)
        ]
        shares = assign(names, cfg.learner.ranks)
        rank_of = {name: rank for rank, share in enumerate(shares) for name in share}
        workers: list[list[dict[str, Any]]] = []
        for w in range(cfg.rollout.workers):
            specs = []
            for a in range(cfg.rollout.actors_per_worker):
                name = f"rollout-{w}-{a}"
                port = learner_ports[rank_of[name]]
                specs.append(
                    {
                        "name": name,
                        "env_id": self.env_id,
                        "env_kwargs": cfg.env_kwargs,
                        "num_envs": cfg.rollout.num_envs,
                        "horizon": cfg.rollout.horizon,
                        "seed": cfg.seed + 1000 * (w * cfg.rollout.actors_per_worker + a + 1),
                        "learner_path": f"shoal://127.0.0.1:{port}/{LEARNER_NAME}",
                        "hidden": list(cfg.hidden),
                        "fragments_per_version": self._pace_share(),
                    }
                )
            workers.append(specs)
        job = {
            "env_id": self.env_id,
            "config": asdict(cfg),
            "workers": workers,
            **self._job_extra(),
        }
        (self.run_dir / "job.json").write_text(json.dumps(job, indent=1))

    def _job_extra(self) -> dict[str, Any]:
        """More keys for job.json (a cluster run adds where rank 0 posts its metrics)."""
        return {}

    def _pace_share(self) -> float:
        """Each actor's share of the fragments its rank trains on per version (0: unpaced)."""
        cfg = self.cfg
        if not cfg.rollout.pace:
            return 0.0
        return cfg.intake.fragments_per_update * cfg.learner.ranks / cfg.total_actors

    def _child_env(self, extra: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra})
        return env

    def _prepare(self) -> None:
        write_token(self.run_dir)
        ports = self._learner_ports()
        self._write_job(ports)
        py = sys.executable
        self.learners = []
        for rank in range(self.cfg.learner.ranks):
            argv = [py, "-m", "shoal.learner.learner_main", "--run-dir", str(self.run_dir)]
            argv += ["--port", str(ports[rank])]
            self.learners.append(_Child(f"learner-{rank}", argv, {}))
        self._assign_group()
        self.rollouts = [
            _Child(
                f"rollout-{w}",
                [
                    py,
                    "-m",
                    "shoal.learner.rollout_main",
                    "--run-dir",
                    str(self.run_dir),
                    "--worker",
                    str(w),
                ],
                self._child_env({}),
            )
            for w in range(self.cfg.rollout.workers)
        ]

    def _assign_group(self) -> None:
        """Fresh rendezvous port for a (re-)formed learner group."""
        from shoal.learner.group import GroupSpec

        port = free_port()
        world = self.cfg.learner.ranks
        for rank, child in enumerate(self.learners):
            spec = GroupSpec(
                rank=rank,
                world_size=world,
                port=port if world > 1 else 0,
                backend=self.cfg.learner.backend,
            )
            child.env = self._child_env(spec.to_env())

    # -- processes ---------------------------------------------------------------------------

    def _start(self, child: _Child) -> None:
        log_path = self.run_dir / "logs" / f"{child.name}.log"
        with log_path.open("ab") as log:
            child.proc = subprocess.Popen(
                child.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child.env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        child.starts += 1
        (self.run_dir / "pids" / f"{child.name}.pid").write_text(f"{child.proc.pid}\n")

    def _launch(self) -> None:
        for child in (*self.learners, *self.rollouts):
            self._start(child)

    def _signal(self, children: list[_Child], signum: int) -> None:
        for child in children:
            if child.proc is not None and child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signum)

    def _reap(self, children: list[_Child], grace_s: float) -> None:
        """Wait for `children` to exit; SIGKILL whatever is left after `grace_s`."""
        deadline = time.monotonic() + grace_s
        for child in children:
            proc = child.proc
            if proc is None:
                continue
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            (self.run_dir / "pids" / f"{child.name}.pid").unlink(missing_ok=True)

    def _restart_learners(self, why: str) -> None:
        self._count_restart(why)
        self._signal(self.learners, signal.SIGKILL)
        self._reap(self.learners, 0.0)
        for rank in range(len(self.learners)):
            (self.run_dir / f"learner-{rank}.addr").unlink(missing_ok=True)
        self._assign_group()
        for child in self.learners:
            self._start(child)

    def _count_restart(self, why: str) -> None:
        from shoal.learner.learner_main import append_event

        self.restarts += 1
        append_event(self.run_dir, {"event": "restart", "why": why, "restarts": self.restarts})
        if self.restarts > self.max_restarts:
            raise TrainError(
                f"gave up after {self.max_restarts} restarts ({why}); read the logs in "
                f"{self.run_dir / 'logs'}"
            )

    def _check_children(self) -> None:
        for child in self.learners:
            code = child.proc.poll() if child.proc is not None else None
            if code is not None:
                self._restart_learners(f"{child.name} exited with status {code}")
                return
        for child in self.rollouts:
            code = child.proc.poll() if child.proc is not None else None
            if code is not None:
                self._count_restart(f"{child.name} exited with status {code}")
                self._start(child)

    # -- progress ----------------------------------------------------------------------------

    def _read_statuses(self) -> None:
        for rank in range(len(self.learners)):
            path = self.run_dir / f"status-{rank}.json"
            with contextlib.suppress(OSError, ValueError):
                self.statuses[rank] = json.loads(path.read_text())

    def recent_return(self) -> float | None:
        """Mean return over the last `target_window` episodes each rank saw (None before that)."""
        window = self.cfg.target_window
        returns = [r for s in self.statuses.values() for r in s.get("returns", [])[-window:]]
        if len(returns) < window:
            return None
        return float(sum(returns) / len(returns))

    def env_steps(self) -> int:
        return int(sum(s.get("env_steps", 0) for s in self.statuses.values()))

    def policy_lag(self) -> float | None:
        lags = [s.get("policy_lag_median") for s in self.statuses.values()]
        finite = [float(x) for x in lags if isinstance(x, int | float) and math.isfinite(x)]
        return max(finite) if finite else None

    def _draw(self, elapsed: float) -> None:
        if self.progress is None:
            return
        ret = self.recent_return()
        steps = self.env_steps()
        lag = self.policy_lag()
        version = max((s.get("version", 0) for s in self.statuses.values()), default=0)
        fraction = elapsed / self.cfg.time_limit_s
        if self.target is not None and ret is not None:
            fraction = max(
                fraction, min(1.0, max(0.0, ret) / self.target if self.target > 0 else 0)
            )
        text = (
            f"{self.env_id} steps {si(steps)} | {si(steps / elapsed if elapsed > 0 else 0)} sps | "
            f"return {'-' if ret is None else f'{ret:.1f}'}"
            f"{'' if self.target is None else f'/{self.target:g}'} | "
            f"lag {'-' if lag is None else f'{lag:.1f}'} | v{version} | {elapsed:.1f}s"
        )
        self.progress.update(text, fraction)

    def _stop_reason(self, elapsed: float) -> str | None:
        ret = self.recent_return()
        if self.target is not None and ret is not None and ret >= self.target:
            return "target"
        if elapsed >= self.cfg.time_limit_s:
            return "time_limit"
        if self.cfg.max_env_steps is not None and self.env_steps() >= self.cfg.max_env_steps:
            return "max_env_steps"
        return None

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> TrainResult:
        """Run to a stop; SIGTERM to this process is handled like Ctrl-C (an orderly stop)."""
        from shoal.learner.learner_main import append_event

        self._prepare()
        self.started = time.monotonic()
        append_event(self.run_dir, {"event": "run", "pid": os.getpid(), "env_id": self.env_id})
        stopped_by = "error"
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            self._launch()
            while True:
                time.sleep(POLL_S)
                self._check_children()
                self._read_statuses()
                elapsed = time.monotonic() - self.started
                if self.startup_s is None and any(
                    s.get("version", 0) for s in self.statuses.values()
                ):
                    self.startup_s = elapsed
                self._draw(elapsed)
                if self.on_poll is not None:
                    self.on_poll(self)
                reason = self._stop_reason(elapsed)
                if reason is not None:
                    if reason == "target":
                        self.solve_s = elapsed
                        self.stop_return = self.recent_return()
                    stopped_by = reason
                    break
        except KeyboardInterrupt:
            stopped_by = "interrupted"
        finally:
            self.shutdown()
            signal.signal(signal.SIGTERM, previous)
        self._read_statuses()
        return self._result(stopped_by, time.monotonic() - self.started)

    def shutdown(self) -> None:
        """Learners first (final checkpoint), then rollout workers; everything reaped."""
        self._signal(self.learners, signal.SIGTERM)
        self._reap(self.learners, STOP_GRACE_S)
        self._signal(self.rollouts, signal.SIGTERM)
        self._reap(self.rollouts, STOP_GRACE_S)

    def _result(self, stopped_by: str, wall_s: float) -> TrainResult:
        ret = self.recent_return()
        steps = self.env_steps()
        lead = self.statuses.get(0, {})
        return TrainResult(
            run_dir=str(self.run_dir),
            env_id=self.env_id,
            solved=stopped_by == "target",
            final_return=self.stop_return if stopped_by == "target" else ret,
            target_return=self.target,
            env_steps=steps,
            wall_s=wall_s,
            solve_s=self.solve_s,
            startup_s=self.startup_s,
            sps=steps / wall_s if wall_s > 0 else 0.0,
            learner_sps=float(sum(s.get("sps", 0.0) for s in self.statuses.values())),
            policy_lag_median=self.policy_lag(),
            restarts=self.restarts,
            stopped_by=stopped_by,
            checkpoint=lead.get("checkpoint"),
            checkpoint_step=lead.get("checkpoint_step"),
            intake={k: int(v) for k, v in lead.get("intake", {}).items()},
        )


# -- checkpoints → policies → evaluation ------------------------------------------------------


def find_checkpoint(path: Path) -> Any:
    """The CheckpointInfo for a run dir, a checkpoints dir, or one checkpoint's .pt/.json file."""
    from shoal.learner.checkpoint import CheckpointManager

    if path.is_dir():
        directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        info = CheckpointManager(directory).latest()
        if info is None:
            raise TrainError(f"no complete checkpoint in {directory}; train first or pick a file")
        return info
    if not path.exists():
        raise TrainError(f"checkpoint {path} does not exist")
    for info in CheckpointManager(path.parent).list_complete():
        if path in (info.path, info.manifest):
            return info
    raise TrainError(
        f"{path} is not a complete checkpoint (missing manifest or hash mismatch); "
        "pass a run directory to use its newest complete one"
    )


def load_policy(path: Path) -> tuple[Any, dict[str, Any], Any]:
    """(ActorCritic with the checkpoint's weights, the checkpoint state, its CheckpointInfo)."""
    from shoal.learner.checkpoint import CheckpointManager
    from shoal.learner.policy import ActorCritic

    info = find_checkpoint(path)
    state = CheckpointManager(info.path.parent).load(info)
    try:
        model = ActorCritic.from_spec(state["policy_spec"])
        model.load_state_dict(state["model"])
    except KeyError as exc:
        raise TrainError(f"{info.path} is not a shoal training checkpoint (no {exc})") from exc
    model.eval()
    return model, state, info


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
    on_poll: Callable[[LocalRun], None] | None = None,
    coordinators: Coordinators | None = None,
) -> TrainResult:
    """Run `cfg` (a TrainConfig) to its target or limit; checkpoint, evaluate, report. With
    `coordinators`, the processes are a job on that cluster; otherwise children of this one."""
    import torch

    from shoal.envs import registry

    env_id = registry.spec(cfg.env_id).id  # unknown ids fail here, before any process starts
    _check_env(env_id, cfg)
    # Small batches on many threads spin more than they compute; the children do the same.
    torch.set_num_threads(1)
    if cfg.learner.backend == "nccl" and not torch.cuda.is_available():
        raise TrainError("learner.backend = 'nccl' needs CUDA, which this machine lacks")
    run_dir = make_run_dir(runs_root, env_id) if run_dir is None else _fresh_dir(run_dir)
    local: LocalRun
    if coordinators is None:
        local = LocalRun(cfg, env_id, run_dir, progress=progress, on_poll=on_poll)
    else:
        from shoal.cluster_train import ClusterRun

        local = ClusterRun(cfg, env_id, run_dir, coordinators, progress=progress, on_poll=on_poll)
    result = local.run()
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
            success_threshold=local.target,
        )
        result.report = str(json_path)
        result.report_html = str(html_path)
        result.eval_mean_return = float(eval_result.mean_return)
    (run_dir / "result.json").write_text(json.dumps(asdict(result), indent=1))
    return result
