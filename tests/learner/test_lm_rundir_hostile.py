"""A pipeline run directory is hostile input to `--from-stage`: pipeline.json and every output
it lists may have been edited, the recorded sha256s rewritten to match (`rehash`). Whatever
the files hold, a rerun ends in one PipelineError naming the file (through the CLI: one
`shoal: error:` line, no traceback, no stage line), never a hang or a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import ConfigError
from shoal.learner.errors import PipelineError
from shoal.learner.lm_config import LMPipelineConfig
from shoal.learner.lm_pipeline import MAX_TASK_FILE, plan_rerun, read_tasks, run_lm_pipeline
from shoal.learner.lm_records import check_manifest, digest, parse_json
from shoal.train_pipeline import pipeline_config
from tests.support.lm_jobs import TINY_CODEGEN_JOB

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("job") / "job.toml"
    path.write_text(TINY_CODEGEN_JOB)
    return path


@pytest.fixture(scope="module")
def cfg(job: Path) -> LMPipelineConfig:
    loaded = pipeline_config(str(job), None, environ={})
    assert isinstance(loaded, LMPipelineConfig)
    return loaded


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, cfg: LMPipelineConfig) -> Path:
    run_dir = tmp_path_factory.mktemp("lm") / "run"
    run_lm_pipeline(cfg, run_dir)
    return run_dir


@pytest.fixture
def run(finished: Path, tmp_path: Path) -> Path:
    """A copy of the finished run to corrupt."""
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


def rehash(run_dir: Path) -> None:
    """What a hostile editor does after changing an output: record its new sha256."""
    path = run_dir / "pipeline.json"
    manifest = json.loads(path.read_text())
    for stage in manifest["stages"]:
        for output in stage["outputs"].values():
            output["sha256"] = digest(run_dir / output["path"])
    path.write_text(json.dumps(manifest))


def edit_manifest(run_dir: Path, change: Any) -> None:
    path = run_dir / "pipeline.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def shoal_rerun(job: Path, run_dir: Path, stage: str, **env: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "shoal", "train", "--pipeline", str(job),
            "--run-dir", str(run_dir), "--from-stage", stage]  # fmt: skip
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(argv, capture_output=True, text=True, env=environ, check=False)


def assert_one_error_line(result: subprocess.CompletedProcess, words: str, reused: int = 0) -> None:
    """One error line; no stage line but the `reused` stages' of the rerun itself."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("shoal: error:")
    assert words in lines[0]
    stages = [line for line in result.stdout.splitlines() if line.startswith("stage ")]
    assert len(stages) == reused
    assert all(line.endswith("reused (outputs checked)") for line in stages)


# -- through the CLI -------------------------------------------------------------------------


def test_a_fifo_for_pipeline_json_is_refused_not_waited_on(job: Path, run: Path) -> None:
    (run / "pipeline.json").unlink()
    os.mkfifo(run / "pipeline.json")
    assert_one_error_line(shoal_rerun(job, run, "2"), "is not a regular file")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[1, 2]", "is a JSON list, not an object"),
        ('{"config": {}, "stages": "synthesis"}', "stages"),
        ('{"stages":' + "[" * 100_000, "nests deeper"),
    ],
)
def test_a_corrupt_pipeline_json_is_one_error_line(
    job: Path, run: Path, text: str, words: str
) -> None:
    (run / "pipeline.json").write_text(text)
    assert_one_error_line(shoal_rerun(job, run, "2"), words)


def test_a_bad_stage_prints_no_old_stage_line(job: Path, run: Path) -> None:
    assert_one_error_line(shoal_rerun(job, run, "0"), "'0' is not a stage")


def test_a_nested_task_line_is_one_error_line(job: Path, run: Path) -> None:
    (run / "tasks" / "train.jsonl").write_text("[" * 50_000 + "\n")
    rehash(run)
    assert_one_error_line(shoal_rerun(job, run, "2"), "train.jsonl:1: not a task", reused=1)


