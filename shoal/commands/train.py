"""`shoal train ENV_ID | job.toml`: train a policy as a job on the local cluster, or, with none
running, on an embedded one (a coordinator and a node daemon) that lives as long as the run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any


def register(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = verbs.add_parser(
        "train",
        help="train a policy (the main job)",
        description="Train until the target return or the time limit; write the final "
        "checkpoint and an evaluation report, and print their paths. Any config key can also "
        "be set as SHOAL_<SECTION>_<KEY> (e.g. SHOAL_PPO_LR=1e-3).",
    )
    parser.add_argument("target", help="an environment id or alias (cartpole), or a job.toml")
    parser.add_argument("--json", action="store_true", help="end with a JSON summary line")
    parser.add_argument("--seed", type=int, help="seed for environments and the policy")
    parser.add_argument(
        "--preset",
        help="hyper-parameters for the environment's family: auto (the default, picked from "
        "the environment), none (the job defaults), classic, mujoco, atari, minatar or "
        "minigrid; keys the job file or flags set always win",
    )
    parser.add_argument("--time-limit", type=float, help="seconds before giving up")
    parser.add_argument("--target-return", type=float, help="mean return that counts as solved")
    parser.add_argument("--max-env-steps", type=int, help="stop after this many env steps")
    parser.add_argument("--workers", type=int, help="rollout worker processes")
    parser.add_argument("--envs", type=int, help="environments per rollout actor")
    parser.add_argument(
        "--wrapper",
        action="append",
        metavar="NAME[:key=value,...]",
        help="a Gymnasium wrapper for every environment copy, repeatable and applied in order "
        "(replacing the job file's [[env.wrappers]]): a set (atari) or a class of "
        "gymnasium.wrappers, e.g. --wrapper atari:frame_stack=4 --wrapper ClipReward:min_reward=-1",
    )
    parser.add_argument(
        "--normalize",
        choices=("obs", "reward", "both"),
        help="running observation and/or reward normalisation (Gymnasium's wrappers)",
    )
    parser.add_argument("--ranks", type=int, help="learner rank processes")
    parser.add_argument(
        "--gpus-per-rank",
        type=int,
        help="GPUs each learner rank asks the scheduler for (its group is kept on one NVLink "
        "island when it fits)",
    )
    parser.add_argument(
        "--sharding",
        choices=("auto", "replicate", "fsdp", "hsdp"),
        help="how the learner ranks hold the model: replicated (DDP), sharded (FSDP2), or "
        "sharded inside NVLink islands and replicated across them (HSDP); auto: by size",
    )
    parser.add_argument(
        "--model",
        metavar="FAMILY",
        help="the policy's model family: auto, mlp, cnn, causal-lm, or package.module:factory",
    )
    parser.add_argument(
        "--algo",
        choices=("grpo", "ppo"),
        help="text environments: the token update, GRPO (group-normalised rewards, no critic) "
        "or PPO (value head)",
    )
    parser.add_argument(
        "--group-size", type=int, help="text environments: completions sampled per prompt"
    )
    parser.add_argument(
        "--tokenizer",
        help="text environments: 'bytes' or a local tokenizer directory (never downloaded)",
    )
    parser.add_argument(
        "--checkpoint-storage",
        type=Path,
        help="a directory every host of the cluster mounts at this path; checkpoints go there "
        "and the run's tasks need no shared run directory",
    )
    parser.add_argument("--checkpoint-interval", type=float, help="seconds between checkpoints")
    parser.add_argument("--run-dir", type=Path, help="run directory (reusing one resumes it)")
    parser.add_argument("--no-eval", action="store_true", help="skip the final evaluation")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="run the four-stage pipeline here instead (demonstrations, distillation, PPO, "
        "evaluation); a job.toml target gives its [pipeline] table",
    )
    parser.add_argument(
        "--from-stage",
        metavar="STAGE",
        help="with --pipeline on a text environment and --run-dir: rerun from this stage "
        "(1-4 or synthesis, distillation, rl, evaluation), reusing the earlier stages' outputs",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--cluster",
        type=Path,
        metavar="RUN_DIR",
        help="run as a job on the local cluster in RUN_DIR (default: the one `shoal status` "
        "shows, if it is up)",
    )
    where.add_argument(
        "--coordinators", help="run as a job on the cluster at these API URLs (comma-separated)"
    )
    where.add_argument(
        "--embedded",
        action="store_true",
        help="start an embedded cluster for this run (in its run directory) even when a local "
        "cluster is up",
    )
    parser.add_argument("--token-file", type=Path, help="the API token file for --coordinators")
    parser.add_argument(
        "--max-restarts",
        type=int,
        help="restarts of failed tasks the cluster allows within the window before the job "
        "fails (default 5)",
    )
    parser.add_argument(
        "--restart-window",
        type=float,
        metavar="S",
        help="seconds over which --max-restarts counts (default 600)",
    )
    parser.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> Any:
    """TrainConfig from the job file or env id, SHOAL_* overrides, then the flags; then the
    environment family's preset (learner/presets.py) under every key those three set."""
    import os

    from shoal.config import load, read_toml
    from shoal.learner.config import TrainConfig

    target = str(args.target)
    path = Path(target)
    if target.endswith(".toml") or path.is_file():
        mapping = read_toml(path)
        cfg = load(TrainConfig, mapping, source=str(path))
    else:
        mapping = {"env_id": target}
        cfg = load(TrainConfig, mapping, source="command line")
    top = {
        "seed": args.seed,
        "preset": args.preset,
        "time_limit_s": args.time_limit,
        "target_return": args.target_return,
        "max_env_steps": args.max_env_steps,
    }
    sections = {
        "rollout": {"workers": args.workers, "num_envs": args.envs},
        "learner": {
            "ranks": args.ranks,
            "gpus_per_rank": args.gpus_per_rank,
            "sharding": args.sharding,
        },
        "model": {"family": args.model},
        "env": env_flags(args),
        "token": {"algo": args.algo, "group_size": args.group_size},
        "text": {"tokenizer": args.tokenizer},
        "checkpoint": {
            "interval_s": args.checkpoint_interval,
            "storage": None
            if args.checkpoint_storage is None
            else str(args.checkpoint_storage.resolve()),
        },
    }
    changes: dict[str, Any] = {k: v for k, v in top.items() if v is not None}
    flags = set(changes)
    for section, values in sections.items():
        given = {k: v for k, v in values.items() if v is not None}
        flags.update(f"{section}.{k}" for k in given)
        if given:
            changes[section] = dataclasses.replace(getattr(cfg, section), **given)
    cfg = dataclasses.replace(cfg, **changes) if changes else cfg
    return with_preset(cfg, given_keys(mapping, os.environ) | flags)


