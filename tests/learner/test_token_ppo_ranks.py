"""Token GRPO on a real 2-rank gloo learner group: the token forward goes through the DDP or
FSDP2 wrapper, so the ranks' gradients are averaged exactly as the step update's are.

Each rank trains on its own fragment (with different numbers of completion tokens: the loss is
normalised by the group's token count), so one update on 2 ranks must land where one update of
a single learner on both fragments does (to float tolerance: the reductions sum in other
orders); DDP's replicas must stay identical; the
surrogate loss on the global batch must fall; and `target_kl`, synced over the group, must stop
every rank at the same epoch; the KL penalty's frozen reference is held like the policy (a
sharded copy under FSDP2, which refuses deepcopy). Also, in one process: what the update asks
of `group_mean`, and `token.target_kl`'s check.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import ConfigError
from shoal.learner.errors import PolicyError
from shoal.learner.token_config import TokenRLConfig
from shoal.learner.token_ppo import TokenPPO, normalise_loss
from tests.learner.token_ppo_ranks import (
    GROUP,
    TOKEN_CFG,
    build_policy,
    full_parameters,
    make_learner,
    rank_fragment,
    surrogate_loss,
)
from tests.support.ranks import run_ranks

META = ("strategy", "sharded", "loss_before", "loss_after", "epochs", "reference_err")


def run_group(
    tmp_path: Path, sharding: str, islands: tuple[str, ...] = ("h0", "h0")
) -> list[dict[str, np.ndarray]]:
    """One rank process of tests/learner/token_ppo_ranks.py per island label; all reaped."""
    outs = [tmp_path / f"{sharding}-{rank}.npz" for rank in range(len(islands))]
    module = "tests.learner.token_ppo_ranks"
    run_ranks(
        [[sys.executable, "-m", module, sharding, str(out), ",".join(islands)] for out in outs]
    )
    return [dict(np.load(out)) for out in outs]


def one_rank_update(world: int = 2) -> dict[str, np.ndarray]:
    """A single learner's update on the fragments of all `world` ranks at once."""
    policy = build_policy()
    fragments = [rank_fragment(policy, rank) for rank in range(world)]
    learner = make_learner(policy, policy, contextlib.nullcontext)
    before = surrogate_loss(policy, fragments)
    torch.manual_seed(7)
    metrics = learner.update(fragments, 0)
    after = surrogate_loss(policy, fragments)
    meta = {"loss_before": before, "loss_after": after, "epochs": metrics["epochs"]}
    return {**full_parameters(policy), **{k: np.array(v) for k, v in meta.items()}}


def assert_same_parameters(
    a: dict[str, np.ndarray], b: dict[str, np.ndarray], rtol: float, atol: float
) -> None:
    names = sorted(k for k in a if k not in META)
    assert names == sorted(k for k in b if k not in META)
    for name in names:
        np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.timeout(900)
def test_token_grpo_on_two_ranks_takes_the_one_rank_step_replicated_and_sharded(
    tmp_path: Path,
) -> None:
    single = one_rank_update()
    initial = full_parameters(build_policy())
    moved = max(float(np.abs(single[k] - v).max()) for k, v in initial.items())
    assert moved > 1e-3  # the update really moves the weights: the comparison means something
    policy = build_policy()
    counts = {int(rank_fragment(policy, rank).completion_lengths.sum()) for rank in range(2)}
    assert len(counts) == 2  # a per-rank token mean would weigh the ranks' tokens unequally
    replicated = run_group(tmp_path, "replicate")
    sharded = run_group(tmp_path, "fsdp")
    assert {str(r["strategy"]) for r in replicated} == {"replicate"}
    assert {str(r["strategy"]) for r in sharded} == {"fsdp"}
    assert not any(bool(r["sharded"]) for r in replicated)
    assert all(bool(r["sharded"]) for r in sharded)
    assert_same_parameters(replicated[0], replicated[1], rtol=0, atol=0)
    for result in [*replicated, *sharded]:
        assert_same_parameters(single, result, rtol=1e-4, atol=1e-5)
        assert float(result["loss_after"]) < float(result["loss_before"])
        assert float(result["loss_before"]) == pytest.approx(float(single["loss_before"]))
        assert float(result["epochs"]) == float(single["epochs"]) == 2.0
        assert float(result["reference_err"]) < 1e-5  # the KL's reference is the initial policy
    assert float(single["loss_after"]) < float(single["loss_before"])


