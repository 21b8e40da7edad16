"""The training job's configuration: typed sections a job.toml fills in (via shoal.config.load).

```toml
env_id = "CartPole-v1"
time_limit_s = 120
[env]
normalize_observation = false
[model]
hidden = [64, 64]
[rollout]
workers = 2
num_envs = 64
[ppo]
lr = 1e-3
[checkpoint]
interval_s = 30
```

Every section validates itself, naming the key, the value and what is valid. Defaults are the
ones `shoal train cartpole` solves CartPole-v1 with on a 2-core machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from shoal.config import check_int, check_number
from shoal.envs.wrappers import EnvConfig
from shoal.errors import ConfigError
from shoal.learner.generation import GenerationError, SamplingConfig
from shoal.learner.models.config import ModelConfig
from shoal.learner.ppo import PPOConfig
from shoal.learner.token_config import TokenRLConfig
from shoal.learner.weight_plan import WeightSyncConfig

# Returns that count as solved where the environment declares none (Gymnasium's thresholds).
_KNOWN_TARGETS: dict[str, float] = {"CartPole-v1": 475.0, "Acrobot-v1": -100.0}


def known_target(env_id: str) -> float | None:
    """The return counted as solved for a canonical id, where one is known: shoal's own, else
    the `reward_threshold` its Gymnasium registration declares (MountainCar-v0: -110,
    HalfCheetah-v5: 4800, ...)."""
    if env_id in _KNOWN_TARGETS:
        return _KNOWN_TARGETS[env_id]
    from shoal.learner.presets import registered_threshold

    return registered_threshold(env_id)


PRESETS = ("auto", "none", "classic", "mujoco", "atari", "minatar", "minigrid")
"""`preset` choices: the environment's family (learner/presets.py), none, or a family by name."""


SEED_MAX = 2**32 - 1
"""Seeds are unsigned 32-bit integers, the range every seeded library here accepts."""
MAX_WORKERS = 1024
"""Rollout worker processes (and learner ranks) of one job: each is a task of the job, which
the coordinator holds at most 4096 of, and a process on some node."""
MAX_ACTORS_PER_WORKER = 64
MAX_NUM_ENVS = 65536
"""Environments one actor steps as a batch. A fragment holds num_envs × horizon steps and is
one transport frame; far past these bounds a worker only runs out of memory, so the job file
is refused instead of a worker failing until the restart budget is spent."""
MAX_HORIZON = 65536


@dataclass(frozen=True)
class RolloutConfig:
    """How experience is collected: processes × actors × batched environments × steps."""

    workers: int = 1
    """Rollout worker processes."""
    actors_per_worker: int = 1
    """Rollout actors in each worker process (each owns one vector of environments)."""
    num_envs: int = 32
    """Environments stepped as one batch by each actor."""
    horizon: int = 32
    """Steps T per fragment: each fragment holds horizon × num_envs environment steps."""
    pace: bool = True
    """Actors collect only as fast as the learners consume (policy lag ≈ 1); off: as fast as
    the intake's back-pressure allows (more throughput, more lag)."""
    cpus_per_worker: float = 0.0
    """CPUs each worker process reserves on its node (0: none); the leader spreads workers
    over the nodes by free capacity."""
    pipeline: bool = False
    """Step a split vector's halves in turn, one half's emulators running while the policy acts
    on the other (ale-py's C++ vector for the `atari` set; learner/collector.py). It pays only
    with a core to spare or the policy on a GPU: on 2 shared cores it measured 0.88-1.13x the
    sequential path at 16 % more CPU per step (docs/benchmarks.md, Pong), so it is off unless
    asked for."""
    precision: Literal["float32", "bfloat16"] = "float32"
    """The dtype rollout workers sample in (learner/models/base.py `PolicyModel.run_in`);
    learners train in float32 and the importance weight corrects the difference. bfloat16
    pays on GPUs and on CPUs with AVX512-BF16 or AMX; elsewhere it is emulated and slower."""

    def __post_init__(self) -> None:
        check_int("rollout.workers", self.workers, 1, MAX_WORKERS)
        check_number("rollout.cpus_per_worker", self.cpus_per_worker, low=0, high=1024)
        check_int("rollout.actors_per_worker", self.actors_per_worker, 1, MAX_ACTORS_PER_WORKER)
        check_int("rollout.num_envs", self.num_envs, 1, MAX_NUM_ENVS)
        check_int("rollout.horizon", self.horizon, 1, MAX_HORIZON)


