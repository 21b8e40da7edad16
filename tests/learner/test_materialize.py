"""A causal LM built on the meta device and given storage unit by unit (learner/materialize.py):
its initial values are transformers' own (the same buffers and forward as an eager build
holding the same weights), the same from the same seed and without touching the caller's RNG;
it is materialised one shard unit at a time; and a 2-rank group holds, sharded or replicated,
exactly the model a lone rank builds from the same seed."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gymnasium import spaces
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import nn

from shoal.learner.errors import PolicyError
from shoal.learner.materialize import build_policy, is_deferred, materialize, read_weights
from shoal.learner.models import ModelConfig, PolicyModel, build_model, export_pretrained
from tests.learner.materialize_ranks import CONFIG, SEED, deferred_policy, full_state
from tests.support.ranks import run_ranks

CPU = torch.device("cpu")


def test_a_causal_lm_is_deferred_and_an_mlp_is_built_whole() -> None:
    assert is_deferred(deferred_policy())
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


def run_two_ranks(tmp_path: Path, sharding: str, *directory: str) -> list[dict[str, np.ndarray]]:
    """Both ranks' full state, strategy and elements held, from tests/learner/materialize_ranks."""
    outs = [tmp_path / f"{sharding}-{rank}.npz" for rank in range(2)]
    module = "tests.learner.materialize_ranks"
    run_ranks([[sys.executable, "-m", module, sharding, str(out), *directory] for out in outs])
    return [dict(np.load(out)) for out in outs]


