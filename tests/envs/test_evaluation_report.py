"""What the evaluation page shows and where it goes: no generalisation chart that compares
one variant with nothing, extra sections in their place, a labelled report never replacing
another, and progress told of every episode of every condition."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.envs.evaluation import EvalOptions, Variant, evaluate, render_html, write_report

SWEEPS = EvalOptions(num_envs=2, obs_noise=(0.0, 0.1), action_noise=(0.0, 0.5))


@pytest.fixture(autouse=True)
def _hash_store_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "shoal-home"))


def always_left(obs: np.ndarray) -> np.ndarray:
    return np.zeros(len(obs), dtype=np.int64)


@pytest.mark.timeout(60)
def test_one_variant_has_no_generalisation_section_and_two_have_one():
    alone = evaluate(always_left, "CartPole-v1", episodes=2, seed=0, options=SWEEPS)
    page = render_html(alone)
    assert "Generalisation" not in page
    assert "Mean return per variant" not in page
    held = [Variant("short", "CartPole-v1", {"max_episode_steps": 5})]
    both = evaluate(always_left, "CartPole-v1", episodes=2, seed=0, held_out=held, options=SWEEPS)
    page = render_html(both)
    assert "<h2>Generalisation</h2>" in page
    assert "Mean return per variant" in page


@pytest.mark.timeout(60)
def test_sections_come_after_the_run_table():
    result = evaluate(always_left, "CartPole-v1", episodes=2, seed=0, options=SWEEPS)
    page = render_html(result, [("Learning curves", "<p>curves here</p>")])
    assert page.index("<h2>Run</h2>") < page.index("<h2>Learning curves</h2>")
    assert page.index("curves here") < page.index("<h2>Performance</h2>")


@pytest.mark.timeout(60)
def test_a_labelled_report_never_replaces_another(tmp_path):
    result = evaluate(always_left, "CartPole-v1", episodes=2, seed=0, options=SWEEPS)
    unlabelled = write_report(result, tmp_path)
    before = unlabelled[1].read_bytes()
    first = write_report(result, tmp_path, label="step7-20260101-000000")
    second = write_report(result, tmp_path, label="step7-20260101-000000")
    names = {p.name for p in (*unlabelled, *first, *second)}
    assert len(names) == 6
    assert first[0].name.endswith("-step7-20260101-000000.json")
    assert second[0].name.endswith("-step7-20260101-000000-2.json")
    assert unlabelled[1].read_bytes() == before


@pytest.mark.timeout(60)
def test_progress_hears_every_episode_of_every_condition():
    heard: list[tuple[str, int, int]] = []
    held = [Variant("short", "CartPole-v1", {"max_episode_steps": 5})]
    evaluate(
        always_left,
        "CartPole-v1",
        episodes=3,
        seed=0,
        held_out=held,
        options=SWEEPS,
        progress=lambda *told: heard.append(told),
    )
    total = 3 * 4  # clean, one variant, one non-zero level of each sweep
    assert {t for _, _, t in heard} == {total}
    done = [d for _, d, _ in heard]
    assert done == sorted(done)
    assert done[0] == 0
    assert done[-1] == total
    labels = list(dict.fromkeys(label for label, _, _ in heard))
    assert labels == ["no noise", "variant short", "obs noise σ=0.1", "action noise ε=0.5"]
