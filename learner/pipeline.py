"""The four-stage pipeline: demonstrations → distillation → PPO → evaluation, each one recorded.

1. *Demonstrations*: a rule-based teacher plays the environment — GridWorld's shortest-path
   planner, or the code environment's reference solutions — and its observations, actions and
   discounted returns are saved.
2. *Pre-training*: the MLP policy is distilled from the teacher (cross-entropy on the teacher's
   actions, squared error on its returns for the value head, so PPO starts with a sensible critic).
3. *PPO* starts from the distilled weights, with the same `PPOLearner` the cluster uses, driven
   synchronously in-process by a rollout `Collector` (the cluster runs it asynchronously).
4. *Evaluation* of both the pre-trained and the final policy, with noise sweeps, as JSON + HTML.

Every stage's outputs (with sha256), metrics and environment hash go into `pipeline.json`,
rewritten atomically after each stage, so a run can be reproduced, compared, or inspected when it
stopped half-way.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shoal.config import check_int
from shoal.envs.vector import VectorEnvironment, make_vector
from shoal.errors import ConfigError
from shoal.files import write_atomically
from shoal.learner.checkpoint import CheckpointManager
from shoal.learner.config import SEED_MAX
from shoal.learner.errors import PipelineError
from shoal.learner.models import ModelConfig, PolicyModel, build_model
from shoal.learner.ppo import PPOConfig, PPOLearner
from shoal.learner.rollout import Collector

MANIFEST_VERSION = 1
Teacher = Callable[[], np.ndarray]


@dataclass
class PipelineConfig:
    """What each stage does and how long; validated so a bad value fails before stage 1 starts."""

    env_id: str = "GridWorld-v1"
    """An environment with a teacher: a GridWorld-* id or CodeChoice-v1."""
    seed: int = 0
    """Seeds stage 1; stages 3 and 4 use seed+1 and seed+2 so they see fresh episodes."""
    num_envs: int = 16
    demo_steps: int = 8192
    """Teacher steps recorded in stage 1 (over all environments)."""
    pretrain_epochs: int = 30
    pretrain_lr: float = 1e-3
    pretrain_minibatch: int = 256
    ppo_env_steps: int = 32768
    """Environment steps of PPO fine-tuning in stage 3 (0 skips the updates)."""
    horizon: int = 64
    """Steps per environment per PPO fragment."""
    eval_episodes: int = 32
    held_out: tuple[str, ...] = ()
    """Environment ids the final policy is also evaluated on, never trained on (generalisation)."""
    torch_threads: int = 1
    """torch threads for the run (restored after): a small MLP is fastest on one; two ran
    several times slower on a busy 2-core machine."""
    ppo: PPOConfig = field(default_factory=PPOConfig)

    def __post_init__(self) -> None:
        check_int("pipeline.seed", self.seed, 0, SEED_MAX)
        positive = ("torch_threads", "num_envs", "demo_steps", "pretrain_epochs", "pretrain_minibatch", "horizon",
                    "eval_episodes")  # fmt: skip
        for key in positive:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"pipeline.{key} = {value!r} is invalid: use an integer >= 1")
        if (
            isinstance(self.ppo_env_steps, bool)
            or not isinstance(self.ppo_env_steps, int)
            or self.ppo_env_steps < 0
        ):
            raise ConfigError(
                f"pipeline.ppo_env_steps = {self.ppo_env_steps!r} is invalid: use an integer >= 0"
            )
        lr = self.pretrain_lr
        if (
            isinstance(lr, bool)
            or not isinstance(lr, int | float)
            or not (math.isfinite(lr) and lr > 0)
        ):
            raise ConfigError(f"pipeline.pretrain_lr = {lr!r} is invalid: use a number > 0")
        if not all(isinstance(env_id, str) and env_id for env_id in self.held_out):
            raise ConfigError(
                f"pipeline.held_out = {self.held_out!r} is invalid: list environment ids"
            )
        if not isinstance(self.env_id, str) or not self.env_id:
            raise ConfigError(
                f"pipeline.env_id = {self.env_id!r} is invalid: use an id like GridWorld-v1"
            )


def teacher_for(env: VectorEnvironment, env_id: str) -> Teacher:
    """The rule engine for `env`'s current observations: reference solutions or the planner."""
    reference = getattr(env, "reference_actions", None)
    if callable(reference):
        return reference
    expert = getattr(getattr(env, "dynamics", None), "expert_actions", None)
    if callable(expert):
        return expert
    raise PipelineError(
        f"{env_id} has no teacher for stage 1: use a GridWorld-* id (shortest-path planner) "
        "or CodeChoice-v1 (reference solutions)"
    )


