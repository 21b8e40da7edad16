"""The CleanRL-style baseline runs its real loop and reports what bench/train.py reads."""

from __future__ import annotations

import pytest
import torch

from shoal.bench.cleanrl_ppo import Args, run


@pytest.mark.timeout(120)
def test_a_short_run_reports_steps_curve_and_keeps_torch_threads():
    threads = torch.get_num_threads()
    result = run(seed=3, time_limit_s=600, max_env_steps=1024)
    assert torch.get_num_threads() == threads
    assert result["env_steps"] == 1024
    assert result["solved"] is False
    assert result["solved_at_s"] is None
    assert result["sps"] > 0
    assert [steps for _, steps, _ in result["curve"]] == [512, 1024]
    assert all(mean >= 0 for _, _, mean in result["curve"])


@pytest.mark.timeout(120)
def test_a_reachable_target_is_reported_as_solved():
    result = run(seed=3, time_limit_s=600, target=5.0, max_env_steps=4096)
    assert result["solved"] is True
    assert result["solved_at_s"] is not None
    assert result["curve"][-1][2] >= 5.0


def test_defaults_are_cleanrls():
    args = Args()
    assert (args.num_envs, args.num_steps, args.batch_size, args.minibatch_size) == (
        4,
        128,
        512,
        128,
    )
    assert (args.learning_rate, args.gamma, args.gae_lambda, args.clip_coef) == (
        2.5e-4,
        0.99,
        0.95,
        0.2,
    )
    assert (args.update_epochs, args.ent_coef, args.vf_coef, args.max_grad_norm) == (
        4,
        0.01,
        0.5,
        0.5,
    )
