"""Presets per environment family: the family picked, and the user's own keys always winning."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.cli import build_parser
from shoal.commands.train import build_config, given_keys
from shoal.errors import ConfigError
from shoal.learner.config import PRESETS, TrainConfig, known_target
from shoal.learner.presets import FAMILIES, Preset, apply_preset, family_of, merge

VECTOR = spaces.Box(-1.0, 1.0, (4,), np.float32)
IMAGE = spaces.Box(0, 255, (64, 64, 3), np.uint8)
DISCRETE = spaces.Discrete(3)
CONTINUOUS = spaces.Box(-1.0, 1.0, (2,), np.float32)

# A valid value of each key a preset sets, different in general from the preset's own.
_SIZES = st.lists(st.integers(1, 256), min_size=1, max_size=3).map(tuple)
_UNIT = st.floats(0.0, 1.0)
VALUES: dict[str, st.SearchStrategy[Any]] = {
    "rollout.num_envs": st.integers(1, 64),
    "rollout.horizon": st.integers(1, 512),
    "model.hidden": _SIZES,
    "model.channels": _SIZES,
    "ppo.lr": st.floats(1e-6, 1.0),
    "ppo.num_minibatches": st.integers(1, 64),
    "ppo.update_epochs": st.integers(1, 20),
    "ppo.max_grad_norm": st.floats(0.01, 10.0),
    "ppo.clip_coef": st.floats(0.01, 1.0),
    "ppo.ent_coef": st.floats(0.0, 0.1),
    "ppo.norm_adv": st.booleans(),
    "ppo.gamma": _UNIT,
    "ppo.gae_lambda": _UNIT,
    "env.normalize_observation": st.booleans(),
    "env.normalize_reward": st.booleans(),
    "checkpoint.interval_s": st.floats(0.5, 3600.0),
    "env.wrappers": st.sampled_from([(), ({"name": "atari", "kwargs": {}},)]),
}


def value_of(cfg: TrainConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


@st.composite
def user_jobs(draw: st.DrawFn) -> tuple[Preset, TrainConfig, set[str]]:
    """A family's preset, a job whose user set some of its keys (to any valid value), and
    those keys (as leaves or as whole sections)."""
    preset = draw(st.sampled_from(sorted(FAMILIES.values(), key=lambda p: p.name)))
    keys = sorted(preset.values)
    chosen = draw(st.lists(st.sampled_from(keys), unique=True))
    user = Preset("user", "test", {k: draw(VALUES[k]) for k in chosen})
    explicit = set(chosen)
    if draw(st.booleans()) and chosen:
        explicit.add(chosen[0].rpartition(".")[0])  # the whole section was given
    return preset, merge(TrainConfig(), user, ()), explicit


@settings(max_examples=200, deadline=None)
@given(user_jobs())
def test_explicit_keys_always_win_and_the_rest_come_from_the_preset(
    job: tuple[Preset, TrainConfig, set[str]],
) -> None:
    preset, cfg, explicit = job
    merged = merge(cfg, preset, explicit)
    for key, value in preset.values.items():
        covered = any(key == e or key.startswith(e + ".") for e in explicit)
        assert value_of(merged, key) == (value_of(cfg, key) if covered else value)
    assert merge(merged, preset, explicit) == merged  # applying twice changes nothing more
    untouched = {"seed", "env_id", "time_limit_s", "learner", "intake"}
    for name in untouched:
        assert getattr(merged, name) == getattr(cfg, name)


@pytest.mark.parametrize(
    ("env_id", "observation", "action", "family"),
    [
        ("CartPole-v1", VECTOR, DISCRETE, "classic"),
        ("gym:Pendulum-v1", VECTOR, CONTINUOUS, "mujoco"),
        ("gym:HalfCheetah-v5", VECTOR, CONTINUOUS, "mujoco"),
        ("gym:ALE/Pong-v5", IMAGE, DISCRETE, "atari"),
        ("gym:MinAtar/Breakout-v1", IMAGE, DISCRETE, "minatar"),
        ("gym:MiniGrid-DoorKey-5x5-v0", spaces.Dict({"image": IMAGE}), DISCRETE, "minigrid"),
        ("gym:BabyAI-GoToLocal-v0", spaces.Dict({"image": IMAGE}), DISCRETE, "minigrid"),
        ("gym:CarRacing-v3", IMAGE, CONTINUOUS, None),
        ("gym:Blackjack-v1", spaces.Tuple((DISCRETE, DISCRETE)), DISCRETE, None),
    ],
)
def test_the_family_comes_from_the_id_or_else_the_spaces(
    env_id: str, observation: spaces.Space[Any], action: spaces.Space[Any], family: str | None
) -> None:
    assert family_of(env_id, observation, action) == family


def test_auto_names_the_family_used_and_none_keeps_the_defaults() -> None:
    cfg = apply_preset(TrainConfig(env_id="CartPole-v1"), set(), (VECTOR, DISCRETE))
    assert cfg.preset == "classic"
    grid = TrainConfig(env_id="gym:MiniGrid-DoorKey-5x5-v0")
    assert apply_preset(grid, set(), (spaces.Dict({"image": IMAGE}), DISCRETE)).ppo.lr == 1e-3
    assert apply_preset(dataclasses.replace(grid, preset="none"), set()) == dataclasses.replace(
        grid, preset="none"
    )
    odd = apply_preset(TrainConfig(env_id="gym:CarRacing-v3"), set(), (IMAGE, CONTINUOUS))
    assert odd.preset == "none"
    assert odd.ppo == TrainConfig().ppo


def test_a_preset_by_name_applies_whatever_the_environment() -> None:
    cfg = apply_preset(TrainConfig(env_id="CartPole-v1", preset="minigrid"), {"ppo.lr"})
    assert (cfg.preset, cfg.rollout.num_envs, cfg.ppo.lr) == ("minigrid", 16, TrainConfig().ppo.lr)


def test_the_minigrid_preset_leaves_advantages_unscaled_unless_the_job_says() -> None:
    grid = TrainConfig(env_id="gym:MiniGrid-DoorKey-5x5-v0")
    space = (spaces.Dict({"image": IMAGE}), DISCRETE)
    assert apply_preset(grid, set(), space).ppo.norm_adv is False
    assert apply_preset(grid, {"ppo.norm_adv"}, space).ppo.norm_adv is True


def test_an_unknown_preset_is_refused_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"preset = 'fast' is invalid: use one of 'auto'"):
        TrainConfig(preset="fast")
    assert set(PRESETS) == {"auto", "none", *FAMILIES}


def test_the_job_file_the_environment_and_the_flags_beat_the_preset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = tmp_path / "job.toml"
    job.write_text('env_id = "gym:MiniGrid-DoorKey-5x5-v0"\n[ppo]\nlr = 0.01\n')
    monkeypatch.setenv("SHOAL_PPO_UPDATE_EPOCHS", "7")
    args = build_parser().parse_args(["train", str(job), "--envs", "3"])
    cfg = build_config(args)
    assert cfg.preset == "minigrid"
    assert (cfg.ppo.lr, cfg.ppo.update_epochs, cfg.rollout.num_envs) == (0.01, 7, 3)
    assert (cfg.rollout.horizon, cfg.ppo.num_minibatches) == (128, 8)  # the preset's


def test_given_keys_are_the_leaves_not_their_tables() -> None:
    keys = given_keys({"ppo": {"lr": 1.0}, "env_kwargs": {"size": 5}}, {"SHOAL_MODEL_HIDDEN": "8"})
    assert keys == {"ppo.lr", "env_kwargs.size", "model.hidden"}


@pytest.mark.parametrize(
    ("env_id", "target"),
    [
        ("CartPole-v1", 475.0),
        ("Acrobot-v1", -100.0),
        ("gym:MountainCar-v0", -110.0),
        ("gym:HalfCheetah-v5", 4800.0),
        ("gym:ALE/Pong-v5", None),
        ("gym:NoSuchThing-v0", None),
    ],
)
def test_known_targets_include_gymnasiums_thresholds(env_id: str, target: float | None) -> None:
    assert known_target(env_id) == target


def test_the_mujoco_preset_clips_actions_so_no_control_cost_is_paid_beyond_the_box() -> None:
    """ppo_continuous_action.py's ClipAction: HalfCheetah charges 0.1 x sum a^2 on the action
    as given while MuJoCo clamps it, so an unclipped Gaussian sample of 5 would cost 25x."""
    import gymnasium

    from shoal.envs.vector import TRUE_RETURN
    from shoal.envs.wrappers import prepare_gym_env

    cfg = apply_preset(TrainConfig(env_id="gym:HalfCheetah-v5"), set())
    assert cfg.preset == "mujoco"
    assert cfg.env.normalize_observation
    assert cfg.env.normalize_reward
    wrapped = prepare_gym_env(gymnasium.make("HalfCheetah-v5"), cfg.env)
    raw = gymnasium.make("HalfCheetah-v5")
    try:
        wrapped.reset(seed=0)
        raw.reset(seed=0)
        _, _, _, _, info = wrapped.step(np.full(6, 5.0, np.float32))
        _, at_the_bound, _, _, _ = raw.step(np.ones(6, np.float32))
        raw.reset(seed=0)
        _, beyond, _, _, _ = raw.step(np.full(6, 5.0, np.float32))
    finally:
        wrapped.close()
        raw.close()
    assert info[TRUE_RETURN] == pytest.approx(float(at_the_bound))
    assert float(beyond) < float(at_the_bound) - 10  # 0.1 x 6 x (25 - 1) more control cost