def test_group_mean_gets_each_minibatchs_token_count_and_each_epochs_kl() -> None:
    policy = build_policy()
    fragment = rank_fragment(policy, 0)
    tokens = int(fragment.completion_lengths.sum())
    asked: list[float] = []

    def group_mean(value: torch.Tensor) -> torch.Tensor:
        asked.append(float(value))
        return value

    cfg = TokenRLConfig(group_size=GROUP, update_epochs=4, num_minibatches=2, target_kl=1e-9)
    metrics = TokenPPO(policy, cfg).update([fragment], 0, group_mean)
    assert metrics["epochs"] == 1.0  # epoch 1's second minibatch already moved off π_prox
    assert len(asked) == 3
    assert asked[0] + asked[1] == tokens  # the two minibatches' token counts
    assert 1e-9 < asked[2] < 1  # the epoch's approximate KL
    unbounded = TokenRLConfig(group_size=GROUP, update_epochs=3, num_minibatches=2)
    asked.clear()
    assert TokenPPO(build_policy(), unbounded).update([fragment], 0, group_mean)["epochs"] == 3.0
    assert len(asked) == 6  # no target_kl: token counts only
    assert sum(asked) == 3 * tokens


def test_ppo_learner_hands_kl_sync_to_the_token_update() -> None:
    policy = build_policy()
    learner = make_learner(policy, policy, contextlib.nullcontext)
    fragment = rank_fragment(policy, 0)
    tokens = float(fragment.completion_lengths.sum())
    calls: list[float] = []

    def kl_sync(kl: torch.Tensor) -> torch.Tensor:
        calls.append(float(kl))
        return kl

    assert TOKEN_CFG.target_kl is not None
    assert TOKEN_CFG.num_minibatches == 1
    metrics = learner.update([fragment], 0, kl_sync)
    assert metrics["epochs"] == 2.0
    assert calls[0::2] == [tokens, tokens]
    assert calls[1] == pytest.approx(0.0, abs=1e-6)  # epoch 1 is taken at π_prox
    assert calls[3] > 1e-9


@pytest.mark.timeout(900)
def test_token_grpo_on_four_hsdp_ranks_takes_the_one_rank_step(tmp_path: Path) -> None:
    """Two islands of two ranks: sharded inside an island, replicated across (the 512-GPU
    layout in miniature); the KL reference is sharded on the same 2-D mesh."""
    single = one_rank_update(world=4)
    hybrid = run_group(tmp_path, "hsdp", ("h0", "h1", "h0", "h1"))
    assert {str(r["strategy"]) for r in hybrid} == {"hsdp"}
    assert all(bool(r["sharded"]) for r in hybrid)
    for result in hybrid:
        assert_same_parameters(single, result, rtol=1e-4, atol=1e-5)
        assert float(result["loss_after"]) < float(result["loss_before"])
        assert float(result["epochs"]) == float(single["epochs"]) == 2.0
        assert float(result["reference_err"]) < 1e-5


@given(
    lengths=st.lists(st.integers(1, 6), min_size=2, max_size=8),
    cut=st.integers(1, 7),
    mode=st.sampled_from(["token", "sequence"]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=100, deadline=None)
def test_the_ranks_mean_of_group_normalised_losses_is_the_whole_minibatchs_loss(
    lengths: list[int], cut: int, mode: str, seed: int
) -> None:
    """Completions split over 2 ranks at `cut`: averaging the ranks' losses (what averaging
    their gradients does) gives the loss of the minibatch held by one learner."""
    cut = min(cut, len(lengths) - 1)
    per_token = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(seed))
    sizes = torch.tensor(lengths)
    whole = normalise_loss(per_token, sizes, mode)  # type: ignore[arg-type]
    split = int(sizes[:cut].sum())
    parts = [(per_token[:split], sizes[:cut]), (per_token[split:], sizes[cut:])]
    counts = [float(p.numel() if mode == "token" else s.numel()) for p, s in parts]

    def group_mean(value: torch.Tensor) -> torch.Tensor:
        assert float(value) in counts
        return torch.tensor(sum(counts) / 2)

    ranks = [normalise_loss(p, s, mode, group_mean) for p, s in parts]  # type: ignore[arg-type]
    assert float(sum(ranks)) / 2 == pytest.approx(float(whole), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "0.1", True])
def test_token_target_kl_must_be_a_positive_finite_number(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"token\.target_kl"):
        TokenRLConfig(target_kl=bad)  # type: ignore[arg-type]


def test_the_policy_forward_needs_actions_or_completion_spans() -> None:
    policy = build_policy()
    with pytest.raises(PolicyError, match=r"actions .* or prompt_lengths"):
        policy(torch.zeros((1, 16), dtype=torch.int64))