@dataclass(frozen=True)
class IntakeConfig:
    """The learner's bounded intake and how much of it one update consumes."""

    capacity: int = 2
    """Fragments the intake holds before it stops consuming (back-pressure on the actors)."""
    max_staleness: int = 4
    """Fragments made by a policy more than this many versions old are dropped (and counted)."""
    fragments_per_update: int = 1
    """Fragments each rank trains on per update (one policy version)."""

    def __post_init__(self) -> None:
        check_int("intake.capacity", self.capacity, 1)
        check_int("intake.max_staleness", self.max_staleness, 0)
        check_int("intake.fragments_per_update", self.fragments_per_update, 1)
        if self.fragments_per_update > self.capacity:
            raise ConfigError(
                f"intake.fragments_per_update = {self.fragments_per_update} is invalid: it must "
                f"be <= intake.capacity ({self.capacity})"
            )


@dataclass(frozen=True)
class LearnerConfig:
    """The learner group: how many ranks and which torch.distributed backend."""

    ranks: int = 1
    """Learner rank processes (each trains on its share of the rollout actors)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto is nccl with CUDA, else gloo."""
    threads: int = 1
    """torch intra-op threads per learner rank."""
    anneal_lr: bool = True
    """Anneal the learning rate linearly to 0 over `max_env_steps` (when that is set)."""
    gpus_per_rank: int = 0
    """GPUs each rank asks the scheduler for (the group is placed on one NVLink island when it
    fits, else one RDMA domain); the rank trains on the first GPU it was given."""
    cpus_per_rank: float = 0.0
    """CPUs each rank reserves on its node (0: none; a small host can then run a whole job)."""
    sharding: Literal["auto", "replicate", "fsdp", "hsdp"] = "auto"
    """How the ranks hold the model (learner/parallel.py): `replicate` (DDP) a model that fits
    every rank, `fsdp` (FSDP2) shards it over all ranks, `hsdp` shards inside each NVLink island
    and replicates across islands; `auto` replicates what fits a quarter of a rank's memory and
    shards the rest, HSDP where the placement allows."""
    mixed_precision: bool = True
    """bf16 compute, fp32 gradient reductions: on GPUs; on CPUs with bf16 instructions for
    the families it speeds up (the CNN; learner/parallel.py), unsharded models only."""
    cpu_offload: bool = False
    """Sharded models: keep parameters, gradients and optimiser state in host memory."""
    activation_checkpointing: bool = False
    """Recompute activations during the backward pass: less memory for more compute."""

    def __post_init__(self) -> None:
        check_int("learner.ranks", self.ranks, 1, MAX_WORKERS)
        if self.sharding not in ("auto", "replicate", "fsdp", "hsdp"):
            raise ConfigError(
                f"learner.sharding = {self.sharding!r} is invalid: use 'auto', 'replicate', "
                "'fsdp' or 'hsdp'"
            )
        for key in ("mixed_precision", "cpu_offload", "activation_checkpointing"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(
                    f"learner.{key} = {getattr(self, key)!r} is invalid: use true or false"
                )
        check_int("learner.threads", self.threads, 1)
        check_int("learner.gpus_per_rank", self.gpus_per_rank, 0, 1024)
        check_number("learner.cpus_per_rank", self.cpus_per_rank, low=0, high=1024)
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(
                f"learner.backend = {self.backend!r} is invalid: use 'auto', 'gloo' or 'nccl'"
            )


@dataclass(frozen=True)
class CheckpointConfig:
    """When checkpoints are written (besides on demand and on a graceful stop)."""

    interval_s: float = 900.0
    """Seconds between periodic checkpoints (15 minutes by default; seconds for tests)."""
    keep: int = 3
    """Complete checkpoints kept on disk; older ones are deleted."""
    storage: str = ""
    """Where checkpoints go: a directory every host of the cluster mounts at this path (the
    distributed file system), so a group restarted on another host resumes from them. Empty:
    the run directory's checkpoints/, which only works while every rank runs on one host."""

    def __post_init__(self) -> None:
        check_number("checkpoint.interval_s", self.interval_s, above=0)
        check_int("checkpoint.keep", self.keep, 1)


@dataclass(frozen=True)
class EvalConfig:
    """The evaluation that runs on the final checkpoint."""

    episodes: int = 20
    """Episodes per evaluated condition."""

    def __post_init__(self) -> None:
        check_int("eval.episodes", self.episodes, 1)


@dataclass(frozen=True)
class TextConfig:
    """How a text environment's completions are sampled (`[text]`; other environments ignore
    it). The update's side, group size and temperature included, is `[token]`
    (learner/token_ppo.py's `TokenRLConfig`).

    Each rollout actor's fragment is `rollout.num_envs` completions: `num_envs / token.group_size`
    prompts, each sampled `group_size` times (GRPO's group); `max_new_tokens` plays the part of
    `rollout.horizon`.
    """

    tokenizer: str = "bytes"
    """"bytes" (259 ids, needs nothing) or a local directory with a Hugging Face tokenizer."""
    top_p: float = 1.0
    """Nucleus mass; keep 1 to train (see learner/generation.py)."""
    max_new_tokens: int = 64
    """Completion tokens per sample at most."""
    stop: tuple[str, ...] = ()
    """A completion also ends at any of these strings (besides EOS and the environment's own)."""
    weight_arrival: str = "finish"
    """New weights mid-batch: "finish" keeps the old ones to the batch's end, "interrupt"
    resumes the batch on them (learner/generation.py; docs/training.md)."""

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer, str) or not self.tokenizer.strip():
            raise ConfigError(
                f"text.tokenizer = {self.tokenizer!r} is invalid: use 'bytes' or a local "
                "tokenizer directory"
            )
        self.sampling(1.0)

    def sampling(self, temperature: float, stop: tuple[str, ...] = ()) -> SamplingConfig:
        """The generator's `SamplingConfig` at `temperature` (the `[token]` one), also ending at
        `stop` (the environment's); ConfigError naming the key if one is wrong."""
        if temperature == 0:
            raise ConfigError(
                "token.temperature = 0 is invalid for training: greedy decoding has no "
                "behaviour log-probs; use a temperature > 0"
            )
        try:
            return SamplingConfig(
                temperature=temperature,
                top_p=self.top_p,
                max_new_tokens=self.max_new_tokens,
                stop=tuple(dict.fromkeys((*stop, *self.stop))),
                weight_arrival=self.weight_arrival,
            )
        except GenerationError as exc:
            raise ConfigError(f"text.{exc}") from None