@dataclass
class Demonstrations:
    """Stage 1's data: one row per teacher step."""

    obs: np.ndarray
    actions: np.ndarray
    returns: np.ndarray
    complete: np.ndarray
    """True where the episode ended inside the recording, so `returns` is the true return-to-go."""
    episode_returns: np.ndarray

    def save(self, path: Path) -> str:
        """Write as .npz and return its sha256."""
        with open(path, "wb") as handle:
            np.savez(handle, **asdict(self))
        return _sha256(path)


def collect_demonstrations(
    env: VectorEnvironment, teacher: Teacher, steps: int, gamma: float
) -> Demonstrations:
    """Let the teacher play `steps` steps; discounted returns-to-go are computed backwards."""
    n = env.num_envs
    horizon = max(1, steps // n)
    obs = env.reset()
    rows: dict[str, list[np.ndarray]] = {"obs": [], "act": [], "rew": [], "done": []}
    finished: list[float] = []
    for _ in range(horizon):
        actions = np.asarray(teacher(), dtype=np.int64)
        result = env.step(actions)
        rows["obs"].append(obs.astype(np.float32))
        rows["act"].append(actions)
        rows["rew"].append(result.reward.astype(np.float32))
        rows["done"].append(result.done)
        finished.extend(result.episode_return[result.done].tolist())
        obs = result.obs
    rewards, dones = np.stack(rows["rew"]), np.stack(rows["done"])
    returns = np.zeros_like(rewards)
    complete = np.zeros(dones.shape, dtype=bool)
    running, seen = np.zeros(n, np.float32), np.zeros(n, bool)
    for t in reversed(range(horizon)):
        running = rewards[t] + gamma * running * ~dones[t]
        seen = dones[t] | seen
        returns[t], complete[t] = running, seen
    flat = horizon * n
    obs_arr = np.stack(rows["obs"])
    return Demonstrations(
        obs=obs_arr.reshape(flat, *obs_arr.shape[2:]),
        actions=np.stack(rows["act"]).reshape(flat),
        returns=returns.reshape(flat),
        complete=complete.reshape(flat),
        episode_returns=np.asarray(finished, dtype=np.float32),
    )


def distill(model: PolicyModel, demos: Demonstrations, cfg: PipelineConfig) -> dict[str, float]:
    """Supervised pre-training: imitate the teacher's actions, regress the value on its returns."""
    generator = torch.Generator().manual_seed(cfg.seed)
    obs = torch.from_numpy(demos.obs)
    actions = torch.from_numpy(demos.actions)
    returns = torch.from_numpy(demos.returns)
    mask = torch.from_numpy(demos.complete).float()
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.pretrain_lr)
    size = obs.shape[0]
    for _ in range(cfg.pretrain_epochs):
        for idx in torch.randperm(size, generator=generator).split(cfg.pretrain_minibatch):
            logp, _, values = model(obs[idx], actions[idx])
            value_err = ((values - returns[idx]).pow(2) * mask[idx]).sum() / mask[idx].sum().clamp(
                min=1
            )
            loss = -logp.mean() + 0.5 * value_err
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        logp, _, values = model(obs, actions)
        taken = model.act(demos.obs, deterministic=True)[0]
        value_mse = ((values - returns).pow(2) * mask).sum() / mask.sum().clamp(min=1)
    return {
        "cross_entropy": float(-logp.mean()),
        "accuracy": float((taken == demos.actions).mean()),
        "value_mse": float(value_mse),
        "examples": float(size),
    }


