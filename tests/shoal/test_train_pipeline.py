"""`shoal train --pipeline`: the four stages through the real CLI on a tiny GridWorld run, the
config sources (env id, a job.toml's [pipeline] table, SHOAL_* overrides, --seed), and the
mistakes a user makes, each one `shoal: error:` line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.cli import main
from shoal.errors import ConfigError
from shoal.train_pipeline import STAGES, finite, pipeline_config, stage_line

pytestmark = pytest.mark.timeout(120)

TINY = """
[pipeline]
env_id = "GridWorld-v1"
num_envs = 4
demo_steps = 256
pretrain_epochs = 2
ppo_env_steps = 512
horizon = 32
eval_episodes = 4
"""


def _job(tmp_path: Path, text: str = TINY) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_a_tiny_pipeline_prints_every_stage_and_a_strict_json_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", "--pipeline", str(_job(tmp_path)), "--seed", "5", "--run-dir", str(run_dir)]
    assert main([*argv, "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    stage_lines = [line for line in lines if line.startswith("stage ")]
    assert [line.split()[2] for line in stage_lines] == list(STAGES)
    assert f"pipeline.json: {run_dir / 'pipeline.json'}" in lines
    summary = json.loads(lines[-1], parse_constant=pytest.fail)
    assert summary["seed"] == 5
    assert summary["env_id"] == "GridWorld-v1"
    assert [s["name"] for s in summary["stages"]] == list(STAGES)
    assert Path(summary["report"]).is_file()
    assert Path(summary["report_html"]).is_file()
    manifest = json.loads((run_dir / "pipeline.json").read_text())
    assert manifest["config"]["seed"] == 5
    assert manifest["config"]["demo_steps"] == 256


def test_the_config_comes_from_the_toml_table_then_the_environment_then_seed(
    tmp_path: Path,
) -> None:
    cfg = pipeline_config(str(_job(tmp_path)), 9, environ={"SHOAL_DEMO_STEPS": "128"})
    assert (cfg.env_id, cfg.seed, cfg.demo_steps, cfg.horizon) == ("GridWorld-v1", 9, 128, 32)
    plain = pipeline_config("GridWorld-v1", None, environ={})
    assert plain.env_id == "GridWorld-v1"
    assert plain.seed == 0


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[ppo]\nlr = 1e-3\n", "no [pipeline] table"),
        ("[pipeline]\nnum_envs = 4\n", "[pipeline] has no env_id"),
        ("[pipeline]\nenv_id = 'GridWorld-v1'\nhorizon = 0\n", "pipeline.horizon = 0"),
        ("[pipeline\n", "not valid TOML"),
    ],
)
def test_a_bad_job_file_names_what_to_fix(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        pipeline_config(str(_job(tmp_path, text)), None, environ={})


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["NoSuchEnv-v0"], "no environment 'NoSuchEnv-v0'"),
        (["cartpole"], "has no teacher for stage 1"),
        (["GridWorld-v1", "--workers", "2"], "--workers does not apply to --pipeline"),
        (["/nonexistent/shoal-test/job.toml"], "no such file"),
    ],
)
def test_a_mistake_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    code = main(["train", "--pipeline", *argv, "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("shoal: error:")
    assert "\n" not in err
    assert words in err


def test_a_stage_line_shows_its_number_time_and_headline_metrics() -> None:
    stage = {"name": "ppo", "wall_s": 1.5, "metrics": {"env_steps": 512.0, "updates": 4.0}}
    assert stage_line(stage) == (
        "stage 3/4 ppo               1.50s  env_steps 512, updates 4, mean_return_last20 -"
    )


def test_the_distillation_stage_line_shows_each_model_s_precision() -> None:
    metrics = {"teacher": {"ce": 0.001, "bf16": True}, "student": {"kl": 0.002, "ce": 0.003,
               "params": 253344, "bf16": False}}  # fmt: skip
    line = stage_line({"name": "distillation", "wall_s": 233.0, "metrics": metrics})
    assert line.endswith("student.params 2.533e+05, teacher.bf16 true, student.bf16 false")


def test_the_rl_stage_line_shows_which_checkpoint_validation_kept() -> None:
    metrics = {"updates": 120, "reward_first5": 0.4, "reward_last5": 0.5, "mean_staleness": 0.9,
               "validation_student": 0.25, "validation_selected": 0.3125, "selected_step": 60}  # fmt: skip
    line = stage_line({"name": "rl", "wall_s": 80.0, "metrics": metrics})
    assert line.startswith("stage 3/4 rl ")
    assert line.endswith("validation_student 0.25, validation_selected 0.3125, selected_step 60")


def test_the_evaluation_stage_line_shows_what_rl_added_to_the_student() -> None:
    metrics = {"rl": {"heldout": {"pass_at": {"1": 0.47}}},
               "rl_minus_student": {"heldout": {"difference": 0.275, "se": 0.0354}}}  # fmt: skip
    line = stage_line({"name": "evaluation", "wall_s": 32.0, "metrics": metrics})
    assert line.endswith(
        "rl.heldout.pass_at.1 0.47, rl_minus_student.heldout.difference 0.275, "
        "rl_minus_student.heldout.se 0.0354"
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=20,
)


@given(json_values)
def test_finite_always_serialises_as_strict_json_and_keeps_finite_numbers(value: Any) -> None:
    cleaned = finite(value)
    text = json.dumps(cleaned, allow_nan=False)
    if isinstance(value, float) and math.isfinite(value):
        assert json.loads(text) == value


def test_a_mistake_before_stage_one_leaves_no_run_directory_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--pipeline", "cartpole"]) == 2
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
