"""`shoal eval CHECKPOINT [--env ID] [--episodes N]`: evaluate a trained policy, write the report.

Each evaluation writes a report of its own, named by the checkpoint's step and the time
(`eval-<env>-<hash>-step<N>-<UTC time>.json/.html`), beside the training run's final one,
which it never replaces.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any


def register(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = verbs.add_parser(
        "eval",
        help="evaluate a checkpoint: JSON + HTML report",
        description="Load the policy from a checkpoint (a .pt file, its manifest, or a run "
        "directory for its newest complete one) and evaluate it deterministically.",
    )
    parser.add_argument("checkpoint", type=Path, help="checkpoint file or run directory")
    parser.add_argument("--env", help="environment id (default: the one it was trained on)")
    parser.add_argument("--episodes", type=int, default=20, help="episodes per condition")
    parser.add_argument("--seed", type=int, default=12345, help="evaluation seed")
    parser.add_argument("--out", type=Path, help="report directory (default: beside the run)")
    parser.add_argument("--json", action="store_true", help="end with a JSON summary line")
    parser.add_argument(
        "--best",
        action="store_true",
        help="with a run directory: its best checkpoint (the highest recent mean return when "
        "saved; kept beside the newest) instead of its newest",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import time

    import torch

    from shoal.config import check_int
    from shoal.envs import registry
    from shoal.envs.wrappers import EnvConfig
    from shoal.learner.config import SEED_MAX, known_target
    from shoal.learner.text_job import is_text_job
    from shoal.progress import ProgressLine
    from shoal.train import evaluate_checkpoint, load_policy

    torch.set_num_threads(1)  # small batches: more threads only spin

    check_int("--episodes", args.episodes, 1)
    check_int("--seed", args.seed, 0, SEED_MAX)
    _, state, info = load_policy(best_of(args.checkpoint) if args.best else args.checkpoint)
    out = args.out or info.path.parent.parent / "reports"
    trained_on = args.env or str(state.get("env_id", ""))
    if is_text_job(trained_on):
        return _run_text(args, trained_on, state, info.path, out)
    env_id = registry.spec(trained_on).id
    config = state.get("config") or {}
    env_kwargs = config.get("env_kwargs") if args.env is None else None
    # The wrappers the policy was trained behind shape what it observes: kept with --env too.
    wrappers = EnvConfig.from_json(config.get("env"), source=f"{info.path} (its [env])")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    result, json_path, html_path = evaluate_checkpoint(
        info.path,
        env_id,
        args.episodes,
        out,
        seed=args.seed,
        env_kwargs=env_kwargs,
        env=wrappers,
        success_threshold=known_target(env_id),
        label=f"step{info.step}-{stamp}",
        curves_from=_run_of(args.checkpoint, info.path),
        progress=ProgressLine(enabled=not args.quiet),
    )
    rate = result.success_rate
    print(
        f"{env_id}: mean return {result.mean_return:.1f} over {args.episodes} episodes"
        + ("" if rate is None else f", success rate {rate:.0%}")
    )
    print(f"report: {json_path}")
    print(f"html:   {html_path}")
    if args.json:
        summary = {
            "env_id": env_id,
            "checkpoint": str(info.path),
            "mean_return": result.mean_return,
            "success_rate": rate,
            "report": str(json_path),
            "report_html": str(html_path),
        }
        print(json.dumps(summary))
    return 0


def _run_of(given: Path, checkpoint: Path) -> Path:
    """The run directory whose curves.csv goes on the report: the one named, or the one the
    checkpoint lies in (run/checkpoints/ckpt-N)."""
    return (
        given
        if given.is_dir() and (given / "checkpoints").is_dir()
        else checkpoint.resolve().parent.parent
    )


def best_of(path: Path) -> Path:
    """The best checkpoint of a run (or checkpoints) directory, for `--best`."""
    from shoal.learner.checkpoint import CheckpointManager
    from shoal.rundir import TrainError

    directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not directory.is_dir():
        raise TrainError(f"--best takes a run directory; {path} is not one")
    with CheckpointManager(directory) as manager:
        info = manager.best()
    if info is None:
        raise TrainError(
            f"no checkpoint in {directory} recorded a mean return (each was saved before an "
            "episode ended); evaluate the newest one without --best"
        )
    return Path(info.path)


def _run_text(
    args: argparse.Namespace, env_id: str, state: dict[str, Any], checkpoint: Path, out: Path
) -> int:
    """A text run's checkpoint: pass@k on the environment's held-out splits, sampled with the
    job's own tokenizer and sampling settings (the config the checkpoint was saved with)."""
    from shoal.config import load
    from shoal.learner.config import TrainConfig
    from shoal.learner.text_job import evaluate_checkpoint as evaluate_text

    saved = state.get("config")
    cfg = load(
        TrainConfig,
        {**(saved if isinstance(saved, dict) else {}), "env_id": env_id},
        source=f"{checkpoint} (the config it was trained with)",
        environ={},
    )
    if args.env is not None:
        cfg = dataclasses.replace(cfg, env_kwargs={})
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, episodes=args.episodes))
    mean, json_path, html_path = evaluate_text(checkpoint, env_id, cfg, out, seed=args.seed)
    print(f"{env_id}: mean reward {mean:.3f} over {args.episodes} tasks per held-out split")
    print(f"report: {json_path}")
    print(f"html:   {html_path}")
    if args.json:
        summary = {
            "env_id": env_id,
            "checkpoint": str(checkpoint),
            "mean_reward": mean,
            "report": str(json_path),
            "report_html": str(html_path),
        }
        print(json.dumps(summary))
    return 0