def test_garbage_weights_are_one_error_line(job: Path, run: Path) -> None:
    (run / "models" / "student" / "model.safetensors").write_bytes(b"\xff" * 64)
    rehash(run)
    assert_one_error_line(shoal_rerun(job, run, "3"), "the model does not load", reused=2)


def test_the_seed_flag_beats_the_environment_variable(job: Path, run: Path) -> None:
    result = shoal_rerun(job, run, "4", SHOAL_SEED="5")
    assert result.returncode == 0, result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "shoal", "train", "--pipeline", str(job), "--seed", "1",
         "--run-dir", str(run), "--from-stage", "4"],
        capture_output=True, text=True, env={**os.environ, "SHOAL_SEED": "5"}, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads((run / "pipeline.json").read_text())["config"]["seed"] == 1


# -- pipeline.json -----------------------------------------------------------------------------


def _outputs(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["stages"][0]["outputs"]


def _set_output(key: str, value: Any) -> Any:
    return lambda manifest: _outputs(manifest).__setitem__(key, value)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda m: m.__setitem__("stages", {"name": "synthesis"}), "no list of"),
        (lambda m: m["stages"][0].__setitem__("outputs", [1, 2]), "outputs is not an object"),
        (_set_output("train", "tasks/train.jsonl"), "not a {path, sha256} object"),
        (_set_output("train", {"path": "tasks/a\0b", "sha256": "0" * 64}), "not one inside"),
        (_set_output("train", {"path": "../../etc/passwd", "sha256": "0" * 64}), "not one inside"),
        (_set_output("train", {"path": "/etc/passwd", "sha256": "0" * 64}), "not one inside"),
        (_set_output("train", {"path": ".", "sha256": "0" * 64}), "not one inside"),
        (_set_output("train", {"path": "tasks/train.jsonl", "sha256": 5}), "no sha256"),
        (lambda m: m["stages"][0].__setitem__("wall_s", "abc"), "wall_s is not a number"),
        (lambda m: m["stages"][0].__setitem__("name", "\x1b[2J"), "no stage name"),
        (lambda m: m.__setitem__("stages", m["stages"][1:]), "records ['distillation'"),
    ],
)
def test_a_corrupt_record_is_refused_before_anything_runs(
    run: Path, change: Any, words: str
) -> None:
    edit_manifest(run, change)
    with pytest.raises(PipelineError, match=words.replace("[", r"\[").replace("{", r"\{")):
        plan_rerun(run, 2)


def test_a_special_file_or_symlink_among_the_outputs_is_refused(run: Path) -> None:
    student = run / "models" / "student"
    (student / "config.json").unlink()
    (student / "config.json").symlink_to("/dev/zero")
    with pytest.raises(PipelineError, match="is not a regular file or directory"):
        plan_rerun(run, 3)
    (run / "tasks" / "train.jsonl").unlink()
    os.mkfifo(run / "tasks" / "train.jsonl")
    with pytest.raises(PipelineError, match="is not a regular file"):
        plan_rerun(run, 2)


def test_an_output_behind_a_symlinked_directory_is_outside_the_run(run: Path) -> None:
    elsewhere = run.parent / "elsewhere"
    (run / "tasks").rename(elsewhere)
    (run / "tasks").symlink_to(elsewhere)
    with pytest.raises(PipelineError, match="is outside the run"):
        plan_rerun(run, 2)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=24,
)
stage_like = st.fixed_dictionaries(
    {"name": st.sampled_from(["synthesis", "", "a b", 3]), "wall_s": json_values,
     "metrics": json_values, "outputs": st.dictionaries(st.text(max_size=4), json_values)},
    optional={"reused": json_values, "config": json_values},
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {"config": json_values, "stages": st.lists(stage_like, max_size=3) | json_values}
    )
    | json_values
)
def test_any_json_is_a_checked_manifest_or_one_pipeline_error(value: Any) -> None:
    try:
        manifest = check_manifest(value, Path("pipeline.json"))
    except PipelineError:
        return
    for stage in manifest["stages"]:
        assert isinstance(stage["name"], str)
        assert isinstance(stage["metrics"], dict)
        assert all(isinstance(o["path"], str) for o in stage["outputs"].values())


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200) | st.text(alphabet='[]{}"\\:,1a ', max_size=200).map(str.encode))
def test_any_bytes_parse_as_json_or_one_pipeline_error(data: bytes) -> None:
    try:
        parse_json(data, 8, Path("pipeline.json"), "rerun")
    except PipelineError:
        pass


