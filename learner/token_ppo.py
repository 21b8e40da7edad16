"""Token-level PPO and GRPO on `SequenceFragment`s, with the decoupled off-policy correction.

Each completion token is one action; the state is the prompt and the tokens before it. The
reward arrives once, at the completion's last token. Two ways to turn it into per-token
advantages:

- `algo = "ppo"`: GAE over the completion tokens with the value head's behaviour values
  (γ = `gamma`, 1 by default: the episode is short and undiscounted; λ = `gae_lambda`), and a
  clipped value loss, as learner/ppo.py does for steps.
- `algo = "grpo"`: each prompt is sampled `group_size` times; a completion's advantage is its
  reward normalised within its group, (r − mean) / (std + eps), given to every one of its
  tokens. No critic and no value loss.

Both correct for staleness as learner/ppo.py does: the trust region is taken around π_prox, the
learner's parameters when the update starts, and each token is re-weighted by π_prox/μ capped at
`is_cap`, where μ is the behaviour log-prob learner/generation.py recorded: the log-prob under
the SAMPLING distribution, softmax(logits / temperature). So every log-prob here is computed at
the same `temperature` the actors sample with; with it, on-policy data gets weight 1 (up to
rounding).
An optional KL penalty to a frozen reference policy uses the k3 estimator
exp(ref − logp) − (ref − logp) − 1 per token (unbiased, always >= 0).

Normalisation (`loss_norm`): "token" (the default) averages the per-token loss over every
completion token of the minibatch; "sequence" averages within each completion first, then over
completions. Sequence-mean gives each completion the same total weight, so a token of a
100-token completion counts 1/100 as much as the token of a 1-token one: long wrong answers are
penalised less per token and long right ones rewarded less, a length bias the model learns to
exploit (DAPO and Dr. GRPO measured it). Token-mean weighs every sampled token equally; its
only cost is that a minibatch's total weight depends on how many tokens it holds. In a learner
group the mean is over the whole group's minibatch, not each rank's (`normalise_loss`).

Staleness is measured in versions from the per-token stamps (current version − the version that
sampled the token); the intake's bound (learner/buffer.py) holds for every token because a
fragment's `policy_version` is its oldest stamp.

The advantages are learner/token_advantages.py's, the hyper-parameters learner/token_config.py's.
`token_outputs` is the one forward: the HF decoder over [N, L], then the LM head and value head
only at the completion positions (an [N, L, vocab] logit tensor would be most of the memory).
It is CausalLMPolicy's token-form `forward`, called through the module's `__call__`, so in a
learner group the same DDP or FSDP2 wrapper as the step update's reduces the gradients (over
the ranks' own fragments) and gathers the shards; `target_kl` stops the epochs as it does there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from shoal.learner.errors import BadFragment, PolicyError
from shoal.learner.models.base import PolicyModel
from shoal.learner.models.causal_lm import CausalLMPolicy
from shoal.learner.parallel import full_tensor
from shoal.learner.ppo import MetricSync, explained_variance, lag_summary
from shoal.learner.reference_policy import frozen_copy
from shoal.learner.sequences import SequenceFragment, check_vocab
from shoal.learner.token_advantages import grpo_advantages, token_gae
from shoal.learner.token_config import LossNorm, TokenRLConfig

# -- the forward -------------------------------------------------------------------------------


@dataclass
class TokenOutputs:
    """Per completion token, flat [K] in row-major order (row 0's tokens, then row 1's, ...)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    values: torch.Tensor


def token_outputs(
    model: nn.Module,
    tokens: torch.Tensor,
    prompt_lengths: torch.Tensor,
    completion_lengths: torch.Tensor,
    temperature: float,
) -> TokenOutputs:
    """Log-probs and entropies of softmax(logits / temperature) at every completion token, and
    V of the state each was sampled in, with ONE forward over the right-padded [N, L]
    (CausalLMPolicy.completion_outputs). It goes through `model`'s `__call__`: `model` is a
    CausalLMPolicy or its DDP or FSDP2 wrapper, whose hooks (gradient buckets, shard
    gathers) run only there."""
    logp, entropy, values = model(
        tokens,
        prompt_lengths=prompt_lengths,
        completion_lengths=completion_lengths,
        temperature=temperature,
    )
    return TokenOutputs(logp, entropy, values)


# -- the batch ---------------------------------------------------------------------------------


@dataclass
class TokenBatch:
    """Fragments' rows stacked to [B, L] tensors; per-token fields flat [K] in row-major order."""

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    completion_lengths: torch.Tensor
    behaviour_logp: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    offsets: torch.Tensor
    """[B]: where row r's tokens start in the flat per-token fields."""

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    def token_index(self, rows: torch.Tensor) -> torch.Tensor:
        """Flat token positions of `rows`, in their order: what token_outputs(rows) returns."""
        lengths = self.completion_lengths[rows].long()
        starts = torch.repeat_interleave(self.offsets[rows], lengths)
        first = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        return starts + torch.arange(int(lengths.sum()), device=lengths.device) - first


