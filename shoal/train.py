"""`shoal train`: start a run, hand it to its job, evaluate the final checkpoint.

Every run is a coordinator job (shoal/cluster_train.py, `ClusterRun`): its learner ranks and
rollout workers are tasks that a node daemon runs as child processes. With a `shoal up` cluster
the job goes there; otherwise `train` starts an embedded cluster of its own in the run
directory (one coordinator replica and one node daemon, shoal/local_embedded.py
`embedded_cluster`) and stops it when the run is over, however it ends. The run directory's
files are named in shoal/rundir.py, what the ranks report becomes the summary in
shoal/run_status.py; this module checks the job before anything starts, runs it, evaluates the
final checkpoint and loads policies from checkpoints (`shoal eval`, `shoal export`).
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.cluster_train import ClusterRun, Coordinators, RestartPolicy
from shoal.run_status import TrainResult, find_checkpoint
from shoal.rundir import RunDir, TrainError

if TYPE_CHECKING:
    from shoal.envs.wrappers import EnvConfig
    from shoal.learner.config import TrainConfig
    from shoal.local import LocalCluster
    from shoal.progress import ProgressLine


def interrupt_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM stops a run in order, exactly like Ctrl-C."""
    raise KeyboardInterrupt


# -- checkpoints → policies → evaluation ------------------------------------------------------


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
    *,
    env: EnvConfig | None = None,
    label: str | None = None,
    curves_from: Path | None = None,
    progress: ProgressLine | None = None,
) -> tuple[Any, Path, Path]:
    """Evaluate the policy in a checkpoint deterministically; returns (result, json, html).
    `label` names a report of its own (see `write_report`); the learning curves of the run
    in `curves_from` go on its page; `progress` shows the episodes as they finish."""
    import numpy as np

    from shoal.curves_report import curves_section
    from shoal.envs.evaluation import EvalOptions, evaluate, write_report

    model, _, _ = load_policy(path)

    def policy(obs: np.ndarray) -> np.ndarray:
        actions, _, _ = model.act(obs, deterministic=True)
        return actions

    options = EvalOptions(
        episodes=episodes, num_envs=min(episodes, 32), success_threshold=success_threshold
    )

    def show(condition: str, done: int, total: int) -> None:
        if progress is not None:
            text = f"evaluating {env_id}: {condition} | {done}/{total} episodes"
            progress.update(text, done / total if total else None)

    result = evaluate(
        policy,
        env_id,
        episodes=episodes,
        seed=seed,
        env_kwargs=env_kwargs,
        options=options,
        progress=show,
        env=env,
    )
    if progress is not None:
        progress.close()
    section = None if curves_from is None else curves_section(curves_from)
    sections = [] if section is None else [section]
    json_path, html_path = write_report(result, out_dir, label=label, sections=sections)
    return result, json_path, html_path


def _check_env(env_id: str, cfg: TrainConfig) -> None:
    """Pre-flight: make one copy here, wrapped as the workers wrap it, build the model for its
    spaces, size its fragments (learner/preflight.py) and reset it once, so bad env_kwargs, a
    model that cannot train on the environment, a fragment no frame holds or a plugin's first
    observation that does not fit its space are one clear error, not crash-looping ranks and
    workers. A horizon the actors will shorten is printed as one line."""
    from shoal.envs.vector import make_vector
    from shoal.learner.preflight import check_fragment, check_spaces

    try:
        env = make_vector(env_id, 1, seed=cfg.seed, env=cfg.env, **cfg.env_kwargs)
    except TypeError as exc:
        raise TrainError(f"env_kwargs {cfg.env_kwargs!r} don't fit {env_id}: {exc}") from None
    try:
        policy = check_spaces(
            env_id, cfg.model, env.single_observation_space, env.single_action_space
        )
        note = check_fragment(cfg.rollout, policy, env.single_action_space)
        env.reset()  # a first observation that does not fit its space: one PackingError here
    finally:
        env.close()
    if note is not None:
        print(note, flush=True)


def _step_env_id(cfg: TrainConfig) -> str:
    """The canonical id of a stepped environment (unknown ids fail here), checked by making one."""
    from shoal.envs import registry

    env_id = registry.spec(cfg.env_id).id
    _check_env(env_id, cfg)
    return env_id


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
    RestartPolicy(max_restarts, restart_window_s)  # refused before any process starts
    from shoal.learner.text_job import is_text_job, resolve

    text = is_text_job(cfg.env_id)  # a causal LM writes its completions (learner/text_job.py)
    env_id, cfg = resolve(cfg) if text else (_step_env_id(cfg), cfg)
    if cfg.learner.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise TrainError("learner.backend = 'nccl' needs CUDA, which this machine lacks")
    laid_out = RunDir.create(runs_root, env_id) if run_dir is None else RunDir.lay_out(run_dir)
    directory = RunDir(laid_out.path.resolve())  # the tasks run elsewhere: absolute paths only
    directory.check_room()
    run_dir = directory.path
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
    result.best_checkpoint, result.best_return = _best(result.checkpoint)
    if progress is not None:
        progress.close()
    if evaluate_at_end and result.checkpoint is not None:
        if text:
            from shoal.learner.text_job import evaluate_checkpoint as evaluate_text

            mean, json_path, html_path = evaluate_text(
                Path(result.checkpoint), env_id, cfg, directory.reports, seed=cfg.seed + 12345
            )
        else:
            eval_result, json_path, html_path = evaluate_checkpoint(
                Path(result.checkpoint),
                env_id,
                cfg.eval.episodes,
                directory.reports,
                seed=cfg.seed + 12345,
                env_kwargs=cfg.env_kwargs,
                env=cfg.env,
                success_threshold=run.status.target,
                curves_from=run_dir,
                progress=progress,
            )
            mean = float(eval_result.mean_return)
        result.report = str(json_path)
        result.report_html = str(html_path)
        result.eval_mean_return = mean
        if run.embedded is None:  # a cluster that outlives the run: its events keep the report
            run.record_report(result)
    directory.result.write_text(json.dumps(asdict(result), indent=1))
    return result


def _best(checkpoint: str | None) -> tuple[str | None, float | None]:
    """The run's best checkpoint (learner/checkpoint_best.py) and its recent mean return, from
    the manifests beside its newest one (none are hashed: `shoal eval --best` verifies)."""
    from shoal.learner.checkpoint_best import best_saved
    from shoal.learner.checkpoint_layout import dir_name

    directory = None if checkpoint is None else Path(checkpoint).parent
    best = None if directory is None or not directory.is_dir() else best_saved(directory)
    if best is None or directory is None:
        return None, None
    return str(directory / dir_name(best[1])), best[0]


@contextlib.contextmanager
def _cluster(
    run_dir: Path, coordinators: Coordinators | None
) -> Iterator[tuple[Coordinators, LocalCluster | None, float]]:
    """(the cluster to submit to, the embedded cluster if it is one, when the run started):
    `coordinators` as given, or an embedded cluster in `run_dir`, started before the rest of
    the run's start-up so the two overlap, and ready (a leader) on entry; it is stopped when
    the block ends."""
    from shoal.local import LocalClusterError
    from shoal.local_embedded import embedded_cluster

    if coordinators is not None:
        started = time.monotonic()
        _warm_imports()
        yield coordinators, None, started
        return
    started = time.monotonic()
    try:
        with embedded_cluster(run_dir) as local:
            where = Coordinators(local.api_urls(), RunDir(local.run_dir).api_token)
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
