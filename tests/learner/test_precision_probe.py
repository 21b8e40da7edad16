"""The bf16 probe: which precision one measured step favours (hypothesis, on a clock the steps
advance), and that probing a real causal LM leaves it exactly as it was."""

from __future__ import annotations

import statistics

import torch
from hypothesis import given
from hypothesis import strategies as st

from shoal.envs.tokenizer import ByteTokenizer
from shoal.learner.distill import pack
from shoal.learner.lm_pipeline import new_policy
from shoal.learner.models import ModelConfig
from shoal.learner.precision_probe import ProbeResult, faster_precision, sft_step

TINY_LM = ModelConfig(family="causal-lm", hidden_size=32, num_layers=2, num_heads=2,
                      num_kv_heads=1, intermediate_size=64, max_positions=64)  # fmt: skip
durations = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


@given(
    warm=st.tuples(durations, durations),
    timed=st.lists(st.tuples(durations, durations), min_size=1, max_size=7),
)
def test_the_probe_takes_the_median_of_the_timed_steps_and_bf16_only_when_faster(warm, timed):
    now = [0.0]
    planned = {True: [warm[0], *(b for b, _ in timed)], False: [warm[1], *(f for _, f in timed)]}
    calls: list[bool] = []

    def step(bf16: bool) -> None:
        calls.append(bf16)
        now[0] += planned[bf16].pop(0)

    probe = faster_precision(step, rounds=len(timed), clock=lambda: now[0])
    assert calls == [True, False] * (len(timed) + 1)
    bf16_s = statistics.median(b for b, _ in timed)
    fp32_s = statistics.median(f for _, f in timed)
    assert abs(probe.bf16_s - bf16_s) < 1e-6
    assert abs(probe.fp32_s - fp32_s) < 1e-6
    if abs(bf16_s - fp32_s) > 1e-6:
        assert probe.bf16 == (bf16_s < fp32_s)
    assert probe.record()["bf16"] == probe.bf16


def test_a_tie_keeps_float32():
    assert not ProbeResult(0.25, 0.25).bf16


def test_probing_a_causal_lm_leaves_its_weights_and_gradients_as_they_were():
    torch.manual_seed(0)
    tokenizer = ByteTokenizer()
    lm = new_policy(TINY_LM, tokenizer).lm
    before = {name: p.detach().clone() for name, p in lm.named_parameters()}
    batch = pack([[tokenizer.bos_id, 40 + i] for i in range(4)],
                 [[50 + i, tokenizer.eos_id] for i in range(4)], tokenizer.pad_id)  # fmt: skip
    seen: list[torch.dtype] = []
    lm.get_decoder().layers[0].mlp.down_proj.register_forward_hook(
        lambda _m, _i, out: seen.append(out.dtype)
    )
    probe = faster_precision(sft_step(lm, batch), rounds=2)
    assert min(probe.bf16_s, probe.fp32_s) > 0
    assert seen == [torch.bfloat16, torch.float32] * 3
    assert all(p.grad is None for p in lm.parameters())
    assert all(torch.equal(p, before[name]) for name, p in lm.named_parameters())
