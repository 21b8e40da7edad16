"""The language-model pipeline end to end on CodeGen-v1 with tiny models: four stages, their
hashed outputs, the report, a rerun from a stage, and `shoal train --pipeline` on a text env."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from shoal.cli import main
from shoal.errors import ConfigError
from shoal.learner.distill import FitConfig
from shoal.learner.errors import PipelineError
from shoal.learner.lm_config import STAGES, EvalStageConfig, LMPipelineConfig, RLStageConfig
from shoal.learner.lm_pipeline import EVAL_SPLITS, digest, read_tasks, run_lm_pipeline
from shoal.learner.models import ModelConfig
from shoal.learner.token_ppo import TokenRLConfig
from tests.support.lm_jobs import TINY_CODEGEN_JOB

pytestmark = pytest.mark.timeout(300)

TINY_LM = ModelConfig(family="causal-lm", hidden_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, intermediate_size=64, max_positions=256)  # fmt: skip


def tiny(**overrides: object) -> LMPipelineConfig:
    values: dict[str, object] = {
        "train_tasks": 32,
        "torch_threads": 1,
        "fit_threads": 1,
        "teacher": TINY_LM,
        "student": TINY_LM,
        "sft": FitConfig(epochs=1, batch_size=16),
        "distill": FitConfig(epochs=1, batch_size=16),
        "rl": RLStageConfig(
            steps=3,
            prompts_per_step=2,
            max_new_tokens=12,
            val_tasks=16,
            token=TokenRLConfig(group_size=2),
        ),
        "eval": EvalStageConfig(tasks=3, samples=2, ks=(1, 2), max_new_tokens=12),
    }
    return LMPipelineConfig(**{**values, **overrides})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("lm") / "run"
    return run_dir, run_lm_pipeline(tiny(), run_dir)


def check_hashes(run_dir: Path, manifest: dict) -> None:
    for stage in manifest["stages"]:
        for output in stage["outputs"].values():
            assert digest(run_dir / output["path"]) == output["sha256"]


def test_every_stage_records_its_hashed_outputs(finished):
    run_dir, manifest = finished
    assert json.loads((run_dir / "pipeline.json").read_text()) == json.loads(json.dumps(manifest))
    stages = {s["name"]: s for s in manifest["stages"]}
    assert list(stages) == list(STAGES)
    check_hashes(run_dir, manifest)
    file_hash = hashlib.sha256((run_dir / "tasks" / "train.jsonl").read_bytes()).hexdigest()
    assert stages["synthesis"]["outputs"]["train"]["sha256"] == file_hash
    assert set(stages["synthesis"]["outputs"]) == {"train", "validation", *EVAL_SPLITS}
    assert len(read_tasks(run_dir / "tasks" / "train.jsonl")) == 32
    heldout = read_tasks(run_dir / "tasks" / "heldout_families.jsonl")
    train_families = {t.family for t in read_tasks(run_dir / "tasks" / "train.jsonl")}
    assert not {t.family for t in heldout} & train_families
    assert stages["synthesis"]["env_hash"] == stages["rl"]["env_hash"]
    assert set(stages["distillation"]["outputs"]) == {"teacher", "student"}
    assert (run_dir / "models" / "student" / "config.json").is_file()
    # where stages 2-4 computed: the first GPU where there is one, else the CPU
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert manifest["device"] == device
    assert (
        stages["distillation"]["metrics"]["device"] == stages["rl"]["metrics"]["device"] == device
    )


def test_rl_runs_asynchronously_within_the_staleness_bound(finished):
    _, manifest = finished
    rl = {s["name"]: s for s in manifest["stages"]}["rl"]["metrics"]
    assert rl["updates"] == 3
    assert rl["samples"] == 3 * 2 * 2
    assert 0 <= rl["max_staleness_seen"] <= 1
    assert sum(rl["statuses"].values()) == 12


def test_the_report_has_every_policy_split_and_failure_kind(finished):
    run_dir, manifest = finished
    evaluation = {s["name"]: s for s in manifest["stages"]}["evaluation"]
    report = json.loads((run_dir / evaluation["outputs"]["report_json"]["path"]).read_text())
    assert set(report["policies"]) == {"teacher", "student", "rl"}
    for by_split in report["policies"].values():
        assert set(by_split) == set(EVAL_SPLITS)
        for result in by_split.values():
            assert set(result["pass_at"]) == {"1", "2"}
            assert sum(result["outcomes"].values()) == 3 * 2
    html = (run_dir / evaluation["outputs"]["report_html"]["path"]).read_text()
    assert "Failure breakdown" in html
    pairs = {(c["policy"], c["baseline"], c["split"]): c for c in report["comparisons"]}
    assert set(pairs) == {(p, b, s) for p, b in (("rl", "student"), ("student", "teacher"))
                          for s in EVAL_SPLITS}  # fmt: skip
    rl, student = report["policies"]["rl"]["heldout"], report["policies"]["student"]["heldout"]
    difference = pairs["rl", "student", "heldout"]["difference"]
    assert difference == pytest.approx(rl["pass_at"]["1"] - student["pass_at"]["1"])
    shown = evaluation["metrics"]["rl_minus_student"]["heldout"]
    assert shown["difference"] == pytest.approx(difference)
    assert pairs["rl", "student", "heldout"]["families"] == len(set(rl["families"]))
    assert shown.keys() == {"difference", "se", "se_by_family"}


def test_the_validation_curve_is_in_pipeline_json_and_the_report(finished):
    run_dir, manifest = finished
    stages = {s["name"]: s for s in manifest["stages"]}
    rl = stages["rl"]
    curve = rl["metrics"]["validation_curve"]
    assert [step for step, _ in curve] == [0, 3]
    assert rl["metrics"]["validation_student"] == curve[0][1]
    assert rl["metrics"]["kept_student"] == (rl["metrics"]["selected_step"] == 0)
    record = json.loads((run_dir / rl["outputs"]["validation"]["path"]).read_text())
    report_path = run_dir / stages["evaluation"]["outputs"]["report_json"]["path"]
    assert json.loads(report_path.read_text())["validation"] == record
    assert record["validation_curve"] == curve
    assert "RL validation" in (report_path.parent / "report.html").read_text()
    assert len(read_tasks(run_dir / "tasks" / "validation.jsonl")) == 16
    assert rl["metrics"]["prompt_split"] == "rl"


def test_the_kept_checkpoint_is_the_student_when_rl_never_beats_it(finished):
    """A 32-dimensional model scores 0 on validation, so no update beats the student (a tie
    keeps the student) and the exported RL model is the student's weights."""
    from shoal.envs.text_registry import make_text_env
    from shoal.learner.lm_pipeline import load_policy

    run_dir, manifest = finished
    rl = {s["name"]: s for s in manifest["stages"]}["rl"]["metrics"]
    assert {score for _, score in rl["validation_curve"]} == {0.0}
    assert rl["kept_student"]
    assert rl["selected_step"] == 0
    env = make_text_env("CodeGen-v1")
    env.close()  # only its tokenizer is needed
    tokenizer = env.tokenizer
    kept = load_policy(run_dir / "models" / "rl", tokenizer).get_weights()
    student = load_policy(run_dir / "models" / "student", tokenizer).get_weights()
    assert all(np.array_equal(kept[k], student[k]) for k in student)


