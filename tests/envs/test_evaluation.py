"""Evaluation on real batched environments: counts, sweeps, variants, reports and bad input."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from gymnasium import spaces
from hypothesis import given
from hypothesis import strategies as st

from shoal.envs.errors import EnvError
from shoal.envs.evaluation import (
    EvalOptions,
    EvaluationError,
    Variant,
    episode_quotas,
    evaluate,
    random_actions,
    render_html,
    summarise,
    write_report,
)
from shoal.errors import ConfigError

NO_SWEEPS = EvalOptions(obs_noise=(), action_noise=())


@pytest.fixture(autouse=True)
def _hash_store_in_tmp(tmp_path, monkeypatch):
    """Every report records its environment hash; keep the store out of the real home."""
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "shoal-home"))


def always_left(obs: np.ndarray) -> np.ndarray:
    return np.zeros(len(obs), dtype=np.int64)


@given(st.integers(1, 500), st.integers(1, 64))
def test_quotas_sum_to_the_episodes_and_differ_by_at_most_one(episodes, num_envs):
    quotas = episode_quotas(episodes, num_envs)
    assert quotas.sum() == episodes
    assert quotas.max() - quotas.min() <= 1


@given(
    st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50),
    st.floats(-1e6, 1e6),
)
def test_summary_statistics_bound_each_other(returns, threshold):
    lengths = [i + 1 for i in range(len(returns))]
    m = summarise(
        returns, lengths, env_steps=sum(lengths), seconds=1.0, success_threshold=threshold
    )
    assert m.episodes == len(returns)
    assert m.min_return <= m.mean_return + 1e-6
    assert m.mean_return <= m.max_return + 1e-6
    assert m.success_rate == sum(r >= threshold for r in returns) / len(returns)
    assert m.steps_per_s == sum(lengths)


@pytest.mark.timeout(60)
def test_constant_policy_on_cartpole_counts_every_episode_exactly():
    opts = EvalOptions(num_envs=4, success_threshold=475.0, obs_noise=(), action_noise=())
    result = evaluate(always_left, "CartPole-v1", episodes=10, seed=3, options=opts)
    m = result.metrics
    assert m.episodes == 10
    assert len(m.returns) == 10
    # CartPole pays 1 per step, so each episode's return is its length.
    assert m.returns == [float(n) for n in m.lengths]
    assert m.success_rate == 0.0
    assert m.env_steps % 4 == 0
    assert m.env_steps >= sum(m.lengths)
    again = evaluate(always_left, "CartPole-v1", episodes=10, seed=3, options=opts)
    assert again.metrics.returns == m.returns
    assert result.env_hash == again.env_hash


@pytest.mark.timeout(60)
def test_noise_sweeps_report_each_level_and_reuse_the_clean_run():
    opts = EvalOptions(num_envs=4, obs_noise=(0.0, 0.5), action_noise=(0.0, 1.0))
    result = evaluate(always_left, "CartPole-v1", episodes=8, seed=0, options=opts)
    assert [p.level for p in result.obs_noise] == [0.0, 0.5]
    assert [p.level for p in result.action_noise] == [0.0, 1.0]
    assert result.obs_noise[0].metrics == result.metrics
    # always pushing left falls within ~10 steps; uniformly random pushes last longer
    assert result.action_noise[1].metrics.mean_length > result.metrics.mean_length
    for point in result.obs_noise + result.action_noise:
        assert point.metrics.episodes == 8


@pytest.mark.timeout(60)
def test_held_out_variants_get_their_own_rows_and_hashes():
    held = [Variant("held-out", "GridWorld-HeldOut-v1")]
    result = evaluate(
        always_left, "GridWorld-Train-v1", episodes=4, seed=1, held_out=held, options=NO_SWEEPS
    )
    names = [(v.name, v.held_out) for v in result.generalisation]
    assert names == [("train", False), ("held-out", True)]
    assert result.generalisation[0].env_hash == result.env_hash
    assert result.generalisation[1].env_hash != result.env_hash
    assert all(v.metrics.episodes == 4 for v in result.generalisation)


@pytest.mark.timeout(60)
def test_report_files_carry_the_hash_and_inline_svg_plots(tmp_path):
    opts = EvalOptions(num_envs=2, obs_noise=(0.0, 0.1), action_noise=(0.0, 0.5))
    result = evaluate(
        always_left,
        "CartPole-v1",
        episodes=4,
        seed=0,
        held_out=[Variant("short", "CartPole-v1", {"max_episode_steps": 5})],
        options=opts,
    )
    json_path, html_path = write_report(result, tmp_path / "reports")
    data = json.loads(json_path.read_text())
    assert data["env_hash"] == result.env_hash
    assert data["metrics"]["episodes"] == 4
    page = html_path.read_text()
    assert result.env_hash in page
    assert page.count("<svg") == 4  # histogram, variants, two noise sweeps
    assert "<script" not in page
    assert "https://" not in page
    for svg in page.split("<svg")[1:]:
        ET.fromstring("<svg" + svg.split("</svg>")[0] + "</svg>")


@pytest.mark.timeout(60)
def test_success_defaults_to_the_declared_threshold_where_there_is_one():
    cartpole = evaluate(always_left, "CartPole-v1", episodes=2, seed=0, options=NO_SWEEPS)
    assert (
        cartpole.success_criterion == "episode return ≥ 475 (Gymnasium's threshold for CartPole-v1)"
    )
    assert cartpole.success_rate == 0.0
    grid = evaluate(always_left, "GridWorld-v1", episodes=2, seed=0, options=NO_SWEEPS)
    assert grid.success_rate is None
    assert grid.success_criterion.startswith("none")


def test_bad_options_name_the_argument():
    with pytest.raises(EvaluationError, match="episodes=0"):
        EvalOptions(episodes=0)
    with pytest.raises(EvaluationError, match=r"obs_noise contains -0\.1"):
        EvalOptions(obs_noise=(-0.1,))
    with pytest.raises(EvaluationError, match=r"probability in \[0, 1\]"):
        EvalOptions(action_noise=(1.5,))
    assert issubclass(EvaluationError, EnvError)
    assert issubclass(EvaluationError, ConfigError)


@pytest.mark.timeout(60)
def test_episodes_that_never_finish_hit_the_step_budget():
    opts = EvalOptions(num_envs=4, max_steps=4, obs_noise=(), action_noise=())
    with pytest.raises(EvaluationError, match="max_steps=4"):
        evaluate(always_left, "CartPole-v1", episodes=4, seed=0, options=opts)


def test_unknown_environment_is_a_clear_error():
    with pytest.raises(EnvError):
        evaluate(always_left, "NoSuchEnv-v9", episodes=2, options=NO_SWEEPS)


@pytest.mark.timeout(60)
def test_report_into_a_file_path_is_refused(tmp_path):
    result = evaluate(always_left, "CartPole-v1", episodes=2, seed=0, options=NO_SWEEPS)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(EvaluationError, match="pick a writable out_dir"):
        write_report(result, blocker)
    assert "<svg" in render_html(result)


@given(
    st.integers(1, 20),
    st.integers(-5, 5),
    st.lists(st.integers(1, 6), min_size=1, max_size=3),
    st.integers(0, 2**31 - 1),
)
def test_random_actions_lie_in_their_space(n, start, nvec, seed):
    rng = np.random.default_rng(seed)
    bounds = np.array([-1.0, -np.inf], np.float32), np.array([2.0, np.inf], np.float32)
    box = spaces.Box(low=bounds[0], high=bounds[1], dtype=np.float32)
    for space in (spaces.Discrete(n, start=start), box, spaces.MultiDiscrete(nvec)):
        actions = random_actions(space, 7, rng)
        assert len(actions) == 7
        assert all(space.contains(np.asarray(a, dtype=space.dtype)) for a in actions)


def test_action_noise_on_an_unsupported_space_names_the_way_out():
    with pytest.raises(EvaluationError, match=r"pass action_noise=\(\)"):
        random_actions(spaces.Text(5), 1, np.random.default_rng(0))
