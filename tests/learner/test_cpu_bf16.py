"""bf16 on CPU learners: /proc/cpuinfo's flags decide whether the CPU has bf16 instructions,
and `learner.mixed_precision` autocasts a CPU learner only for a family whose step it speeds
up (the CNN) on such a CPU. A PPO update under CPU autocast keeps float32 master weights and
moves them; an MLP, an emulating CPU or `mixed_precision = false` stay float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium import spaces
from hypothesis import given
from hypothesis import strategies as st

from shoal.learner import parallel as parallel_module
from shoal.learner.cpu_features import flags_of, native_bf16
from shoal.learner.fragment import Fragment
from shoal.learner.models import ModelConfig, build_model
from shoal.learner.models.base import PolicyModel
from shoal.learner.parallel import ShardingOptions, parallelize, plan_parallelism
from shoal.learner.ppo import PPOConfig, PPOLearner

_X86 = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme sse2 avx2 avx512f avx512_bf16 amx_tile
bugs\t\t: spectre_v1

processor\t: 1
flags\t\t: fpu
"""
_ARM = "processor\t: 0\nFeatures\t: fp asimd bf16 sve\nCPU implementer\t: 0x41\n"


def test_the_first_processors_flags_are_read() -> None:
    assert {"avx512_bf16", "amx_tile", "avx2"} <= flags_of(_X86)
    assert "avx512_bf16" in flags_of(_X86)  # processor 1's shorter line is not the one read
    assert flags_of(_ARM) == {"fp", "asimd", "bf16", "sve"}
    assert flags_of("") == frozenset()
    assert isinstance(native_bf16(), bool)


@given(st.text(max_size=2000))
def test_any_cpuinfo_text_gives_a_set_of_flags(text: str) -> None:
    flags = flags_of(text)
    assert isinstance(flags, frozenset)
    assert all(isinstance(flag, str) and flag for flag in flags)


def _cnn() -> PolicyModel:
    return build_model(
        ModelConfig(family="cnn"), spaces.Box(0, 255, (36, 36, 1), np.uint8), spaces.Discrete(3)
    )


def _mlp() -> PolicyModel:
    return build_model(ModelConfig(), spaces.Box(-1, 1, (4,), np.float32), spaces.Discrete(3))


@pytest.mark.parametrize(
    ("model", "native", "mixed", "expected"),
    [
        (_cnn, True, True, "cpu"),
        (_cnn, False, True, None),
        (_cnn, True, False, None),
        (_mlp, True, True, None),
    ],
)
def test_cpu_autocast_only_where_it_pays(
    monkeypatch: pytest.MonkeyPatch, model, native: bool, mixed: bool, expected: str | None
) -> None:
    monkeypatch.setattr(parallel_module, "native_bf16", lambda: native)
    policy = model()
    plan = plan_parallelism("auto", ["host"], 1, 1 << 30)
    wrapped = parallelize(policy, plan, torch.device("cpu"), ShardingOptions(mixed_precision=mixed))
    assert wrapped.autocast == expected
    with wrapped.forward_context():
        assert torch.is_autocast_enabled("cpu") == (expected == "cpu")


def _fragment(rng: np.random.Generator) -> Fragment:
    t, n = 8, 4
    return Fragment(
        actor_id="a", seq=0, policy_version=0, env_hash="h",
        obs=rng.integers(0, 256, (t, n, 36, 36, 1)).astype(np.uint8),
        actions=rng.integers(0, 3, (t, n)).astype(np.int64),
        logprobs=np.full((t, n), np.log(1 / 3), np.float32), values=np.zeros((t, n), np.float32),
        rewards=rng.normal(size=(t, n)).astype(np.float32), dones=np.zeros((t, n), bool),
        truncated=np.zeros((t, n), bool), bootstrap_value=np.zeros(n, np.float32),
        final_values=np.zeros((t, n), np.float32), episode_returns=np.zeros(0, np.float32),
        episode_lengths=np.zeros(0, np.int32),
    )  # fmt: skip


def test_a_ppo_update_under_cpu_autocast_moves_float32_master_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(parallel_module, "native_bf16", lambda: True)
    torch.manual_seed(0)
    policy = _cnn()
    before = {k: v.detach().clone() for k, v in policy.named_parameters()}
    plan = plan_parallelism("auto", ["host"], 1, 1 << 30)
    wrapped = parallelize(policy, plan, torch.device("cpu"), ShardingOptions(mixed_precision=True))
    learner = PPOLearner(wrapped.module, PPOConfig(), policy, wrapped.forward_context)
    metrics = learner.update([_fragment(np.random.default_rng(1))], 0)
    assert all(np.isfinite(v) for v in metrics.values() if isinstance(v, float))
    for name, param in policy.named_parameters():
        assert param.dtype == torch.float32, name
        assert torch.isfinite(param).all(), name
    assert any(not torch.equal(before[k], v) for k, v in policy.named_parameters())