@dataclass(frozen=True)
class TrainConfig:
    """One training job: which environment, when to stop, and every section above."""

    env_id: str = "CartPole-v1"
    """Environment id or alias (`cartpole`)."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the environment (e.g. GridWorld's size)."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """`[env]`: Gymnasium wrappers (`[[env.wrappers]]`, e.g. the `atari` set) and running
    observation/reward normalisation applied to every copy (envs/wrappers.py)."""
    seed: int = 0
    """Seeds environments and the policy's initialisation."""
    preset: str = "auto"
    """Hyper-parameters for the environment's family under the keys this job sets itself
    (learner/presets.py): "auto" picks the family, "none" keeps the defaults below, or a
    family by name ("classic", "mujoco", "atari", "minatar", "minigrid")."""
    time_limit_s: float = 300.0
    """Stop after this many seconds of training even if the target is not reached."""
    target_return: float | None = None
    """Stop once the mean return of the last `target_window` episodes reaches this; None uses
    the environment's known threshold (CartPole-v1: 475), or none."""
    target_window: int = 20
    """Episodes averaged for the target."""
    max_env_steps: int | None = None
    """Stop after this many environment steps (also the learning-rate annealing horizon)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy's family and sizes (learner/models/; docs/models.md)."""
    ppo: PPOConfig = field(
        default_factory=lambda: PPOConfig(lr=5e-3, num_minibatches=2, max_grad_norm=5.0)
    )
    """PPO's hyper-parameters; the job's defaults differ from CleanRL's in lr (5e-3),
    minibatches (2) and the gradient clip (5): larger steps on fresh data solve CartPole-class
    tasks in ~100 updates of 1024 steps."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    intake: IntakeConfig = field(default_factory=IntakeConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    text: TextConfig = field(default_factory=TextConfig)
    """Sampling and tokenizer of a text environment (CodeGen-v1, CodeExec-v1)."""
    token: TokenRLConfig = field(default_factory=TokenRLConfig)
    """The token update of a text environment: algo (grpo or ppo), group_size, kl_coef, ...;
    the optimiser's learning rate stays `ppo.lr`."""

    def __post_init__(self) -> None:
        if not isinstance(self.env_id, str) or not self.env_id.strip():
            raise ConfigError(f"env_id = {self.env_id!r} is invalid: name an environment")
        check_int("seed", self.seed, 0, SEED_MAX)
        if self.preset not in PRESETS:
            raise ConfigError(
                f"preset = {self.preset!r} is invalid: use one of {', '.join(map(repr, PRESETS))}"
            )
        check_number("time_limit_s", self.time_limit_s, above=0)
        check_int("target_window", self.target_window, 1)
        if self.target_return is not None:
            check_number("target_return", self.target_return)
        if self.max_env_steps is not None:
            check_int("max_env_steps", self.max_env_steps, 1)
        self.text.sampling(self.token.temperature)
        if self.total_actors < self.learner.ranks:
            # Each rank trains only on the fragments of its own actors; a rank with none would
            # wait in the gradient all-reduce for ever.
            raise ConfigError(
                f"learner.ranks = {self.learner.ranks} is invalid with {self.total_actors} "
                "rollout actor(s) (rollout.workers × rollout.actors_per_worker): give every rank "
                "at least one actor"
            )

    @property
    def total_actors(self) -> int:
        return self.rollout.workers * self.rollout.actors_per_worker

    def resolved_target(self, canonical_env_id: str) -> float | None:
        """The return that counts as solved: explicit, else the environment's known threshold."""
        if self.target_return is not None:
            return self.target_return
        return known_target(canonical_env_id)