def build_token_batch(
    fragments: Sequence[SequenceFragment], cfg: TokenRLConfig, device: torch.device
) -> TokenBatch:
    """Advantages per fragment (groups never straddle fragments), then rows stacked."""
    length = max(int((f.prompt_lengths + f.completion_lengths).max()) for f in fragments)
    parts: dict[str, list[np.ndarray]] = {
        k: [] for k in ("tok", "pl", "cl", "logp", "val", "adv", "ret")
    }
    for frag in fragments:
        mask = frag.completion_mask()
        if cfg.algo == "grpo":
            _check_groups(frag, cfg.group_size)
            row_adv = grpo_advantages(frag.rewards, frag.groups, cfg.adv_eps)
            adv = np.broadcast_to(row_adv[:, None], mask.shape)[mask]
            ret = np.zeros_like(adv)
        else:
            adv_grid, ret_grid = token_gae(
                frag.rewards, frag.values, mask, cfg.gamma, cfg.gae_lambda
            )
            adv, ret = adv_grid[mask], ret_grid[mask]
        tokens = np.zeros((frag.num_envs, length), dtype=np.int64)
        width = min(length, frag.horizon)
        tokens[:, :width] = frag.tokens[:, :width]
        parts["tok"].append(tokens)
        parts["pl"].append(frag.prompt_lengths)
        parts["cl"].append(frag.completion_lengths)
        parts["logp"].append(frag.logprobs[mask])
        parts["val"].append(frag.values[mask])
        parts["adv"].append(adv)
        parts["ret"].append(ret)

    def cat(key: str) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts[key])).to(device)

    completion = cat("cl").long()
    offsets = torch.cumsum(completion, 0) - completion
    return TokenBatch(
        cat("tok"),
        cat("pl").long(),
        completion,
        cat("logp"),
        cat("val"),
        cat("adv"),
        cat("ret"),
        offsets,
    )


def _check_groups(frag: SequenceFragment, group_size: int) -> None:
    ids, counts = np.unique(frag.groups, return_counts=True)
    wrong = counts != group_size
    if wrong.any():
        k = int(np.argmax(wrong))
        raise BadFragment(
            f"fragment from {frag.actor_id!r} seq {frag.seq} has {int(counts[k])} rows in group "
            f"{int(ids[k])}, token.group_size is {group_size}: a group is group_size samples of "
            "one prompt and never straddles fragments (set token.group_size to the actors' one)"
        )


def token_lag_stats(
    fragments: Sequence[SequenceFragment], current_version: int
) -> dict[str, float]:
    """Policy lag per completion token (current version − the version that sampled it)."""
    lags = np.concatenate(
        [current_version - f.versions[f.completion_mask()].astype(np.int64) for f in fragments]
    )
    if (lags < 0).any():
        bad = next(f for f in fragments if int(f.versions.max()) > current_version)
        raise BadFragment(
            f"fragment from {bad.actor_id!r} seq {bad.seq} has tokens sampled by version "
            f"{int(bad.versions.max())}, newer than the learner's {current_version}"
        )
    return lag_summary(lags)


# -- the learner -------------------------------------------------------------------------------


