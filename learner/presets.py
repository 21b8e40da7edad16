"""Hyper-parameters per environment family, so `shoal train <id>` starts from settings known
to learn that kind of environment instead of the CartPole-tuned job defaults.

A `Preset` is a flat table of dotted `TrainConfig` keys (`ppo.lr`, `rollout.num_envs`,
`env.wrappers`, ...). `preset_for(env_id, observation_space, action_space)` picks the family
from the id (ALE, MinAtar, MiniGrid/BabyAI) or else from the spaces (a 1-D Box action is
continuous control); `apply_preset(cfg, explicit)` fills in every key of the chosen preset
that the user did not set: `explicit` holds the dotted keys given in the job TOML, as
`SHOAL_*` variables or as flags, and those always win. `merge` is the pure core of that.

The reference is CleanRL's published defaults (github.com/vwxyzjn/cleanrl), mapped onto a
job: CleanRL's `num_envs × num_steps` batch is `rollout.num_envs × rollout.horizon` per
fragment (one fragment per update), its `num_minibatches`, `update_epochs`, learning rate,
clip, entropy and value coefficients are `ppo.*`, its observation/reward normalisation
wrappers are `env.normalize_*`, and its Atari wrapper stack is the `atari` wrapper set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gymnasium import spaces

    from shoal.learner.config import TrainConfig


@dataclass(frozen=True)
class Preset:
    """One family's settings: `values` maps dotted TrainConfig keys to what the family uses."""

    name: str
    source: str
    """Where the numbers come from (which script's defaults), shown to the user."""
    values: Mapping[str, Any] = field(default_factory=dict)


CHECKPOINT_EVERY_S = 60.0
"""These families' models are small and their returns swing: a checkpoint a minute (not the
job default's 15) lets the best one (learner/checkpoint_best.py) catch a peak."""

