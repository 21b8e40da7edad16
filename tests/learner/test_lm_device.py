"""Where the language-model pipeline computes: `pipeline.device` parsed and resolved before
stage 1, a GPU that is not there refused with one line, and the forward contexts (bf16 autocast
on a GPU for every training forward pass of SFT, distillation and the RL update; on a CPU with
bf16 instructions for a model's SFT or distillation where its step measured faster so)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.cli import main
from shoal.envs.tokenizer import ByteTokenizer
from shoal.errors import ConfigError
from shoal.learner import lm_pipeline
from shoal.learner.cpu_features import native_bf16
from shoal.learner.distill import FitConfig, TokenBatch, fit, pack
from shoal.learner.errors import PipelineError
from shoal.learner.lm_config import DEVICE_SPEC, LMPipelineConfig, RLStageConfig
from shoal.learner.lm_pipeline import Placement, new_policy, pick_device
from shoal.learner.lm_rl import train_rl
from shoal.learner.models import ModelConfig
from shoal.learner.precision_probe import ProbeResult
from shoal.learner.token_ppo import TokenRLConfig
from tests.support.lm_jobs import TINY_CODEGEN_JOB

TINY_LM = ModelConfig(family="causal-lm", hidden_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, intermediate_size=64, max_positions=256)  # fmt: skip
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine with no GPU")


@pytest.mark.parametrize(
    ("spec", "gpus", "device"),
    [
        ("auto", 0, "cpu"),
        ("auto", 2, "cuda:0"),
        ("cpu", 4, "cpu"),
        ("cuda", 1, "cuda:0"),
        ("cuda:3", 4, "cuda:3"),
    ],
)
def test_a_device_spec_resolves_to_the_device_it_names(spec, gpus, device):
    assert pick_device(spec, gpus) == device


@pytest.mark.parametrize(
    ("spec", "gpus", "said"),
    [
        ("cuda", 0, "no CUDA device"),
        ("cuda:1", 1, "only 1 CUDA device"),
        ("cuda:8", 8, "only 8 CUDA device"),
    ],
)
def test_a_gpu_that_is_not_there_is_named(spec, gpus, said):
    with pytest.raises(PipelineError, match=said) as refused:
        pick_device(spec, gpus)
    assert repr(spec) in str(refused.value)
    assert '"cpu"' in str(refused.value)


specs = st.one_of(
    st.sampled_from(["auto", "cpu", "cuda"]),
    st.integers(0, 999).map(lambda i: f"cuda:{i}"),
    st.text(max_size=12),
)


@given(spec=specs, gpus=st.integers(0, 16))
@settings(max_examples=200, deadline=None)
def test_any_text_is_refused_by_the_config_or_resolved_to_a_device_present(spec, gpus):
    if not DEVICE_SPEC.fullmatch(spec):
        with pytest.raises(ConfigError, match=r"pipeline\.device"):
            LMPipelineConfig(device=spec)
        return
    assert LMPipelineConfig(device=spec).device == spec
    try:
        device = torch.device(pick_device(spec, gpus))
    except PipelineError:
        assert spec.startswith("cuda")
        return
    assert device.type == "cpu" or (device.index is not None and device.index < gpus)


def _probe_batch(tokenizer) -> TokenBatch:
    return pack([[tokenizer.bos_id, 40 + i] for i in range(4)],
                [[50 + i, tokenizer.eos_id] for i in range(4)], tokenizer.pad_id)  # fmt: skip


@no_gpu
def test_on_a_machine_without_a_gpu_auto_computes_on_the_cpu_rl_in_float32():
    place = Placement.of(LMPipelineConfig())
    assert place == Placement(torch.device("cpu"), bf16=False, probe_fit=native_bf16())
    with place.forward():
        assert not torch.is_autocast_enabled("cpu")


@no_gpu
@pytest.mark.parametrize("native", [True, False])
def test_stage_two_measures_bf16_on_a_cpu_only_with_bf16_instructions_and_mixed_precision(
    monkeypatch, native
):
    monkeypatch.setattr(lm_pipeline, "native_bf16", lambda: native)
    assert Placement.of(LMPipelineConfig()).probe_fit is native
    off = Placement.of(LMPipelineConfig(mixed_precision=False))
    assert not off.probe_fit
    tokenizer = ByteTokenizer()
    context, probe = off.fit_context(new_policy(TINY_LM, tokenizer).lm, _probe_batch(tokenizer))
    assert probe is None
    with context():
        assert not torch.is_autocast_enabled("cpu")


@no_gpu
@pytest.mark.parametrize(("bf16_s", "fp32_s"), [(0.1, 0.2), (0.2, 0.1), (0.1, 0.1)])
def test_stage_two_autocasts_a_model_only_where_its_step_measured_faster(
    monkeypatch, bf16_s, fp32_s
):
    monkeypatch.setattr(lm_pipeline, "native_bf16", lambda: True)
    timed: list[bool] = []

    def measured(step, rounds=3):  # runs the real step both ways; the times are given
        step(True)
        step(False)
        timed.append(True)
        return ProbeResult(bf16_s, fp32_s)

    monkeypatch.setattr(lm_pipeline, "faster_precision", measured)
    tokenizer = ByteTokenizer()
    context, probe = Placement.of(LMPipelineConfig()).fit_context(
        new_policy(TINY_LM, tokenizer).lm, _probe_batch(tokenizer)
    )
    assert timed == [True]
    assert probe == ProbeResult(bf16_s, fp32_s)
    with context():
        assert torch.is_autocast_enabled("cpu") == (bf16_s < fp32_s)


@no_gpu
def test_asking_for_a_gpu_here_is_one_line_before_any_run_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    job = tmp_path / "job.toml"
    job.write_text(
        TINY_CODEGEN_JOB.replace("train_tasks = 16", 'train_tasks = 16\ndevice = "cuda"')
    )
    assert main(["train", "--pipeline", str(job)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "pipeline.device = 'cuda'" in err[0]
    assert "no CUDA device" in err[0]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_device_given_in_the_environment_is_checked_like_the_file(tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text(TINY_CODEGEN_JOB)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SHOAL_DEVICE", "tpu")
        assert main(["train", "--pipeline", str(job), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "pipeline.device = 'tpu' is invalid" in err
    assert err.rstrip().endswith("(set from the environment here: SHOAL_DEVICE)")


class Entered:
    """A forward context that counts its entries and turns bf16 autocast on, so a test sees
    both that the passes ran inside it and that they computed in what it set."""

    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.count += 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield


def _linear_output_dtypes(lm: torch.nn.Module) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    layer = lm.get_decoder().layers[0].mlp.down_proj
    layer.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen


def test_sft_and_distillation_run_every_forward_pass_inside_the_forward_context():
    tokenizer = ByteTokenizer()
    teacher = new_policy(TINY_LM, tokenizer).lm
    student = new_policy(TINY_LM, tokenizer).lm
    prompts = [[tokenizer.bos_id, 40 + i % 7] for i in range(8)]
    completions = [[50 + i % 7, tokenizer.eos_id] for i in range(8)]
    cfg = FitConfig(epochs=2, batch_size=4)
    entered, teacher_seen = Entered(), _linear_output_dtypes(teacher)
    sft = fit(teacher, prompts, completions, tokenizer.pad_id, cfg, forward=entered)
    assert entered.count == 4
    assert teacher_seen == [torch.bfloat16] * 4
    assert sft["steps"] == 4
    assert torch.isfinite(torch.tensor(sft["loss"]))
    entered, student_seen = Entered(), _linear_output_dtypes(student)
    fit(student, prompts, completions, tokenizer.pad_id, cfg, teacher=teacher, forward=entered)
    # 4 steps, and the teacher's logits computed once, in 2 batches of the 8 examples, inside it
    assert entered.count == 4 + 2
    assert student_seen == [torch.bfloat16] * 4
    assert teacher_seen == [torch.bfloat16] * (4 + 2)
    assert all(p.dtype == torch.float32 for p in student.parameters())


def test_the_rl_update_runs_inside_the_forward_context():
    from shoal.envs.codegen import CodeGenEnv

    env = CodeGenEnv(max_new_tokens=8)
    try:
        policy = new_policy(TINY_LM, env.tokenizer)
        token = TokenRLConfig(group_size=2, update_epochs=2, num_minibatches=2)
        cfg = RLStageConfig(steps=2, prompts_per_step=2, max_new_tokens=8, token=token)
        entered = Entered()
        metrics = train_rl(policy, env, "test", cfg, seed=0, forward=entered)
    finally:
        env.close()
    assert metrics["updates"] == 2
    # every update: 2 epochs of 2 minibatches, each at least one forward pass inside it
    assert entered.count >= 2 * 2 * 2
    assert all(p.dtype == torch.float32 for p in policy.parameters())