class TokenPPO:
    """Runs token PPO/GRPO updates on a CausalLMPolicy; one caller at a time (not thread-safe).

    `optimizer` defaults to AdamW over the policy at `cfg.lr` (PPOLearner passes its own, so
    checkpoints and learning-rate annealing see one optimiser). `model` is what forward and
    backward go through: the policy's DDP or FSDP2 wrapper in a learner group (its hooks reduce
    the gradients over the ranks inside `backward`), the policy itself when None. `reference`
    is the frozen policy the KL penalty pulls towards; with kl_coef > 0 and none given, a copy
    of the policy as it is now (the SFT model at the start of RL) is frozen and kept, sharded
    like the policy (learner/reference_policy.py).
    """

    def __init__(
        self,
        policy: PolicyModel,
        cfg: TokenRLConfig,
        optimizer: torch.optim.Optimizer | None = None,
        reference: CausalLMPolicy | None = None,
        forward_context: Callable[[], contextlib.AbstractContextManager[Any]] = (
            contextlib.nullcontext
        ),
        model: nn.Module | None = None,
    ) -> None:
        if not isinstance(policy, CausalLMPolicy):
            raise PolicyError(
                f"sequence fragments train a causal-lm policy, this one is {policy.family or 'custom'}"
            )
        self.policy: CausalLMPolicy = policy
        self.model: nn.Module = policy if model is None else model
        self.cfg = cfg
        self.forward_context = forward_context
        if optimizer is None:
            optimizer = torch.optim.AdamW(
                policy.parameters(), lr=cfg.lr, eps=cfg.adam_eps, weight_decay=0.0
            )
        self.optimizer = optimizer
        self.reference: nn.Module | None = reference
        if reference is None and cfg.kl_coef > 0:
            self.reference = frozen_copy(policy)
        if self.reference is not None:
            self.reference.requires_grad_(False).eval()

    @property
    def device(self) -> torch.device:
        return self.policy.device

    def outputs(self, model: nn.Module, batch: TokenBatch, rows: torch.Tensor) -> TokenOutputs:
        """token_outputs of `rows` through `model` under the forward context."""
        with self.forward_context():
            return token_outputs(
                model,
                batch.tokens[rows],
                batch.prompt_lengths[rows],
                batch.completion_lengths[rows],
                self.cfg.temperature,
            )

    def check(self, fragments: Sequence[SequenceFragment]) -> None:
        """Refuse fragments this policy cannot score: unknown ids or rows longer than its positions."""
        if not fragments:
            raise BadFragment("update() needs at least one fragment")
        positions = int(self.policy.lm.config.max_position_embeddings)
        for frag in fragments:
            check_vocab(frag, self.policy.action_dim)
            if int((frag.prompt_lengths + frag.completion_lengths).max()) > positions:
                raise BadFragment(
                    f"fragment from {frag.actor_id!r} seq {frag.seq} has rows longer than the "
                    f"policy's {positions} positions"
                )
        rows = sum(f.num_envs for f in fragments)
        if rows < self.cfg.num_minibatches:
            raise BadFragment(
                f"update() got {rows} completions, fewer than token.num_minibatches = "
                f"{self.cfg.num_minibatches}: collect more per update or use fewer minibatches"
            )

    def update(
        self,
        fragments: Sequence[SequenceFragment],
        current_version: int,
        group_mean: MetricSync | None = None,
    ) -> dict[str, float]:
        """One update over `fragments`; returns losses, KL, clip fraction, IS weights, lag, ….

        Every rank of a group calls it on its own fragments with the same number of
        minibatches (`num_minibatches` is a count), so the wrapper's collectives pair up, and
        passes `group_mean` (an all-reduce mean over the ranks, `LearnerGroup.mean`): each
        minibatch's loss is normalised by the group's token count (`normalise_loss`), and with
        `target_kl` set, the epochs stop once an epoch's approximate KL to π_prox, averaged
        over the ranks, exceeds it, so every rank stops at the same epoch.
        """
        cfg = self.cfg
        self.check(fragments)
        metrics = token_lag_stats(fragments, current_version)
        batch = build_token_batch(fragments, cfg, self.device)
        chunks = torch.arange(batch.rows, device=self.device).tensor_split(cfg.num_minibatches)
        with torch.no_grad():
            prox = None  # one pass over the batch: π_prox is the forward the loss takes anyway
            if cfg.update_epochs * cfg.num_minibatches > 1:
                prox = torch.cat([self.outputs(self.model, batch, c).logprobs for c in chunks])
            ref = None
            if self.reference is not None and cfg.kl_coef > 0:
                ref = torch.cat([self.outputs(self.reference, batch, c).logprobs for c in chunks])
        sums: dict[str, float] = {}
        steps = epochs = 0
        for _ in range(cfg.update_epochs):
            epochs += 1
            kl_epoch = 0.0
            for rows in torch.randperm(batch.rows, device=self.device).tensor_split(
                cfg.num_minibatches
            ):
                out = self.minibatch_step(batch, rows, prox, ref, group_mean)
                for key, value in out.items():
                    sums[key] = sums.get(key, 0.0) + value
                kl_epoch += out["approx_kl"]
                steps += 1
            if self.kl_exceeded(kl_epoch / cfg.num_minibatches, group_mean):
                break
        rewards = np.concatenate([f.rewards for f in fragments])
        metrics.update({key: value / steps for key, value in sums.items()})
        metrics.update(
            {
                "reward_mean": float(rewards.mean()),
                "reward_std": float(rewards.std()),
                "completion_length_mean": float(batch.completion_lengths.float().mean()),
                "epochs": float(epochs),
                "num_steps": float(batch.behaviour_logp.numel()),
                "num_sequences": float(batch.rows),
                "num_fragments": float(len(fragments)),
                "lr": float(self.optimizer.param_groups[0]["lr"]),
            }
        )
        if cfg.algo == "ppo":
            metrics["explained_variance"] = explained_variance(batch.values, batch.returns)
        return metrics

    def kl_exceeded(self, kl_epoch: float, group_mean: MetricSync | None) -> bool:
        """Whether the epoch's approximate KL (averaged over the group by `group_mean`) is past
        `target_kl`; never without one (and then no collective is made)."""
        if self.cfg.target_kl is None:
            return False
        kl = torch.tensor(kl_epoch, device=self.device)
        if group_mean is not None:
            kl = group_mean(kl)
        return bool(kl.item() > self.cfg.target_kl)

    def minibatch_step(
        self,
        batch: TokenBatch,
        rows: torch.Tensor,
        prox: torch.Tensor | None,
        ref: torch.Tensor | None,
        group_mean: MetricSync | None = None,
    ) -> dict[str, float]:
        """Loss, backward, clip and step for the completions `rows`; returns its statistics.
        `prox` holds π_prox per token; None when this step is the update's only one, where
        π_prox is this very forward (detached). `group_mean`: see `normalise_loss`."""
        cfg = self.cfg
        at = batch.token_index(rows)
        out = self.outputs(self.model, batch, rows)
        prox_at = out.logprobs.detach() if prox is None else prox[at]
        raw = torch.exp(prox_at - batch.behaviour_logp[at])
        weights = raw.clamp(max=cfg.is_cap)
        log_ratio = out.logprobs - prox_at
        ratio = log_ratio.exp()
        adv = batch.advantages[at]
        if cfg.algo == "ppo" and cfg.norm_adv and adv.numel() > 1:
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        surrogate = torch.max(
            -adv * ratio, -adv * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)
        )
        policy_loss = weights * surrogate
        per_token = policy_loss - cfg.ent_coef * out.entropy
        stats: dict[str, torch.Tensor] = {}
        if ref is not None:
            to_ref = ref[at] - out.logprobs
            kl = to_ref.exp() - to_ref - 1
            per_token = per_token + cfg.kl_coef * kl
            stats["kl_ref"] = kl.mean()
        if cfg.algo == "ppo":
            v_loss = _value_loss(out.values, batch.values[at], batch.returns[at], cfg)
            per_token = per_token + cfg.vf_coef * v_loss
            stats["value_loss"] = v_loss.mean()
        else:
            # DDP reduces a bucket once every parameter in it has its gradient and never
            # learns of one that gets none: without a critic the value head still takes part,
            # with weight 0 (a gradient of exactly 0: Adam, with no moments from a critic's
            # earlier training, leaves it as it is).
            per_token = per_token + 0.0 * out.values
        lengths = batch.completion_lengths[rows]
        loss = normalise_loss(per_token, lengths, cfg.loss_norm, group_mean)

        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = full_tensor(
            nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        )
        self.optimizer.step()

        with torch.no_grad():
            stats["approx_kl"] = ((ratio - 1) - log_ratio).mean()
            stats["is_weight_mean"] = weights.mean()
            stats["is_weight_capped_frac"] = (raw > cfg.is_cap).float().mean()
            stats["clipfrac"] = ((ratio - 1).abs() > cfg.clip_coef).float().mean()
            stats["policy_loss"] = policy_loss.mean()
            stats["entropy"] = out.entropy.mean()
        return {
            "loss": loss.item(),
            "grad_norm": float(grad_norm),
            **{k: v.item() for k, v in stats.items()},
        }