def assert_holds(
    results: list[dict[str, np.ndarray]], sharding: str, want: dict[str, np.ndarray]
) -> None:
    """Every rank holds exactly `want` in full; under FSDP2 its dim-0 half of every parameter."""
    alone = deferred_policy()
    total = sum(p.numel() for p in alone.parameters())
    chunk = sum(-(-p.shape[0] // 2) * p[0].numel() for p in alone.parameters())
    held = []
    for got in results:
        assert str(got.pop("strategy")) == sharding
        held.append(int(got.pop("held")))
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            assert np.array_equal(got[name], value), f"{sharding}: {name}"
    if sharding == "fsdp":
        assert sum(held) == total
        assert max(held) <= chunk < total
    else:
        assert held == [total, total]


@pytest.mark.timeout(600)
def test_two_ranks_hold_the_model_a_lone_rank_builds(tmp_path: Path) -> None:
    alone = deferred_policy()
    materialize(alone, CPU, SEED)
    want = full_state(alone)
    for sharding in ("fsdp", "replicate"):
        assert_holds(run_two_ranks(tmp_path, sharding), sharding, want)


# -- from a save_pretrained directory -----------------------------------------------------------


def exported(directory: Path, seed: int = 11) -> dict[str, np.ndarray]:
    """A materialised policy written as a save_pretrained directory; its full state."""
    policy = deferred_policy()
    materialize(policy, CPU, seed)
    export_pretrained(policy, directory)
    return full_state(policy)


def from_directory(directory: Path) -> PolicyModel:
    cfg = ModelConfig(family="causal-lm", path=str(directory))
    return build_policy(cfg, deferred_policy().observation_space, spaces.Discrete(8), CPU)


def test_a_directory_is_read_into_exactly_its_weights(tmp_path: Path) -> None:
    want = exported(tmp_path / "lm")
    policy = from_directory(tmp_path / "lm")
    assert is_deferred(policy)
    materialize(policy, CPU, SEED)  # another seed: whatever is drawn is overwritten
    read_weights(policy)
    got = full_state(policy)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert np.array_equal(got[name], value), name


def tied_directory(directory: Path) -> dict[str, np.ndarray]:
    """A save_pretrained directory of a small Qwen2 with tied embeddings (as Qwen2.5-0.5B
    ships: the head's weight is not in the files); the LM's tensors as transformers loads it."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=48, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    return {f"lm.{k}": v.detach().numpy().copy() for k, v in loaded.state_dict().items()}


def assert_tied_and_read(state: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """`state` (`full_state`: a shared parameter under its first name only) holds `want`, and
    the head is still the embeddings' parameter (so it is not listed apart)."""
    head = want.pop("lm.lm_head.weight")
    assert "lm.lm_head.weight" not in state
    assert np.array_equal(head, want["lm.model.embed_tokens.weight"])
    for name, value in want.items():
        assert np.array_equal(state[name], value), name


def test_a_directory_with_tied_embeddings_is_deferred_and_stays_tied(tmp_path: Path) -> None:
    want = tied_directory(tmp_path / "tied")
    policy = from_directory(tmp_path / "tied")
    assert is_deferred(policy)
    materialize(policy, CPU, SEED)
    read_weights(policy)
    lm = policy.lm
    assert lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    assert_tied_and_read(full_state(policy), want)


@pytest.mark.timeout(600)
def test_two_sharded_ranks_read_a_tied_directory(tmp_path: Path) -> None:
    want = tied_directory(tmp_path / "tied")
    for got in run_two_ranks(tmp_path, "fsdp", str(tmp_path / "tied")):
        assert str(got.pop("strategy")) == "fsdp"
        got.pop("held")
        assert_tied_and_read(got, dict(want))


def rewrite(directory: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file))


def split(directory: Path) -> None:
    """The one file as two, as save_pretrained shards a big model (the index is not read)."""
    tensors = load_file(str(directory / "model.safetensors"))
    names = sorted(tensors)
    (directory / "model.safetensors").unlink()
    save_file({k: tensors[k] for k in names[:5]}, str(directory / "model-1.safetensors"))
    save_file({k: tensors[k] for k in names[5:]}, str(directory / "model-2.safetensors"))


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda d: (d / "model.safetensors").unlink(), "safetensors only"),
        (lambda d: rewrite(d, lambda t: t.pop("model.norm.weight")),
         "missing 'model.norm.weight'"),
        (lambda d: rewrite(d, lambda t: t.update(extra=torch.zeros(2))), "unexpected 'extra'"),
        (lambda d: rewrite(d, lambda t: t.update({"model.norm.weight": torch.ones(3)})),
         "'model.norm.weight' in"),
        (lambda d: rewrite(d, lambda t: t.update({"model.norm.weight": torch.ones(32).long()})),
         "is I64"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x10\x00garbage"),
         "safetensors header"),
        (lambda d: save_file({"model.norm.weight": torch.ones(32)}, str(d / "copy.safetensors")),
         "is in both"),
        (lambda d: save_file({"x": torch.ones(1)}, str(d / "dcp.safetensors"),
                             metadata={"DCP_SHARDING_INFO": "{}"}),
         "one shard of a DCP"),
    ],
)  # fmt: skip
def test_a_hostile_directory_is_refused_before_any_value_is_read(
    tmp_path: Path, damage: Callable[[Path], None], said: str
) -> None:
    exported(tmp_path / "lm")
    damage(tmp_path / "lm")
    with pytest.raises(PolicyError, match=re.escape(said)):
        from_directory(tmp_path / "lm")


def test_a_directory_of_several_files_is_read_whole(tmp_path: Path) -> None:
    want = exported(tmp_path / "lm")
    split(tmp_path / "lm")
    policy = from_directory(tmp_path / "lm")
    materialize(policy, CPU, SEED)
    read_weights(policy)
    got = full_state(policy)
    assert all(np.array_equal(got[k], v) for k, v in want.items())


def test_a_bf16_directory_loads_as_float32(tmp_path: Path) -> None:
    want = exported(tmp_path / "lm")
    rewrite(tmp_path / "lm", lambda t: t.update({k: v.bfloat16() for k, v in t.items()}))
    policy = from_directory(tmp_path / "lm")
    materialize(policy, CPU, SEED)
    read_weights(policy)
    got = full_state(policy)
    embed = "lm.model.embed_tokens.weight"
    assert got[embed].dtype == np.float32
    np.testing.assert_allclose(got[embed], want[embed], rtol=1e-2, atol=1e-3)


@pytest.mark.timeout(600)
def test_two_sharded_ranks_read_a_directory_into_exactly_its_weights(tmp_path: Path) -> None:
    want = exported(tmp_path / "lm")
    assert_holds(run_two_ranks(tmp_path, "fsdp", str(tmp_path / "lm")), "fsdp", want)
