"""A causal LM built on the meta device and given storage unit by unit (learner/materialize.py):
its initial values are transformers' own (the same buffers and forward as an eager build
holding the same weights), the same from the same seed and without touching the caller's RNG;
it is materialised one shard unit at a time; and a 2-rank group holds, sharded or replicated,
exactly the model a lone rank builds from the same seed."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gymnasium import spaces
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shoal.learner.materialize import build_policy, defers, is_deferred, materialize
from shoal.learner.models import ModelConfig, build_model
from tests.learner.materialize_ranks import CONFIG, SEED, deferred_policy, full_state
from tests.support.ranks import run_ranks

CPU = torch.device("cpu")


def test_only_a_causal_lm_built_from_sizes_is_deferred(tmp_path: Path) -> None:
    assert defers(CONFIG)
    assert not defers(ModelConfig(family="causal-lm", path=str(tmp_path)))
    assert not defers(ModelConfig(family="mlp"))
    obs = spaces.Box(-1, 1, (4,), np.float32)
    mlp = build_policy(ModelConfig(family="mlp"), obs, spaces.Discrete(2), CPU)
    assert not is_deferred(mlp)


def test_a_deferred_lm_has_no_storage_until_materialised() -> None:
    policy = deferred_policy()
    assert all(t.is_meta for t in [*policy.parameters(), *policy.buffers()])
    materialize(policy, CPU, SEED)
    assert not is_deferred(policy)
    assert all(torch.isfinite(t).all() for t in [*policy.parameters(), *policy.buffers()])


def test_its_values_are_transformers_init_and_its_forward_an_eager_builds() -> None:
    policy = deferred_policy()
    materialize(policy, CPU, SEED)
    eager = build_model(CONFIG, policy.observation_space, policy.action_space)
    for (name, mine), (_, theirs) in zip(
        policy.named_buffers(), eager.named_buffers(), strict=True
    ):
        assert torch.equal(mine, theirs), name  # the rotary frequencies, recomputed
    params = dict(policy.named_parameters())
    std = eager.lm.config.initializer_range
    for name, weight in params.items():
        if name.endswith(("proj.weight", "embed_tokens.weight")):
            assert abs(float(weight.detach().std()) - std) < 0.25 * std, name
        elif name.endswith("norm.weight"):
            assert torch.equal(weight, torch.ones_like(weight)), name
        elif name.endswith(".bias"):
            assert not weight.any(), name
    eager.load_state_dict(policy.state_dict())
    tokens = torch.randint(0, CONFIG.vocab_size, (3, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, values = policy.heads(policy.prepare(tokens))
        want_logits, want_values = eager.heads(eager.prepare(tokens))
    assert torch.equal(logits, want_logits)
    assert torch.equal(values, want_values)


def test_the_same_seed_gives_the_same_model_and_leaves_the_callers_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first, second, other = deferred_policy(), deferred_policy(), deferred_policy()
    materialize(first, CPU, SEED)
    materialize(second, CPU, SEED)
    materialize(other, CPU, SEED + 1)
    assert torch.equal(torch.get_rng_state(), before)
    a, b, c = full_state(first), full_state(second), full_state(other)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["lm.model.embed_tokens.weight"], c["lm.model.embed_tokens.weight"])


@settings(max_examples=8, deadline=None)
@given(layers=st.integers(1, 4), hidden=st.sampled_from([16, 32]), seed=st.integers(0, 2**31))
def test_units_are_materialised_and_handed_over_one_at_a_time(
    layers: int, hidden: int, seed: int
) -> None:
    cfg = ModelConfig(
        family="causal-lm", arch="qwen2", vocab_size=24, hidden_size=hidden, num_layers=layers,
        num_heads=2, num_kv_heads=1, intermediate_size=2 * hidden, max_positions=16,
    )  # fmt: skip
    obs = spaces.Box(0, 23, shape=(4,), dtype=np.int64)
    policy = build_policy(cfg, obs, spaces.Discrete(4), CPU)
    units = policy.shard_units()
    handed: list[int] = []

    def shard(unit: nn.Module) -> None:
        index = next(i for i, u in enumerate(units) if u is unit)
        assert index == len(handed)  # in order, each once
        assert not is_deferred(unit)
        assert all(is_deferred(later) for later in units[index + 1 :])
        assert policy.value_head.weight.is_meta  # the rest comes last
        handed.append(index)

    materialize(policy, CPU, seed, shard)
    assert len(units) == layers + 2  # the embeddings, every decoder layer, the LM head
    assert handed == list(range(len(units)))
    assert not is_deferred(policy)


@pytest.mark.timeout(600)
def test_two_ranks_hold_the_model_a_lone_rank_builds(tmp_path: Path) -> None:
    alone = deferred_policy()
    materialize(alone, CPU, SEED)
    want = full_state(alone)
    total = sum(p.numel() for p in alone.parameters())
    chunk = sum(-(-p.shape[0] // 2) * p[0].numel() for p in alone.parameters())  # dim-0 halves
    for sharding in ("fsdp", "replicate"):
        outs = [tmp_path / f"{sharding}-{rank}.npz" for rank in range(2)]
        module = "tests.learner.materialize_ranks"
        run_ranks([[sys.executable, "-m", module, sharding, str(out)] for out in outs])
        held = []
        for out in outs:
            got = dict(np.load(out))
            assert str(got.pop("strategy")) == sharding
            held.append(int(got.pop("held")))
            assert sorted(got) == sorted(want)
            for name, value in want.items():
                assert np.array_equal(got[name], value), f"{sharding}: {name}"
        if sharding == "fsdp":  # each rank holds its dim-0 half of every parameter
            assert sum(held) == total
            assert max(held) <= chunk < total
        else:
            assert held == [total, total]