CLASSIC = Preset(
    "classic",
    "CleanRL ppo.py, at shoal's measured CartPole batch",
    {
        # ppo.py: 4 envs x 128 steps, lr 2.5e-4, 4 minibatches, gradient clip 0.5. Shoal's
        # job defaults take bigger steps on smaller fresh batches (32 x 32 steps, lr 5e-3, 2
        # minibatches, gradient clip 5) and solve CartPole-v1 in ~100 updates; the rest is ppo.py's.
        "rollout.num_envs": 32,
        "rollout.horizon": 32,
        "model.hidden": (64, 64),
        "ppo.lr": 5e-3,
        "ppo.num_minibatches": 2,
        "ppo.update_epochs": 4,
        "ppo.max_grad_norm": 5.0,
        "ppo.clip_coef": 0.2,
        "ppo.ent_coef": 0.01,
        "ppo.gamma": 0.99,
        "ppo.gae_lambda": 0.95,
        "checkpoint.interval_s": CHECKPOINT_EVERY_S,
    },
)
MUJOCO = Preset(
    "mujoco",
    "CleanRL ppo_continuous_action.py",
    {
        # 2048 steps per update (ppo_continuous_action.py: 1 env x 2048 steps) as 8 x 256, in
        # 32 minibatches of 64, 10 epochs, lr 3e-4, no entropy bonus; running observation and
        # reward normalisation as its NormalizeObservation/NormalizeReward wrappers. Its
        # ClipAction too: the Gaussian's samples leave the action box, and MuJoCo's tasks
        # charge their control cost on the action as given (HalfCheetah: 0.1 x sum a^2) while
        # the simulator clamps it, so unclipped the policy pays for force it never applies.
        # (Its ±10 clips of the normalised observation and reward are not here: the job's
        # normalisation comes after its wrappers, and those clips bind only beyond 10 std.)
        "env.wrappers": ({"name": "ClipAction", "kwargs": {}},),
        "rollout.num_envs": 8,
        "rollout.horizon": 256,
        "model.hidden": (64, 64),
        "ppo.lr": 3e-4,
        "ppo.num_minibatches": 32,
        "ppo.update_epochs": 10,
        "ppo.max_grad_norm": 0.5,
        "ppo.clip_coef": 0.2,
        "ppo.ent_coef": 0.0,
        "ppo.gamma": 0.99,
        "ppo.gae_lambda": 0.95,
        "checkpoint.interval_s": CHECKPOINT_EVERY_S,
        "env.normalize_observation": True,
        "env.normalize_reward": True,
    },
)
ATARI = Preset(
    "atari",
    "CleanRL ppo_atari.py",
    {
        # ppo_atari.py: 8 envs x 128 steps, 4 minibatches, 4 epochs, lr 2.5e-4, clip 0.1, its
        # wrapper stack (the `atari` set) and the Nature CNN with one 512-wide dense layer.
        "env.wrappers": ({"name": "atari", "kwargs": {}},),
        "rollout.num_envs": 8,
        "rollout.horizon": 128,
        "model.channels": (32, 64, 64),
        "model.hidden": (512,),
        "ppo.lr": 2.5e-4,
        "ppo.num_minibatches": 4,
        "ppo.update_epochs": 4,
        "ppo.max_grad_norm": 0.5,
        "ppo.clip_coef": 0.1,
        "ppo.ent_coef": 0.01,
        "ppo.gamma": 0.99,
        "ppo.gae_lambda": 0.95,
        "checkpoint.interval_s": CHECKPOINT_EVERY_S,
    },
)
MINATAR = Preset(
    "minatar",
    "CleanRL ppo_atari.py, for MinAtar's 10x10 frames",
    {
        # ppo_atari.py's update (4 epochs, clip 0.1, entropy 0.01) without its wrapper stack,
        # which MinAtar's small symbolic frames do not need; cheap steps allow 16 envs and a
        # larger learning rate (5e-4).
        "rollout.num_envs": 16,
        "rollout.horizon": 128,
        "model.hidden": (256,),
        "ppo.lr": 5e-4,
        "ppo.num_minibatches": 4,
        "ppo.update_epochs": 4,
        "ppo.max_grad_norm": 0.5,
        "ppo.clip_coef": 0.1,
        "ppo.ent_coef": 0.01,
        "ppo.gamma": 0.99,
        "ppo.gae_lambda": 0.95,
        "checkpoint.interval_s": CHECKPOINT_EVERY_S,
    },
)
MINIGRID = Preset(
    "minigrid",
    "CleanRL ppo.py's update at rl-starter-files' MiniGrid batch",
    {
        # ppo.py's loss and clip; the batch and rate of lcswillems/rl-starter-files, the usual
        # MiniGrid reference: 16 envs x 128 steps, minibatches of 256, lr 1e-3. Like its
        # torch-ac, advantages are not normalised: until the first door opens they are value
        # noise, and scaled to unit variance that noise drove one DoorKey seed in three away
        # from exploring (docs/benchmarks.md, "MiniGrid-DoorKey-5x5 and advantage scaling").
        "rollout.num_envs": 16,
        "rollout.horizon": 128,
        "model.hidden": (64, 64),
        "ppo.lr": 1e-3,
        "ppo.num_minibatches": 8,
        "ppo.update_epochs": 4,
        "ppo.max_grad_norm": 0.5,
        "ppo.clip_coef": 0.2,
        "ppo.ent_coef": 0.01,
        "ppo.norm_adv": False,
        "ppo.gamma": 0.99,
        "ppo.gae_lambda": 0.95,
        "checkpoint.interval_s": CHECKPOINT_EVERY_S,
    },
)
FAMILIES: dict[str, Preset] = {p.name: p for p in (CLASSIC, MUJOCO, ATARI, MINATAR, MINIGRID)}


