"""`shoal bench train`: shoal's asynchronous training beside a CleanRL-style synchronous PPO.

In one run: time and environment steps to solve CartPole-v1 (mean of the last 20 returns
≥ 475) for `shoal train cartpole`'s defaults and for bench/cleanrl_ppo.py; then end-to-end
environment frames per second of a throughput-shaped job (large batched environments per
actor, unpaced) with 1, 2 and 4 rollout worker processes, beside the baseline's frames/s.
shoal's solve time includes starting its processes; the baseline runs inside this process.
Frames/s are what the learners received, from the learners' start (steady state). `quick`
uses limits too short to solve: for smoke tests of the table's shape only.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from shoal.bench.report import Row

CLEANRL = "CleanRL-style PPO"


def _throughput_config(workers: int, seconds: float) -> Any:
    """Big batches per actor and per update, unpaced, two learner threads (the actors mostly
    wait on back-pressure, so the learner gets the second core)."""
    from shoal.learner.config import IntakeConfig, LearnerConfig, RolloutConfig, TrainConfig
    from shoal.learner.ppo import PPOConfig

    return TrainConfig(
        time_limit_s=seconds,
        target_return=1e9,  # never stop early: this measures frames/s
        rollout=RolloutConfig(workers=workers, num_envs=512, horizon=64, pace=False),
        intake=IntakeConfig(capacity=4, max_staleness=8, fragments_per_update=1),
        learner=LearnerConfig(threads=2),
        ppo=PPOConfig(lr=2.5e-3, update_epochs=1, num_minibatches=1),
    )


def _acrobot_rows(root: Path, limit: float) -> list[Row]:
    """Acrobot-v1 to a mean return of −100, the same two trainers, same defaults."""
    from shoal.bench import cleanrl_ppo
    from shoal.learner.config import TrainConfig
    from shoal.train import train

    base = cleanrl_ppo.run(
        seed=1, time_limit_s=limit, target=-100.0, args=cleanrl_ppo.Args(env_id="Acrobot-v1")
    )
    cfg = dataclasses.replace(TrainConfig(), env_id="Acrobot-v1", seed=1, time_limit_s=limit)
    ours = train(cfg, runs_root=root, evaluate_at_end=False)
    return [
        Row(
            "Acrobot-v1 time to -100",
            "s",
            ours.solve_s if ours.solve_s is not None else float("nan"),
            base["solved_at_s"],
            CLEANRL,
            higher_is_better=False,
        )
    ]


def _hosts_rows(root: Path, limit: float) -> list[Row]:
    """CartPole-v1 to 475 with the learner on one host and 2 rollout workers on another
    (`shoal up --hosts 2`: network namespaces, TLS between them, checkpoints in the cluster's
    storage) beside the same job on one host (the embedded cluster). Each task asks for a share
    of a host's CPUs that keeps the learner and the workers apart. Needs root (else no row)."""
    from shoal import hosts
    from shoal.cluster_train import find_cluster
    from shoal.errors import ShoalError
    from shoal.learner.config import LearnerConfig, RolloutConfig, TrainConfig
    from shoal.local import LocalCluster
    from shoal.local_hosts import create_hosts_cluster
    from shoal.train import train

    try:
        hosts.check_can_create()
    except ShoalError:
        return []
    cpus = float(os.cpu_count() or 1)
    cfg = dataclasses.replace(
        TrainConfig(), seed=1, time_limit_s=limit, rollout=RolloutConfig(workers=2)
    )
    one_host = train(cfg, runs_root=root, evaluate_at_end=False)
    cfg = dataclasses.replace(
        cfg,
        learner=LearnerConfig(cpus_per_rank=cpus * 0.75),
        rollout=RolloutConfig(workers=2, cpus_per_worker=cpus * 0.375),
    )
    local = LocalCluster(root / "hosts-cluster")
    try:
        create_hosts_cluster(local, 2, 1)
        local.start_all()
        local.wait_ready(timeout=120)
        local.wait_nodes(2, timeout=120)
        two_hosts = train(
            cfg, runs_root=root, evaluate_at_end=False, coordinators=find_cluster(local.run_dir)
        )
    finally:
        local.stop_all()
        local.remove_network()
    return [
        Row(
            "CartPole-v1 time to 475, learner and 2 workers on 2 hosts",
            "s",
            two_hosts.solve_s if two_hosts.solve_s is not None else float("nan"),
            one_host.solve_s,
            "the same job on 1 host",
            higher_is_better=False,
        )
    ]


def run(quick: bool) -> list[Row]:
    from shoal.bench import cleanrl_ppo
    from shoal.learner.config import TrainConfig
    from shoal.train import train

    root = Path(tempfile.mkdtemp(prefix="shoal-bench-train-"))
    try:
        limit = 5.0 if quick else 120.0
        base = cleanrl_ppo.run(seed=1, time_limit_s=limit)
        cfg = dataclasses.replace(TrainConfig(), seed=1, time_limit_s=limit)
        solve = train(cfg, runs_root=root, evaluate_at_end=False)
        rows = [
            Row(
                "CartPole-v1 time to 475",
                "s",
                solve.solve_s if solve.solve_s is not None else float("nan"),
                base["solved_at_s"],
                CLEANRL,
                higher_is_better=False,
            ),
            Row(
                "CartPole-v1 time to 475 after start-up",
                "s",
                solve.solve_s - solve.startup_s
                if solve.solve_s is not None and solve.startup_s is not None
                else float("nan"),
                base["solved_at_s"],
                CLEANRL,
                higher_is_better=False,
            ),
            Row(
                "CartPole-v1 env steps to 475",
                "steps",
                float(solve.env_steps) if solve.solved else float("nan"),
                float(base["env_steps"]) if base["solved"] else None,
                CLEANRL,
                higher_is_better=False,
            ),
            Row(
                "median policy lag while solving",
                "versions",
                solve.policy_lag_median if solve.policy_lag_median is not None else float("nan"),
                0.0,
                "synchronous PPO",
                higher_is_better=False,
            ),
        ]
        rows.extend(_acrobot_rows(root, limit))
        rows.extend(_hosts_rows(root, limit))
        seconds = 5.0 if quick else 20.0
        for workers in (1, 2, 4):
            cfg_t = _throughput_config(workers, seconds)
            result = train(cfg_t, runs_root=root, evaluate_at_end=False)
            rows.append(
                Row(
                    f"env frames/s trained, {workers} rollout worker(s)",
                    "frames/s",
                    result.learner_sps,
                    float(base["sps"]),
                    CLEANRL,
                    higher_is_better=True,
                )
            )
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)