# -- stage outputs -----------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=300) | st.text(alphabet='[]{}"\\:,1a \n', max_size=300).map(str.encode))
def test_any_task_file_is_tasks_or_one_pipeline_error(data: bytes) -> None:
    with tempfile.TemporaryDirectory(prefix="shoal-tasks-") as name:
        path = Path(name) / "train.jsonl"
        path.write_bytes(data)
        try:
            assert read_tasks(path)
        except PipelineError:
            pass


def test_a_task_file_or_line_over_its_bound_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    with open(path, "wb") as handle:
        handle.truncate(MAX_TASK_FILE + 1)
    with pytest.raises(PipelineError, match="is larger than"):
        read_tasks(path)
    path.write_bytes(b"x" * (2 << 20))
    with pytest.raises(PipelineError, match="a task line over"):
        read_tasks(path)
    path.write_bytes(b"")
    with pytest.raises(PipelineError, match="holds no task"):
        read_tasks(path)


def test_an_empty_train_split_stops_the_distillation_rerun(
    run: Path, cfg: LMPipelineConfig
) -> None:
    (run / "tasks" / "train.jsonl").write_bytes(b"")
    rehash(run)
    with pytest.raises(PipelineError, match="holds no task"):
        run_lm_pipeline(cfg, run, from_stage=2)


def _positions(value: Any) -> Any:
    return lambda config: {**config, "max_position_embeddings": value}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda c: {k: v for k, v in c.items() if k != "max_position_embeddings"},
         "max_position_embeddings = None"),
        (_positions("abc"), "max_position_embeddings = 'abc'"),
        (_positions(-3), "max_position_embeddings = -3"),
        (_positions(10**10), "from 1 to 16777216"),
        (lambda c: {**c, "vocab_size": 300}, "not the tokenizer's"),
        (lambda c: [1], "is not a JSON object"),
        (lambda c: "[" * 100_000, "is not a JSON config"),
    ],
)  # fmt: skip
def test_a_corrupt_model_config_is_one_pipeline_error(
    run: Path, cfg: LMPipelineConfig, change: Any, words: str
) -> None:
    path = run / "models" / "student" / "config.json"
    changed = change(json.loads(path.read_text()))
    path.write_text(changed if isinstance(changed, str) else json.dumps(changed))
    rehash(run)
    with pytest.raises(PipelineError, match=words):
        run_lm_pipeline(cfg, run, from_stage="rl")


@pytest.mark.parametrize("name", ["model.safetensors", "value_head.safetensors"])
def test_garbage_weights_are_one_pipeline_error(
    run: Path, cfg: LMPipelineConfig, name: str
) -> None:
    (run / "models" / "student" / name).write_bytes(b"\x08" + bytes(64))
    rehash(run)
    with pytest.raises(PipelineError, match="the model does not load"):
        run_lm_pipeline(cfg, run, from_stage="rl")


def test_a_garbage_validation_record_is_one_pipeline_error(
    run: Path, cfg: LMPipelineConfig
) -> None:
    (run / "rl" / "validation.json").write_text("[" * 10_000)
    rehash(run)
    with pytest.raises(PipelineError, match="validation record refused"):
        run_lm_pipeline(cfg, run, from_stage="evaluation")


def test_a_reused_stage_keeps_the_config_it_ran_with(run: Path, cfg: LMPipelineConfig) -> None:
    from dataclasses import replace

    recorded = json.loads((run / "pipeline.json").read_text())["config"]
    manifest = run_lm_pipeline(replace(cfg, train_tasks=cfg.train_tasks + 1), run, "evaluation")
    assert manifest["config"]["train_tasks"] == cfg.train_tasks + 1
    for stage in manifest["stages"][:3]:
        assert stage["reused"]
        assert stage["config"] == recorded