def normalise_loss(
    per_token: torch.Tensor,
    lengths: torch.Tensor,
    mode: LossNorm,
    group_mean: MetricSync | None = None,
) -> torch.Tensor:
    """The minibatch loss from per-token losses [K] (row-major) of completions of `lengths` [B]:
    "token" averages over all K tokens, "sequence" within each completion, then over them.

    In a learner group pass `group_mean` (an all-reduce mean over the ranks): the sum is then
    divided by the ranks' mean count of tokens (completions), so once DDP or FSDP2 averages the
    ranks' gradients, the step is that of the mean over the whole group's minibatch, however
    unevenly its tokens are spread over the ranks (a collective: every rank calls it)."""
    if mode == "token":
        total, count = per_token.sum(), per_token.numel()
    else:
        lengths = lengths.long()
        row = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        sums = torch.zeros(lengths.numel(), device=per_token.device, dtype=per_token.dtype)
        total, count = (sums.index_add(0, row, per_token) / lengths).sum(), lengths.numel()
    denominator = torch.tensor(float(count), device=per_token.device)
    if group_mean is not None:
        denominator = group_mean(denominator)
    return total / denominator


def _value_loss(
    new: torch.Tensor, old: torch.Tensor, returns: torch.Tensor, cfg: TokenRLConfig
) -> torch.Tensor:
    """Per-token ½ squared error to the returns, clipped around the behaviour values."""
    unclipped = (new - returns).pow(2)
    if not cfg.clip_vloss:
        return 0.5 * unclipped
    clipped = old + (new - old).clamp(-cfg.clip_coef, cfg.clip_coef)
    return 0.5 * torch.max(unclipped, (clipped - returns).pow(2))