def env_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The `[env]` keys `--wrapper` and `--normalize` set (None: not given)."""
    from shoal.envs.wrappers import parse_wrapper_flag

    normalize = args.normalize or ""
    return {
        "wrappers": None
        if args.wrapper is None
        else tuple(parse_wrapper_flag(text) for text in args.wrapper),
        "normalize_observation": True if normalize in ("obs", "both") else None,
        "normalize_reward": True if normalize in ("reward", "both") else None,
    }


def given_keys(mapping: dict[str, Any], environ: Any) -> set[str]:
    """The dotted keys a job file (`mapping`) and SHOAL_* variables set: what a preset leaves
    alone. A table is not a key: `[ppo]` with `lr` in it gives `ppo.lr` alone."""
    from shoal.config import env_var_names
    from shoal.learner.config import TrainConfig

    keys: set[str] = set()
    stack: list[tuple[str, Any]] = [(k, v) for k, v in mapping.items()]
    while stack:
        key, value = stack.pop()
        if isinstance(value, dict) and value:
            stack.extend((f"{key}.{k}", v) for k, v in value.items())
        else:
            keys.add(key)
    for name, path in env_var_names(TrainConfig).items():
        if name in environ:
            keys.add(".".join(path))
    return keys


def with_preset(cfg: Any, explicit: set[str]) -> Any:
    """`cfg` with its family's preset applied (text environments have their own defaults)."""
    from shoal.learner.presets import apply_preset
    from shoal.learner.text_job import is_text_job

    if is_text_job(cfg.env_id):
        return cfg
    return apply_preset(cfg, explicit)


def find_coordinators(args: argparse.Namespace) -> Any:
    """The cluster to run on (Coordinators), or None for the embedded run."""
    from shoal.cluster_train import Coordinators, find_cluster
    from shoal.errors import ConfigError
    from shoal.local import default_run_dir

    if args.coordinators is not None:
        if args.token_file is None:
            raise ConfigError("--coordinators needs --token-file (the cluster's api-token file)")
        urls = [u.strip() for u in args.coordinators.split(",") if u.strip()]
        storage = args.checkpoint_storage
        return Coordinators(urls, args.token_file, storage=storage and storage.resolve())
    if args.token_file is not None:
        raise ConfigError("--token-file goes with --coordinators; --cluster reads its own token")
    if args.embedded:
        return None
    if args.cluster is not None:
        found = find_cluster(args.cluster)
        if found is None:
            raise ConfigError(
                f"--cluster {args.cluster}: no running cluster there; start one with `shoal up`"
            )
        return found
    return find_cluster(default_run_dir())


