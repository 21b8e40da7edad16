"""One rank of a real gloo group taking a token GRPO update through PPOLearner (spawned by
tests/learner/test_token_ppo_ranks.py, which also builds its 1-rank reference from here).

    python -m tests.learner.token_ppo_ranks SHARDING OUT ISLANDS   (the GroupSpec in the environment)

ISLANDS names each rank's island, comma-separated (hsdp shards inside an island).

Every rank builds the same tiny Qwen2 policy and the fragments of every rank (rank r trains on
fragment r; their completions, and so their token counts, differ), wraps the policy as SHARDING says (replicate: DDP, fsdp: FSDP2, hsdp: FSDP2 on a 2-D mesh), measures the
surrogate loss on the global batch, checks a frozen copy of the wrapped policy scores it as the
policy does, takes one update and writes the full parameters, the loss before and after, the
copy's largest log-prob error and the epochs it ran to OUT (.npz).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from shoal.learner.group import GroupSpec, LearnerGroup, exit_after_group
from shoal.learner.models import CausalLMPolicy, ModelConfig, build_model
from shoal.learner.parallel import ShardingOptions, full_tensor, parallelize, plan_parallelism
from shoal.learner.ppo import PPOConfig, PPOLearner
from shoal.learner.reference_policy import frozen_copy
from shoal.learner.sequences import SequenceFragment
from shoal.learner.token_config import TokenRLConfig
from shoal.learner.token_ppo import build_token_batch, token_outputs

VOCAB, GROUP, GROUPS, PROMPT, COMPLETION = 16, 4, 2, 4, 5
TOKEN_CFG = TokenRLConfig(
    algo="grpo", group_size=GROUP, update_epochs=3, num_minibatches=1, target_kl=1e-9, kl_coef=0.5
)
"""Epoch 1 starts at π_prox (KL 0), so a tiny target_kl stops every rank after epoch 2; the KL
penalty to the frozen reference (the initial policy) pulls from epoch 2 on."""
PPO_CFG = PPOConfig(lr=3e-3)


def build_policy() -> CausalLMPolicy:
    """The same tiny Qwen2 (2 decoder layers: 4 FSDP2 shard units with the embeddings and the head) in every process."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=64, max_positions=64)  # fmt: skip
    cfg = ModelConfig(family="causal-lm", arch="qwen2", **sizes)
    obs = spaces.Box(0, VOCAB - 1, shape=(16,), dtype=np.int64)
    model = build_model(cfg, obs, spaces.Discrete(VOCAB))
    assert isinstance(model, CausalLMPolicy)
    return model


def rank_fragment(policy: CausalLMPolicy, rank: int) -> SequenceFragment:
    """Rank `rank`'s GROUPS prompts × GROUP completions, sampled (for the log-probs) by
    `policy`: on-policy data, rewards in [0, 1)."""
    rng = np.random.default_rng(100 + rank)
    n, length = GROUPS * GROUP, PROMPT + COMPLETION
    tokens = rng.integers(0, VOCAB, size=(n, length)).astype(np.int64)
    for first in range(0, n, GROUP):
        tokens[first : first + GROUP, :PROMPT] = tokens[first, :PROMPT]
    prompt = np.repeat(rng.integers(1, PROMPT + 1, size=GROUPS), GROUP).astype(np.int32)
    completion = rng.integers(1, COMPLETION + 1, size=n).astype(np.int32)
    position = np.arange(length)[None, :]
    mask = (position >= prompt[:, None]) & (position < (prompt + completion)[:, None])
    with torch.no_grad():
        out = token_outputs(
            policy,
            torch.from_numpy(tokens),
            torch.from_numpy(prompt),
            torch.from_numpy(completion),
            TOKEN_CFG.temperature,
        )
    logprobs = np.zeros((n, length), np.float32)
    logprobs[mask] = out.logprobs.numpy()
    return SequenceFragment(
        actor_id=f"a{rank}",
        seq=0,
        policy_version=0,
        env_hash="h",
        tokens=tokens,
        prompt_lengths=prompt,
        completion_lengths=completion,
        logprobs=logprobs,
        versions=np.where(mask, 0, -1).astype(np.int32),
        values=np.zeros((n, length), np.float32),
        rewards=rng.random(n).astype(np.float32),
        groups=np.repeat(np.arange(GROUPS), GROUP).astype(np.int64) + GROUPS * rank,
    )


def make_learner(
    model: nn.Module,
    policy: CausalLMPolicy,
    forward_context: Callable[[], contextlib.AbstractContextManager[Any]],
) -> PPOLearner:
    learner = PPOLearner(model, PPO_CFG, policy, forward_context)
    learner.token_cfg = TOKEN_CFG
    return learner


def surrogate_loss(model: nn.Module, fragments: Sequence[SequenceFragment]) -> float:
    """−mean over the tokens of every fragment of A · π_θ/μ (GRPO's objective before clipping),
    through `model` (a collective under FSDP2: every rank calls it)."""
    batch = build_token_batch(fragments, TOKEN_CFG, torch.device("cpu"))
    with torch.no_grad():
        out = token_outputs(
            model,
            batch.tokens,
            batch.prompt_lengths,
            batch.completion_lengths,
            TOKEN_CFG.temperature,
        )
    ratio = torch.exp(out.logprobs - batch.behaviour_logp)
    return float(-(batch.advantages * ratio).mean())


def reference_error(model: nn.Module, fragments: Sequence[SequenceFragment]) -> float:
    """The largest difference between `model`'s log-prob of a completion token and the
    behaviour one (the initial policy's: on-policy data)."""
    batch = build_token_batch(fragments, TOKEN_CFG, torch.device("cpu"))
    with torch.no_grad():
        out = token_outputs(
            model,
            batch.tokens,
            batch.prompt_lengths,
            batch.completion_lengths,
            TOKEN_CFG.temperature,
        )
    return float((out.logprobs - batch.behaviour_logp).abs().max())


def full_parameters(policy: nn.Module) -> dict[str, np.ndarray]:
    """Every parameter in full (DTensor shards gathered: a collective)."""
    return {k: full_tensor(p).detach().numpy().copy() for k, p in policy.named_parameters()}


def main() -> None:
    sharding, out, islands = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    spec = GroupSpec.from_env()
    group = LearnerGroup(spec)
    group.join()
    try:
        policy = build_policy()
        fragments = [rank_fragment(policy, r) for r in range(spec.world_size)]
        plan = plan_parallelism(sharding, islands, 1, 1)  # type: ignore[arg-type]
        parallel = parallelize(policy, plan, torch.device("cpu"), ShardingOptions())
        learner = make_learner(parallel.module, policy, parallel.forward_context)
        before = surrogate_loss(parallel.module, fragments)
        reference_err = reference_error(frozen_copy(policy), fragments)
        torch.manual_seed(7)
        metrics = learner.update([fragments[spec.rank]], 0, group.mean)
        after = surrogate_loss(parallel.module, fragments)
        params = full_parameters(policy)
        sharded = any(hasattr(p, "full_tensor") for p in policy.parameters())
    finally:
        group.leave()
    np.savez(
        out,
        strategy=np.array(plan.strategy),
        sharded=np.array(sharded),
        loss_before=np.array(before),
        loss_after=np.array(after),
        epochs=np.array(metrics["epochs"]),
        reference_err=np.array(reference_err),
        **params,
    )


if __name__ == "__main__":
    main()
    exit_after_group(0)