# -- the job file and flags ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ("[rl]\nsteps = 5\n", "did you mean [pipeline.rl]"),
        ("[sft]\nepochs = 1\n", "did you mean [pipeline.sft]"),
        ("[pipelin.eval]\ntasks = 1\n", "did you mean [pipeline.eval]"),
    ],
)
def test_a_table_outside_pipeline_is_refused(tmp_path: Path, extra: str, words: str) -> None:
    job = tmp_path / "job.toml"
    job.write_text(TINY_CODEGEN_JOB + extra)
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        pipeline_config(str(job), None, environ={})


def test_the_seed_flag_is_named_and_beats_the_environment(job: Path) -> None:
    assert pipeline_config(str(job), 1, environ={"SHOAL_SEED": "5"}).seed == 1
    assert pipeline_config(str(job), None, environ={"SHOAL_SEED": "5"}).seed == 5
    with pytest.raises(ConfigError, match=r"^--seed=-1 is invalid"):
        pipeline_config(str(job), -1, environ={})


def test_an_env_id_from_the_environment_is_named_and_truncated(job: Path) -> None:
    with pytest.raises(ConfigError, match=r"not a text environment.*SHOAL_ENV_ID"):
        pipeline_config(str(job), None, environ={"SHOAL_ENV_ID": "GridWorld-v1"})
    with pytest.raises(ConfigError, match="SHOAL_ENV_ID") as refused:
        pipeline_config(str(job), None, environ={"SHOAL_ENV_ID": "Code" + "A" * 200_000})
    assert len(str(refused.value)) < 400
    with pytest.raises(ConfigError) as refused:
        pipeline_config("A" * 200_000, None, environ={})
    assert len(str(refused.value)) < 400


# -- sizes and keys the pipeline cannot use ------------------------------------------------------


def test_sizes_that_cannot_fit_are_refused_before_any_weight(tmp_path: Path, run: Path) -> None:
    huge = TINY_CODEGEN_JOB.replace(
        "[pipeline.teacher]\nhidden_size = 32\nnum_layers = 1",
        "[pipeline.teacher]\nhidden_size = 65536\nnum_layers = 64",
    ).replace("intermediate_size = 64", "intermediate_size = 1048576", 1)
    assert huge != TINY_CODEGEN_JOB
    job = tmp_path / "huge.toml"
    job.write_text(huge)
    assert_one_error_line(shoal_rerun(job, run, "2"), "need at least", reused=1)


@pytest.mark.parametrize("key", ["vocab_size = 5", "hidden = [8]", "channels = [4]"])
def test_a_model_key_the_pipeline_never_reads_is_refused(tmp_path: Path, key: str) -> None:
    job = tmp_path / "job.toml"
    job.write_text(TINY_CODEGEN_JOB.replace("[pipeline.student]\n", f"[pipeline.student]\n{key}\n"))
    name = key.split(" ")[0]
    with pytest.raises(ConfigError, match=rf"pipeline\.student\.{name} is not used"):
        pipeline_config(str(job), None, environ={})


def test_the_memory_check_takes_a_model_from_a_directory(
    tmp_path: Path, cfg: LMPipelineConfig
) -> None:
    """`check_memory` sizes a `path` model from its config on the meta device (transformers
    refuses `from_pretrained` under a meta context), so fine-tuning a directory still starts."""
    from dataclasses import replace

    from shoal.envs.tokenizer import load_tokenizer
    from shoal.learner.lm_pipeline import Placement, check_memory, new_policy
    from shoal.learner.models import export_pretrained

    tokenizer = load_tokenizer("bytes")
    export_pretrained(new_policy(cfg.teacher, tokenizer), tmp_path / "teacher")
    from_dir = replace(cfg, teacher=replace(cfg.teacher, path=str(tmp_path / "teacher")))
    check_memory(from_dir, tokenizer, Placement.of(cfg))