def family_of(
    env_id: str, observation_space: spaces.Space[Any], action_space: spaces.Space[Any]
) -> str | None:
    """The family an environment belongs to: by its id where the id says (ALE, MinAtar,
    MiniGrid, BabyAI), else by its spaces; None when no preset fits (pixels outside ALE)."""
    from gymnasium import spaces as gym_spaces

    name = env_id.removeprefix("gym:")
    if name.startswith("ALE/") or "NoFrameskip" in name:
        return "atari"
    if name.startswith("MinAtar/"):
        return "minatar"
    if name.startswith(("MiniGrid-", "BabyAI-")):
        return "minigrid"
    vector = isinstance(observation_space, gym_spaces.Box) and len(observation_space.shape) == 1
    if not vector:
        return None
    if isinstance(action_space, gym_spaces.Box) and len(action_space.shape) == 1:
        return "mujoco"
    return "classic" if isinstance(action_space, gym_spaces.Discrete) else None


def preset_for(
    env_id: str, observation_space: spaces.Space[Any], action_space: spaces.Space[Any]
) -> Preset | None:
    """The preset `auto` picks for this environment, or None (the job defaults stay)."""
    family = family_of(env_id, observation_space, action_space)
    return None if family is None else FAMILIES[family]


def merge(cfg: TrainConfig, preset: Preset, explicit: Collection[str]) -> TrainConfig:
    """`cfg` with every key of `preset` that is not in `explicit` set to the preset's value.
    A key counts as explicit when it or a section above it was given (`ppo` covers `ppo.lr`).
    Pure; each section validates the result as it always does."""
    sections: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, value in preset.values.items():
        if _given(key, explicit):
            continue
        section, _, leaf = key.rpartition(".")
        if section:
            sections.setdefault(section, {})[leaf] = value
        else:
            top[leaf] = value
    for section, values in sections.items():
        top[section] = dataclasses.replace(getattr(cfg, section), **values)
    return dataclasses.replace(cfg, **top) if top else cfg


def _given(key: str, explicit: Collection[str]) -> bool:
    parts = key.split(".")
    return any(".".join(parts[:i]) in explicit for i in range(1, len(parts) + 1))


def apply_preset(
    cfg: TrainConfig,
    explicit: Collection[str],
    spaces_of: tuple[spaces.Space[Any], spaces.Space[Any]] | None = None,
) -> TrainConfig:
    """`cfg` with its preset applied under the keys the user gave (`explicit`), and
    `cfg.preset` set to the family used ("none" when none applies). `spaces_of` is the raw
    environment's (observation, action) spaces, made here when needed and not given."""
    choice = cfg.preset
    if choice == "none":
        return cfg
    if choice == "auto":
        observation_space, action_space = spaces_of or raw_spaces(cfg.env_id, cfg.env_kwargs)
        preset = preset_for(cfg.env_id, observation_space, action_space)
    else:
        preset = FAMILIES[choice]
    if preset is None:
        return dataclasses.replace(cfg, preset="none")
    return dataclasses.replace(merge(cfg, preset, explicit), preset=preset.name)


def raw_spaces(
    env_id: str, env_kwargs: Mapping[str, Any]
) -> tuple[spaces.Space[Any], spaces.Space[Any]]:
    """The spaces of one unwrapped copy of the environment (before any job wrapper)."""
    from shoal.envs import registry

    env = registry.make(env_id, **env_kwargs)
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()


def describe(preset_name: str) -> str:
    """One line for the console: which preset a run uses and where its numbers come from."""
    if preset_name not in FAMILIES:
        return "preset: none (the job defaults)"
    return f"preset: {preset_name} ({FAMILIES[preset_name].source})"


def registered_threshold(env_id: str) -> float | None:
    """The `reward_threshold` a Gymnasium registration declares for a `gym:` id, if any."""
    if not env_id.startswith("gym:"):
        return None
    import gymnasium

    try:
        threshold = gymnasium.spec(env_id.removeprefix("gym:")).reward_threshold
    except gymnasium.error.Error:
        return None
    return None if threshold is None else float(threshold)