def fine_tune(
    model: PolicyModel, env: VectorEnvironment, env_hash: str, cfg: PipelineConfig
) -> dict[str, float]:
    """PPO from the distilled weights, on-policy, with the learning rate annealed to 0."""
    learner = PPOLearner(model, cfg.ppo)
    collector = Collector("pipeline", env, model, cfg.horizon, env_hash, seed=cfg.seed + 1)
    per_update = cfg.horizon * env.num_envs
    updates = math.ceil(cfg.ppo_env_steps / per_update) if cfg.ppo_env_steps else 0
    recent: deque[float] = deque(maxlen=20)
    metrics: dict[str, float] = {}
    for version in range(updates):
        learner.set_lr(cfg.ppo.lr * (1.0 - version / updates))
        fragment = collector.collect()
        recent.extend(fragment.episode_returns.tolist())
        metrics = learner.update([fragment], current_version=version)
        collector.policy_version = version + 1
    keep = ("policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "explained_variance")
    out = {f"last_{k}": metrics[k] for k in keep if k in metrics}
    out.update(
        {
            "updates": float(updates),
            "env_steps": float(collector.env_steps),
            "mean_return_last20": float(np.mean(recent)) if recent else float("nan"),
        }
    )
    return out


def evaluate_policy(
    model: PolicyModel, cfg: PipelineConfig, out_dir: Path
) -> tuple[dict[str, Any], list[Path]]:
    """Helper D's evaluation (greedy actions, noise sweeps) with its JSON + HTML report."""
    from shoal.envs.evaluation import EvalOptions, Variant, evaluate, write_report

    def policy(obs: np.ndarray) -> np.ndarray:
        return model.act(np.asarray(obs), deterministic=True)[0]

    options = EvalOptions(
        num_envs=min(8, cfg.eval_episodes), obs_noise=(0.0, 0.1), action_noise=(0.0, 0.1)
    )
    result = evaluate(
        policy,
        cfg.env_id,
        episodes=cfg.eval_episodes,
        seed=cfg.seed + 2,
        held_out=[Variant(env_id, env_id) for env_id in cfg.held_out],
        options=options,
    )
    paths = list(write_report(result, out_dir))
    summary = {
        "env_hash": result.env_hash,
        "mean_return": result.metrics.mean_return,
        "std_return": result.metrics.std_return,
        "success_rate": result.metrics.success_rate,
        "mean_length": result.metrics.mean_length,
        "obs_noise_0.1_mean_return": result.obs_noise[-1].metrics.mean_return,
        "action_noise_0.1_mean_return": result.action_noise[-1].metrics.mean_return,
        "held_out_mean_return": {
            v.name: v.metrics.mean_return for v in result.generalisation if v.held_out
        },
    }
    return summary, paths


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Recorder:
    """The run's manifest: stages appended as they finish, the file rewritten atomically each time."""

    def __init__(self, run_dir: Path, cfg: PipelineConfig) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "pipeline.json"
        self.manifest: dict[str, Any] = {
            "version": MANIFEST_VERSION,
            "config": asdict(cfg),
            "stages": [],
        }
        self.flush()

    def output(self, path: Path, sha256: str | None = None) -> dict[str, str]:
        return {"path": str(path.relative_to(self.run_dir)), "sha256": sha256 or _sha256(path)}

    def stage(
        self,
        name: str,
        started: float,
        env_hash: str | None,
        outputs: dict[str, Any],
        metrics: dict[str, Any],
    ) -> None:
        entry = {"name": name, "env_hash": env_hash, "wall_s": time.perf_counter() - started,
                 "outputs": outputs, "metrics": metrics}  # fmt: skip
        self.manifest["stages"].append(entry)
        self.flush()

    def flush(self) -> None:
        text = json.dumps(self.manifest, indent=2, allow_nan=True) + "\n"
        write_atomically(self.path, text, durable=True)


def run_pipeline(cfg: PipelineConfig, run_dir: str | Path) -> dict[str, Any]:
    """Run the four stages into `run_dir`; returns the manifest also written to pipeline.json."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.torch_threads)
    try:
        return _run_stages(cfg, Path(run_dir))
    finally:
        torch.set_num_threads(threads)


def _run_stages(cfg: PipelineConfig, root: Path) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    rec = Recorder(root, cfg)
    demos, observation_space, action_space = _stage_demonstrations(cfg, rec)
    model = _stage_pretrain(cfg, rec, demos, observation_space, action_space)
    pretrained_weights = model.get_weights()
    _stage_ppo(cfg, rec, model)
    _stage_evaluation(cfg, rec, model, pretrained_weights)
    return rec.manifest


def _stage_demonstrations(cfg: PipelineConfig, rec: Recorder) -> tuple[Demonstrations, Any, Any]:
    from shoal.envs.hashing import env_hash

    started = time.perf_counter()
    env = make_vector(cfg.env_id, cfg.num_envs, seed=cfg.seed)
    try:
        demos = collect_demonstrations(
            env, teacher_for(env, cfg.env_id), cfg.demo_steps, cfg.ppo.gamma
        )
        observation_space, action_space = env.single_observation_space, env.single_action_space
    finally:
        env.close()
    if observation_space.shape is None:
        raise PipelineError(f"{cfg.env_id} has no observation shape; the MLP policy needs one")
    path = rec.run_dir / "demonstrations.npz"
    teacher_return = float(demos.episode_returns.mean()) if demos.episode_returns.size else None
    rec.stage(
        "demonstrations",
        started,
        env_hash(cfg.env_id, {}, cfg.seed),
        {"demonstrations": rec.output(path, demos.save(path))},
        {"steps": int(demos.actions.shape[0]), "episodes": int(demos.episode_returns.size),
         "teacher_mean_return": teacher_return},
    )  # fmt: skip
    return demos, observation_space, action_space


def _checkpoint(rec: Recorder, model: PolicyModel, stage: str, step: int) -> dict[str, str]:
    """Save the model into checkpoints/<stage>/ and describe it for the manifest by its
    checkpoint manifest file (which holds the sha256 of every file of the checkpoint)."""
    with CheckpointManager(rec.run_dir / "checkpoints" / stage, keep=1) as ckpt:
        trainer = {"policy_spec": model.spec(), "stage": stage}
        ckpt.save({"model": model.state_dict()}, step, trainer, block=True)
        info = ckpt.latest()
    if info is None:
        raise PipelineError(f"the {stage} checkpoint was not written; see the log for why")
    return rec.output(info.manifest)


def _stage_pretrain(
    cfg: PipelineConfig,
    rec: Recorder,
    demos: Demonstrations,
    observation_space: Any,
    action_space: Any,
) -> PolicyModel:
    started = time.perf_counter()
    model = build_model(ModelConfig(family="mlp"), observation_space, action_space)
    metrics = distill(model, demos, cfg)
    rec.stage(
        "pretrain", started, None, {"checkpoint": _checkpoint(rec, model, "pretrain", 0)}, metrics
    )
    return model


def _stage_ppo(cfg: PipelineConfig, rec: Recorder, model: PolicyModel) -> None:
    from shoal.envs.hashing import env_hash

    started = time.perf_counter()
    seed = cfg.seed + 1
    digest = env_hash(cfg.env_id, {}, seed)
    env = make_vector(cfg.env_id, cfg.num_envs, seed=seed)
    try:
        metrics = fine_tune(model, env, digest, cfg)
    finally:
        env.close()
    output = _checkpoint(rec, model, "ppo", int(metrics["env_steps"]))
    rec.stage("ppo", started, digest, {"checkpoint": output}, metrics)


def _stage_evaluation(
    cfg: PipelineConfig, rec: Recorder, model: PolicyModel, pretrained: dict[str, np.ndarray]
) -> None:
    started = time.perf_counter()
    final_eval, final_paths = evaluate_policy(model, cfg, rec.run_dir / "reports" / "final")
    model.set_weights(pretrained)
    pre_eval, pre_paths = evaluate_policy(model, cfg, rec.run_dir / "reports" / "pretrained")
    outputs = {f"final_{p.suffix[1:]}": rec.output(p) for p in final_paths}
    outputs |= {f"pretrained_{p.suffix[1:]}": rec.output(p) for p in pre_paths}
    rec.stage(
        "evaluation",
        started,
        final_eval["env_hash"],
        outputs,
        {"final": final_eval, "pretrained": pre_eval},
    )
