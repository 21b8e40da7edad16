"""`shoal bench learning` runs a real `shoal train` and the CleanRL-style loop at its quick size;
the markdown table carries every column. Counts and finite figures only, no timing asserted."""

from __future__ import annotations

import dataclasses
import json
import math

import gymnasium
import pytest
import torch

from shoal.bench import cleanrl_ppo
from shoal.bench.learning import (
    HEADER,
    TASKS,
    Cell,
    Result,
    Task,
    baseline_args,
    markdown_row,
)
from shoal.cli import main as cli_main


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_bench_learning_trains_both_and_reports_returns(capsys):
    assert cli_main(["bench", "learning", "--quick", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["metric"] == "CartPole-v1 return at 4,096 steps"
    assert math.isfinite(row["shoal"])
    assert row["shoal"] > 0  # CartPole pays 1 per step: any finished episode has a return
    assert row["baseline"] > 0
    assert row["baseline_name"] == "CleanRL-style PPO"


def test_the_table_shows_mean_std_and_the_published_figure():
    task = Task("CartPole-v1", 1000, "490.04 ± 6.12 (ppo.py, 500k)", baseline=True)
    ours = Cell((100.0, 200.0, math.nan), (10.0, 20.0, 30.0))
    base = Cell((math.nan,), (5.0,))
    row = markdown_row(Result(task, ours, base))
    assert row.startswith("| CartPole-v1  | 1,000 | 150.00 ± 70.71 | 20 | no episode ended | 5 |")
    assert row.endswith("490.04 ± 6.12 (ppo.py, 500k) |")
    assert HEADER.count("\n") == 1
    assert HEADER.splitlines()[0].count("|") == row.count("|")
    assert len({t.env_id for t in TASKS}) == len(TASKS) == 7
    shoal_only = markdown_row(Result(task, ours, None))
    assert "| 150.00 ± 70.71 | 20 | — | — |" in shoal_only
    assert markdown_row(Result(task, None, base)).startswith(
        "| CartPole-v1  | 1,000 | — | — | no episode"
    )


def test_the_mujoco_rows_run_the_continuous_loop_with_ppo_continuous_actions_settings():
    cheetah = next(t for t in TASKS if t.env_id == "gym:HalfCheetah-v5")
    args = baseline_args(cheetah)
    assert (args.env_id, args.total_timesteps) == ("HalfCheetah-v5", cheetah.budget)
    assert (args.num_envs, args.num_steps, args.num_minibatches, args.update_epochs) == (
        1, 2048, 32, 10,
    )  # fmt: skip
    assert (args.learning_rate, args.ent_coef, args.minibatch_size) == (3e-4, 0.0, 64)
    assert baseline_args(TASKS[0]) == cleanrl_ppo.Args(
        env_id="CartPole-v1", total_timesteps=100_000
    )
    assert {t.env_id for t in TASKS if t.continuous} == {"gym:HalfCheetah-v5", "gym:Hopper-v5"}


@pytest.mark.timeout(300)
def test_the_continuous_loop_trains_a_gaussian_policy_and_counts_raw_episode_returns():
    # Hopper's random policy falls within tens of steps: episodes end in a tiny budget.
    args = dataclasses.replace(cleanrl_ppo.Args.continuous("Hopper-v5", 2048), num_steps=512)
    seen: list[cleanrl_ppo.Point] = []
    result = cleanrl_ppo.run(
        seed=0,
        time_limit_s=600.0,
        target=math.inf,
        max_env_steps=2048,
        args=args,
        on_iteration=seen.append,
    )
    assert result["env_steps"] == 2048
    assert not result["solved"]
    curve = result["curve"]
    assert [steps for _, steps, _ in curve] == [512, 1024, 1536, 2048]
    assert seen == curve  # the progress callback saw every point as it was made
    # Raw returns (Hopper pays about 1 per step alive), not the normalised, clipped rewards.
    assert all(math.isfinite(r) and r > 1.0 for _, _, r in curve)


def test_the_continuous_agent_is_a_state_independent_gaussian_and_its_env_clips_actions():
    agent = cleanrl_ppo.GaussianAgent(obs_dim=11, action_dim=3)
    obs = torch.zeros((5, 11))
    action, logprob, entropy, value = agent.get_action_and_value(obs)
    assert action.shape == (5, 3)
    assert logprob.shape == entropy.shape == value.shape == (5,)
    # log-std 0: each dimension's entropy is that of a unit normal, whatever the state.
    assert torch.allclose(entropy, torch.full((5,), 3 * 0.5 * math.log(2 * math.pi * math.e)))
    env = cleanrl_ppo._make_env(cleanrl_ppo.Args.continuous("Hopper-v5"))
    try:
        names = []
        layer = env
        while isinstance(layer, gymnasium.Wrapper):
            names.append(type(layer).__name__)
            layer = layer.env
    finally:
        env.close()
    assert names[:6] == [
        "ClipReward", "NormalizeReward", "TransformObservation", "NormalizeObservation",
        "ClipAction", "RecordEpisodeStatistics",
    ]  # fmt: skip