# flags of the PPO job that the pipeline has no use for: an error, not silently ignored
NOT_FOR_PIPELINE = ("preset", "time_limit", "target_return", "max_env_steps", "workers",
                    "envs", "ranks", "gpus_per_rank", "sharding", "model", "algo", "group_size", "tokenizer",
                    "checkpoint_storage",
                    "checkpoint_interval", "cluster", "coordinators", "token_file",
                    "max_restarts", "restart_window", "wrapper", "normalize")  # fmt: skip


def run_pipeline_verb(args: argparse.Namespace) -> int:
    from shoal.errors import ConfigError
    from shoal.train_pipeline import pipeline_config
    from shoal.train_pipeline import run as run_stages

    given = [name for name in NOT_FOR_PIPELINE if getattr(args, name) is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ConfigError(
            f"{flag} does not apply to --pipeline; set the pipeline's settings in a job.toml "
            "[pipeline] table"
        )
    cfg = pipeline_config(str(args.target), args.seed)
    summary = run_stages(
        cfg, args.run_dir, lambda line: print(line, flush=True), from_stage=args.from_stage
    )
    print(f"run dir:       {summary['run_dir']}")
    print(f"pipeline.json: {summary['pipeline_json']}")
    print(f"report:        {summary['report']}")
    print(f"html:          {summary['report_html']}")
    if args.json:
        print(json.dumps(summary, allow_nan=False))
    sys.stdout.flush()
    return 0


def shown(path: str) -> str:
    """A path as the user would type it from here: relative below the working directory (the
    JSON summary keeps every path absolute)."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def run(args: argparse.Namespace) -> int:
    from shoal.progress import ProgressLine

    if args.from_stage is not None and not args.pipeline:
        from shoal.errors import ConfigError

        raise ConfigError("--from-stage applies to --pipeline only")
    if args.pipeline:
        return run_pipeline_verb(args)
    from shoal.cluster_train import RESTART_WINDOW_S, RestartPolicy
    from shoal.train import train

    cfg = build_config(args)
    coordinators = find_coordinators(args)
    from shoal.learner.presets import describe

    print(describe(cfg.preset), flush=True)
    progress = None if args.quiet else ProgressLine()
    restart = RestartPolicy(
        5 if args.max_restarts is None else args.max_restarts,
        RESTART_WINDOW_S if args.restart_window is None else args.restart_window,
    )
    result = train(
        cfg,
        run_dir=args.run_dir,
        progress=progress,
        evaluate_at_end=not args.no_eval,
        coordinators=coordinators,
        max_restarts=restart.max_restarts,
        restart_window_s=restart.window_s,
    )
    verdict = "solved" if result.solved else f"not solved ({result.stopped_by})"
    final = "-" if result.final_return is None else f"{result.final_return:.1f}"
    print(
        f"{result.env_id}: {verdict}; return {final} over the last {cfg.target_window} episodes, "
        f"{result.env_steps:,} env steps in {result.wall_s:.1f}s"
    )
    print(f"run dir:    {shown(result.run_dir)}")
    if result.job_id:
        print(f"job:        {result.job_id}")
    if result.cluster.get("embedded"):
        logs = [result.cluster["logs"], *result.cluster["task_logs"]]
        print(f"logs:       {' '.join(shown(p) for p in logs)}")
    print(f"checkpoint: {shown(result.checkpoint) if result.checkpoint else '-'}")
    if result.best_checkpoint:
        print(
            f"best:       {shown(result.best_checkpoint)} (return {result.best_return:.1f} when "
            "saved; shoal eval RUN --best)"
        )
    if result.checkpoint_error:
        print(f"shoal: warning: {result.checkpoint_error}", file=sys.stderr)
    if result.report:
        print(f"report:     {shown(result.report)}")
        print(f"html:       {shown(result.report_html or '')}")
    if args.json:
        print(json.dumps(dataclasses.asdict(result)))
    sys.stdout.flush()
    return 0 if result.solved or result.target_return is None else 1
