"""SFT cross-entropy and logit distillation over completion tokens, on real tiny Qwen2 models."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import ConfigError
from shoal.learner import distill
from shoal.learner.distill import (
    DistillError,
    FitConfig,
    TeacherTargets,
    distill_kl,
    fit,
    lm_logits,
    pack,
    sft_loss,
)

VOCAB = 40
PAD = 39


def tiny_lm(seed: int, hidden: int = 32) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                         max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


rows = st.lists(st.integers(0, PAD - 1), min_size=1, max_size=6)
examples = st.lists(st.tuples(rows, rows), min_size=1, max_size=5)


@given(examples)
@settings(max_examples=60, deadline=None)
def test_the_target_mask_covers_exactly_the_completion_tokens(pairs):
    batch = pack([p for p, _ in pairs], [c for _, c in pairs], PAD)
    mask = batch.target_mask()
    assert int(mask.sum()) == sum(len(c) for _, c in pairs)
    for i, (prompt, completion) in enumerate(pairs):
        targets = batch.tokens[i, 1:][mask[i]].tolist()
        assert targets == completion
        assert int(batch.attention_mask()[i].sum()) == len(prompt) + len(completion)


@given(examples, st.floats(0.25, 4.0))
@settings(max_examples=40, deadline=None)
def test_kl_is_zero_against_itself_and_positive_otherwise(pairs, temperature):
    batch = pack([p for p, _ in pairs], [c for _, c in pairs], PAD)
    shape = (batch.tokens.shape[0], batch.tokens.shape[1] - 1, VOCAB)
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(len(pairs)))
    assert float(distill_kl(logits, logits + 3.0, batch, temperature)) == pytest.approx(0, abs=1e-5)
    other = logits.flip(-1)
    assert float(distill_kl(other, logits, batch, temperature)) > 0


def test_prompt_positions_carry_no_loss():
    batch = pack([[1, 2, 3]], [[4, 5]], PAD)
    logits = torch.zeros(1, batch.tokens.shape[1] - 1, VOCAB, requires_grad=True)
    sft_loss(logits, batch).backward()
    touched = logits.grad.abs().sum(-1)[0]
    assert touched.nonzero().flatten().tolist() == [2, 3]  # the logits predicting 4 and 5


def test_kl_matches_the_closed_form_on_one_position():
    batch = pack([[1]], [[2]], PAD)
    teacher = torch.log(torch.tensor([[[0.5, 0.5] + [1e-12] * (VOCAB - 2)]]))
    student = torch.log(torch.tensor([[[0.25, 0.75] + [1e-12] * (VOCAB - 2)]]))
    expected = 0.5 * torch.log(torch.tensor(0.5 / 0.25)) + 0.5 * torch.log(torch.tensor(0.5 / 0.75))
    assert float(distill_kl(student, teacher, batch)) == pytest.approx(float(expected), rel=1e-4)


def test_distillation_brings_the_student_to_the_teacher():
    prompts = [[1, 2 + i % 5] for i in range(24)]
    completions = [[10 + (i % 5), 20 + (i % 3), 30] for i in range(24)]
    teacher, student = tiny_lm(0, hidden=48), tiny_lm(1)
    sft = fit(teacher, prompts, completions, PAD, FitConfig(epochs=30, lr=1e-2, batch_size=8))
    assert sft["ce"] < 0.8  # the deterministic parts are learnt; 20 + i%3 is 3-way ambiguous
    batch = pack(prompts, completions, PAD)
    with torch.no_grad():
        before = float(distill_kl(lm_logits(student, batch), lm_logits(teacher, batch), batch))
    fitted = fit(student, prompts, completions, PAD, FitConfig(epochs=30, lr=1e-2, batch_size=8),
                 teacher=teacher)  # fmt: skip
    with torch.no_grad():
        after = float(distill_kl(lm_logits(student, batch), lm_logits(teacher, batch), batch))
    assert after < 0.2 * before
    assert fitted["kl"] == pytest.approx(after, rel=0.5, abs=0.05)
    assert fitted["steps"] == 30 * 3


def test_mismatched_vocabularies_are_named():
    batch = pack([[1]], [[2, 3]], PAD)
    with pytest.raises(DistillError, match="same tokenizer"):
        distill_kl(torch.zeros(1, 2, VOCAB), torch.zeros(1, 2, VOCAB + 1), batch)


def test_empty_or_uneven_examples_are_refused():
    with pytest.raises(DistillError, match="as many prompts"):
        pack([[1]], [], PAD)
    with pytest.raises(DistillError, match="at least one token"):
        pack([[]], [[1]], PAD)


@pytest.mark.parametrize(
    ("key", "value"), [("epochs", 0), ("lr", 0.0), ("batch_size", 1.5), ("temperature", -1.0)]
)
def test_bad_fit_config_names_the_key(key, value):
    with pytest.raises(ConfigError, match=f"fit.{key}"):
        FitConfig(**{key: value})


@given(examples, st.integers(1, 4), st.randoms(use_true_random=False))
@settings(max_examples=40, deadline=None)
def test_cached_teacher_rows_are_the_rows_a_batch_of_any_examples_masks(pairs, size, rnd):
    teacher = tiny_lm(3)
    prompts, completions = [p for p, _ in pairs], [c for _, c in pairs]
    targets = TeacherTargets.cached(
        teacher, prompts, completions, PAD, size, contextlib.nullcontext
    )
    assert targets is not None
    chunk = rnd.sample(range(len(pairs)), rnd.randint(1, len(pairs)))
    batch = pack([prompts[i] for i in chunk], [completions[i] for i in chunk], PAD)
    with torch.no_grad():
        expected = lm_logits(teacher, batch)[batch.target_mask()]
    torch.testing.assert_close(targets.take(chunk), expected, rtol=1e-4, atol=1e-5)


def test_distilling_from_cached_rows_trains_the_student_as_the_teacher_each_step_does(
    monkeypatch,
):
    prompts = [[1, 2 + i % 5, 3] for i in range(12)]
    completions = [[10 + (i % 5), 20 + (i % 3)] + [30] * (i % 4) for i in range(12)]
    teacher, cfg = tiny_lm(0, hidden=48), FitConfig(epochs=3, lr=1e-2, batch_size=5)
    runs = []
    for cache_bytes in (distill.TEACHER_CACHE_BYTES, 0):
        monkeypatch.setattr(distill, "TEACHER_CACHE_BYTES", cache_bytes)
        student = tiny_lm(1)
        metrics = fit(student, prompts, completions, PAD, cfg, teacher=teacher)
        runs.append((metrics, [p.detach().clone() for p in student.parameters()]))
    (cached, cached_weights), (stepwise, stepwise_weights) = runs
    assert cached["kl"] == pytest.approx(stepwise["kl"], rel=1e-4)
    for a, b in zip(cached_weights, stepwise_weights):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_teacher_rows_over_the_bound_are_not_cached(monkeypatch):
    monkeypatch.setattr(distill, "TEACHER_CACHE_BYTES", 4 * VOCAB * 3 - 1)
    assert (
        TeacherTargets.cached(tiny_lm(0), [[1]], [[2, 3, 4]], PAD, 8, contextlib.nullcontext)
        is None
    )
    monkeypatch.setattr(distill, "TEACHER_CACHE_BYTES", 4 * VOCAB * 3)
    assert TeacherTargets.cached(tiny_lm(0), [[1]], [[2, 3, 4]], PAD, 8, contextlib.nullcontext)