def test_a_rerun_from_rl_reuses_the_checked_earlier_outputs(finished, tmp_path):
    """The rerun is also synchronous (max_staleness 0): every batch is the learner's version."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished[0], run_dir)
    before = json.loads((run_dir / "pipeline.json").read_text())
    rl = RLStageConfig(steps=2, prompts_per_step=2, max_new_tokens=12, max_staleness=0,
                       token=TokenRLConfig(group_size=2))  # fmt: skip
    manifest = run_lm_pipeline(tiny(rl=rl), run_dir, from_stage="rl")
    stages = manifest["stages"]
    assert [s["name"] for s in stages] == list(STAGES)
    assert [s.get("reused", False) for s in stages] == [True, True, False, False]
    kept = [dict(s, reused=True, config=before["config"]) for s in before["stages"][:2]]
    assert stages[:2] == kept
    assert stages[2]["metrics"]["updates"] == 2
    assert stages[2]["metrics"]["max_staleness_seen"] == 0
    check_hashes(run_dir, manifest)


def test_a_changed_earlier_output_stops_the_rerun(finished, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished[0], run_dir)
    with open(run_dir / "tasks" / "train.jsonl", "a") as handle:
        handle.write("\n")
    with pytest.raises(PipelineError, match="changed since it was recorded"):
        run_lm_pipeline(tiny(), run_dir, from_stage=2)
    with pytest.raises(PipelineError, match="is not a stage"):
        run_lm_pipeline(tiny(), run_dir, from_stage="ppo")
    with pytest.raises(PipelineError, match=r"pipeline\.json does not exist"):
        run_lm_pipeline(tiny(), tmp_path / "nowhere", from_stage="evaluation")


def test_a_learnt_bpe_is_a_recorded_output_every_later_stage_uses(tmp_path):
    run_dir = tmp_path / "run"
    manifest = run_lm_pipeline(tiny(tokenizer="bpe", bpe_vocab=300), run_dir)
    stages = {s["name"]: s for s in manifest["stages"]}
    check_hashes(run_dir, manifest)
    learnt = stages["synthesis"]["metrics"]["tokenizer"]
    assert stages["synthesis"]["outputs"]["tokenizer"]["path"] == "tokenizer"
    assert 259 < learnt["vocab_size"] <= 300
    assert learnt["mean_prompt_tokens"] < 60  # the byte tokenizer's prompts average about 73
    assert stages["distillation"]["metrics"]["tokenizer"] == learnt["fingerprint"]
    config = json.loads((run_dir / "models" / "rl" / "config.json").read_text())
    assert config["vocab_size"] == learnt["vocab_size"]
    assert stages["synthesis"]["env_hash"] == stages["rl"]["env_hash"]
    assert stages["rl"]["env_hash"] != finished_hash_with_bytes()
    (run_dir / "tokenizer" / "tokenizer.json").write_text("{}")
    with pytest.raises(PipelineError, match=r"tokenizer.*changed since it was recorded"):
        run_lm_pipeline(tiny(tokenizer="bpe", bpe_vocab=300), run_dir, from_stage="evaluation")


def finished_hash_with_bytes() -> str:
    from shoal.envs.text_registry import make_text_env, text_env_hash

    cfg = tiny()
    longest = max(cfg.rl.max_new_tokens, cfg.eval.max_new_tokens)
    env = make_text_env(cfg.env_id, tokenizer="bytes", max_new_tokens=longest)
    try:
        return text_env_hash(env)
    finally:
        env.close()


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [(None, "train_tasks", 0), (None, "env_id", ""), ("rl", "max_staleness", -1),
     ("eval", "ks", (1, 9)), ("teacher", "family", "mlp"), (None, "bpe_vocab", 100)],
)  # fmt: skip
def test_bad_config_names_the_key(section, key, value):
    from dataclasses import replace

    def build() -> object:
        if section is None:
            return LMPipelineConfig(**{key: value})
        if section == "rl":
            return RLStageConfig(**{key: value})
        if section == "eval":
            return EvalStageConfig(**{key: value})
        return LMPipelineConfig(teacher=replace(TINY_LM, **{key: value}))

    with pytest.raises(ConfigError, match=key):
        build()


def test_shoal_train_pipeline_runs_a_text_env_and_reruns_a_stage(tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text(TINY_CODEGEN_JOB)
    run_dir = tmp_path / "run"
    assert main(["train", "--pipeline", str(job), "--run-dir", str(run_dir), "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines if line.startswith("stage ")] == list(STAGES)
    summary = json.loads(lines[-1])
    assert Path(summary["report_html"]).is_file()
    assert main(["train", "--pipeline", str(job), "--run-dir", str(run_dir),
                 "--from-stage", "evaluation"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert sum("reused" in line for line in lines if line.startswith("stage ")) == 3
    assert main(["train", "--pipeline", str(job), "--from-stage", "rl"]) == 2
    assert "give that run's --run-dir" in capsys.readouterr().err
