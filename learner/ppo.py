"""PPO with GAE and a decoupled, capped importance-weight correction for stale fragments.

Fragments reach the learner a few policy versions late. Plain PPO would clip the ratio
π_θ/μ around the *behaviour* policy μ, so a stale fragment starts the update already outside the
trust region and is clipped away (or, worse, pushes far). Decoupled PPO (Hilton et al., 2021)
separates the two roles: the trust region is taken around the *proximal* policy π_prox, the
learner's own parameters when the update starts, and the data is re-weighted by the importance
weight π_prox/μ, capped at `is_cap` so one improbable action can't dominate a minibatch. When
the data is on-policy (π_prox = μ) every weight is 1 and the loss is exactly CleanRL's PPO.
See docs/ppo.md for why this and not V-trace.

`gae` is pure numpy so its properties can be tested on their own; `PPOLearner` holds the
optimiser (torch.optim.AdamW; with no weight decay it is exactly CleanRL's Adam) and runs the
epochs and minibatches through the model's `__call__`, so a DDP or FSDP2 wrapper (see
learner/parallel.py) reduces the gradients inside the backward pass.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from shoal.config import check_int, check_number
from shoal.errors import ConfigError
from shoal.learner.errors import BadFragment, LearnerError
from shoal.learner.fragment import Fragment
from shoal.learner.models.base import PolicyModel
from shoal.learner.parallel import full_tensor
from shoal.learner.sequences import AnyFragment, SequenceFragment

if TYPE_CHECKING:
    from shoal.learner.token_config import TokenRLConfig
    from shoal.learner.token_ppo import TokenPPO

MetricSync = Callable[[torch.Tensor], torch.Tensor]

# policy-lag histogram buckets: (label, lowest lag, highest lag inclusive)
_LAG_BUCKETS = (
    ("0", 0, 0),
    ("1", 1, 1),
    ("2", 2, 2),
    ("3_4", 3, 4),
    ("5_8", 5, 8),
    ("9+", 9, None),
)


@dataclass
class PPOConfig:
    """The PPO update's hyper-parameters; defaults are CleanRL's for classic control."""

    lr: float = 2.5e-4
    """Adam learning rate (the caller may anneal it with `PPOLearner.set_lr`)."""
    adam_eps: float = 1e-5
    """Adam's epsilon; CleanRL's 1e-5 rather than torch's 1e-8."""
    gamma: float = 0.99
    """Discount factor, in [0, 1]."""
    gae_lambda: float = 0.95
    """GAE's λ, in [0, 1]: 0 is the one-step TD error, 1 the Monte-Carlo return."""
    clip_coef: float = 0.2
    """PPO's ratio clip ε (the ratio is π_θ/π_prox); also the value clip when clip_vloss."""
    vf_coef: float = 0.5
    """Weight of the value loss in the total loss."""
    ent_coef: float = 0.01
    """Weight of the entropy bonus."""
    max_grad_norm: float = 0.5
    """Global gradient-norm clip, applied to the group-reduced gradients."""
    update_epochs: int = 4
    """Passes over the batch per update."""
    num_minibatches: int = 4
    """Minibatches per epoch; fixed (not a size) so every rank of a group steps the same count."""
    clip_vloss: bool = True
    """Clip the value update around the behaviour values, as PPO's reference code does."""
    norm_adv: bool = True
    """Normalise advantages per minibatch to mean 0, std 1."""
    target_kl: float | None = None
    """Stop the epochs early once the approximate KL to π_prox exceeds this; None never stops."""
    is_cap: float = 2.0
    """Cap on the importance weight π_prox/μ that corrects for stale fragments (>= 1)."""

    def __post_init__(self) -> None:
        _number("lr", self.lr, above=0)
        _number("adam_eps", self.adam_eps, above=0)
        _number("gamma", self.gamma, "a number in [0, 1]", low=0, high=1)
        _number("gae_lambda", self.gae_lambda, "a number in [0, 1]", low=0, high=1)
        _number("clip_coef", self.clip_coef, above=0)
        _number("vf_coef", self.vf_coef, low=0)
        _number("ent_coef", self.ent_coef, low=0)
        _number("max_grad_norm", self.max_grad_norm, above=0)
        check_int("ppo.update_epochs", self.update_epochs, 1)
        check_int("ppo.num_minibatches", self.num_minibatches, 1)
        if self.target_kl is not None:
            _number("target_kl", self.target_kl, above=0)
        if (
            not (isinstance(self.is_cap, int | float) and math.isfinite(self.is_cap))
            or self.is_cap < 1
        ):
            raise ConfigError(
                f"ppo.is_cap = {self.is_cap!r} is invalid: use a finite number >= 1 "
                "(1 truncates like V-trace's ρ̄ = 1; larger trusts stale data more)"
            )


def _number(
    key: str,
    value: object,
    wanted: str | None = None,
    *,
    above: float | None = None,
    low: float | None = None,
    high: float | None = None,
) -> None:
    """shoal.config.check_number under `ppo.`, in this section's words: a NaN or an infinity
    is told to be finite, and `wanted` says the range where the bounds read worse."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"ppo.{key} = {value!r} is invalid: use a finite number")
    try:
        check_number(f"ppo.{key}", value, above=above, low=low, high=high)
    except ConfigError:
        if wanted is None:
            raise
        raise ConfigError(f"ppo.{key} = {value!r} is invalid: use {wanted}") from None


def gae(
    rewards: np.ndarray,
    values: np.ndarray,
    dones: np.ndarray,
    truncated: np.ndarray,
    final_values: np.ndarray,
    bootstrap_value: np.ndarray,
    gamma: float,
    lam: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimates and value targets for [T, N] arrays.

    `dones[t]` ends the episode after step t, cutting the trace. A terminal end (not truncated)
    is worth 0 afterwards; a time-limit end is worth `final_values[t]`, the value of the
    observation the environment was cut at. After the last step the episode goes on from
    `bootstrap_value` [N]. Returns (advantages, returns = advantages + values), float32.
    """
    horizon = rewards.shape[0]
    advantages = np.zeros(rewards.shape, dtype=np.float32)
    next_value = bootstrap_value.astype(np.float32)
    next_advantage = np.zeros(rewards.shape[1], dtype=np.float32)
    for t in reversed(range(horizon)):
        ended = dones[t]
        after = np.where(ended, np.where(truncated[t], final_values[t], 0.0), next_value)
        delta = rewards[t] + gamma * after - values[t]
        next_advantage = delta + gamma * lam * np.where(ended, 0.0, next_advantage)
        advantages[t] = next_advantage
        next_value = values[t]
    return advantages, (advantages + values).astype(np.float32)


@dataclass
class Batch:
    """Fragments flattened to one batch of steps, as tensors on the model's device."""

    obs: torch.Tensor
    actions: torch.Tensor
    behaviour_logp: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.values.shape[0])


def build_batch(fragments: Sequence[Fragment], cfg: PPOConfig, device: torch.device) -> Batch:
    """Run GAE per fragment and flatten [T, N] to [T*N]; refuses fragments of different shapes."""
    if not fragments:
        raise BadFragment("update() needs at least one fragment")
    first = fragments[0]
    parts: dict[str, list[np.ndarray]] = {
        k: [] for k in ("obs", "act", "logp", "val", "adv", "ret")
    }
    for frag in fragments:
        if frag.obs_shape != first.obs_shape or frag.actions.shape[2:] != first.actions.shape[2:]:
            raise BadFragment(
                f"fragment from {frag.actor_id!r} seq {frag.seq} has obs {frag.obs_shape} and "
                f"actions {frag.actions.shape[2:]}, the batch has {first.obs_shape} and "
                f"{first.actions.shape[2:]}: all fragments of one update must come from one env"
            )
        adv, ret = gae(
            frag.rewards, frag.values, frag.dones, frag.truncated, frag.final_values,
            frag.bootstrap_value, cfg.gamma, cfg.gae_lambda,
        )  # fmt: skip
        n = frag.num_steps
        parts["obs"].append(frag.obs.reshape(n, *frag.obs_shape))
        parts["act"].append(frag.actions.reshape(n, *frag.actions.shape[2:]))
        parts["logp"].append(frag.logprobs.reshape(n))
        parts["val"].append(frag.values.reshape(n))
        parts["adv"].append(adv.reshape(n))
        parts["ret"].append(ret.reshape(n))

    def cat(key: str) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts[key])).to(device)

    return Batch(cat("obs"), cat("act"), cat("logp"), cat("val"), cat("adv"), cat("ret"))


def lag_stats(fragments: Sequence[Fragment], current_version: int) -> dict[str, float]:
    """Policy lag (current version − the version that acted) per fragment: median, mean, max, histogram."""
    if not fragments:
        raise BadFragment("update() needs at least one fragment")
    lags = np.array([current_version - f.policy_version for f in fragments], dtype=np.int64)
    if (lags < 0).any():
        bad = next(f for f in fragments if f.policy_version > current_version)
        raise BadFragment(
            f"fragment from {bad.actor_id!r} seq {bad.seq} claims policy version "
            f"{bad.policy_version}, newer than the learner's {current_version}"
        )
    return lag_summary(lags)


def lag_summary(lags: np.ndarray) -> dict[str, float]:
    """Median, mean, max and histogram of non-negative policy lags (int64, at least one)."""
    stats = {
        "policy_lag_median": float(np.median(lags)),
        "policy_lag_mean": float(lags.mean()),
        "policy_lag_max": float(lags.max()),
    }
    for label, low, high in _LAG_BUCKETS:
        upper = np.iinfo(np.int64).max if high is None else high
        stats[f"policy_lag_hist_{label}"] = float(((lags >= low) & (lags <= upper)).sum())
    return stats


def explained_variance(predicted: torch.Tensor, target: torch.Tensor) -> float:
    """1 − Var(target − predicted)/Var(target): 1 is a perfect critic, <= 0 no better than a mean."""
    var = target.var(unbiased=False)
    if var.item() == 0:
        return float("nan")
    return float(1 - (target - predicted).var(unbiased=False) / var)


class PPOLearner:
    """Owns the optimiser and runs PPO updates on one rank; not thread-safe.

    `model` is what forward and backward go through (the policy itself, or its DDP or FSDP2
    wrapper, which reduce gradients across the group inside `backward`); `policy` is the
    unwrapped model, whose `check_fragment` refuses data from another environment.
    `forward_context` wraps every forward pass (bf16 autocast for a replicated GPU model).
    `update` trains on SequenceFragments with learner/token_ppo.py's token update, configured
    by `token_cfg` (set it before the first such update; None: derived from `cfg`).
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: PPOConfig,
        policy: PolicyModel | None = None,
        forward_context: Callable[[], contextlib.AbstractContextManager[Any]] = (
            contextlib.nullcontext
        ),
    ) -> None:
        self.model = model
        if policy is None:
            if not isinstance(model, PolicyModel):
                raise LearnerError("PPOLearner needs the policy itself beside a wrapped model")
            policy = model
        self.policy = policy
        self.cfg = cfg
        self.forward_context = forward_context
        self.token_cfg: TokenRLConfig | None = None
        self._tokens: TokenPPO | None = None
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=cfg.lr,
            eps=cfg.adam_eps,
            weight_decay=0.0,
            fused=True if self.device.type == "cuda" else None,
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def set_lr(self, lr: float) -> None:
        """Change the learning rate (annealing is the caller's: it knows the step budget)."""
        _number("lr", lr, above=0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def evaluate(
        self, obs: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probs, entropies and values [B] through the (wrapped) model's forward."""
        with self.forward_context():
            logp, entropy, values = self.model(obs, actions)
        return logp.float(), entropy.float(), values.float()

    def update(
        self,
        fragments: Sequence[AnyFragment],
        current_version: int,
        kl_sync: MetricSync | None = None,
    ) -> dict[str, float]:
        """One PPO update over `fragments`; returns losses, KL, clip fraction, lag stats, ….

        With `target_kl` set in a group, pass `kl_sync` (an all-reduce mean), so every
        rank stops at the same epoch instead of leaving the others in a collective.
        Sequence fragments go to the token update (`token_update`), which also normalises
        each minibatch's loss by the group's token count with it: pass it in every group.
        """
        sequences = [f for f in fragments if isinstance(f, SequenceFragment)]
        if sequences:
            if len(sequences) != len(fragments):
                raise BadFragment("one update cannot mix step fragments and sequence fragments")
            return self.token_update(sequences, current_version, kl_sync)
        return self.step_update(
            [f for f in fragments if isinstance(f, Fragment)], current_version, kl_sync
        )

    def token_update(
        self,
        fragments: Sequence[SequenceFragment],
        current_version: int,
        kl_sync: MetricSync | None = None,
    ) -> dict[str, float]:
        """learner/token_ppo.py's update through this learner's (wrapped) model and optimiser."""
        # both build on this module, so they are imported when first needed
        from shoal.learner.token_config import TokenRLConfig
        from shoal.learner.token_ppo import TokenPPO

        if self._tokens is None:
            cfg = self.token_cfg or TokenRLConfig.from_ppo(self.cfg)
            self._tokens = TokenPPO(
                self.policy,
                cfg,
                self.optimizer,
                forward_context=self.forward_context,
                model=self.model,
            )
        return self._tokens.update(fragments, current_version, kl_sync)

    def step_update(
        self,
        fragments: Sequence[Fragment],
        current_version: int,
        kl_sync: MetricSync | None = None,
    ) -> dict[str, float]:
        """One PPO update over step fragments (see `update`)."""
        cfg = self.cfg
        metrics = lag_stats(fragments, current_version)
        batch = build_batch(fragments, cfg, self.device)
        if batch.size < cfg.num_minibatches:
            raise BadFragment(
                f"update() got {batch.size} steps, fewer than ppo.num_minibatches = "
                f"{cfg.num_minibatches}: collect more steps per update or use fewer minibatches"
            )
        first = fragments[0]
        self.policy.check_fragment(first.obs_shape, first.actions, first.obs.dtype)
        order = torch.arange(batch.size, device=self.device)
        with torch.no_grad():
            prox_logp = torch.cat(
                [
                    self.evaluate(batch.obs[idx], batch.actions[idx])[0]
                    for idx in order.tensor_split(cfg.num_minibatches)
                ]
            )
            raw_weights = torch.exp(prox_logp - batch.behaviour_logp)
            weights = raw_weights.clamp(max=cfg.is_cap)
            capped = (raw_weights > cfg.is_cap).float().mean()
        sums: dict[str, float] = {}
        steps = 0
        epochs = 0
        for _ in range(cfg.update_epochs):
            epochs += 1
            kl_epoch = 0.0
            for idx in torch.randperm(batch.size, device=self.device).tensor_split(
                cfg.num_minibatches
            ):
                out = self.minibatch_step(batch, idx, prox_logp, weights)
                for key, value in out.items():
                    sums[key] = sums.get(key, 0.0) + value
                kl_epoch += out["approx_kl"]
                steps += 1
            if cfg.target_kl is not None:
                kl = torch.tensor(kl_epoch / cfg.num_minibatches, device=self.device)
                if kl_sync is not None:
                    kl = kl_sync(kl)
                if kl.item() > cfg.target_kl:
                    break
        metrics.update({key: value / steps for key, value in sums.items()})
        metrics.update(
            {
                "explained_variance": explained_variance(batch.values, batch.returns),
                "is_weight_mean": float(weights.mean()),
                "is_weight_capped_frac": float(capped),
                "epochs": float(epochs),
                "num_steps": float(batch.size),
                "num_fragments": float(len(fragments)),
                "lr": float(self.optimizer.param_groups[0]["lr"]),
            }
        )
        return metrics

    def minibatch_step(
        self,
        batch: Batch,
        idx: torch.Tensor,
        prox_logp: torch.Tensor,
        weights: torch.Tensor,
    ) -> dict[str, float]:
        """Loss, backward (gradients reduced there in a group), clip and step for one
        minibatch; returns its statistics."""
        cfg = self.cfg
        new_logp, entropy, new_values = self.evaluate(batch.obs[idx], batch.actions[idx])
        log_ratio = new_logp - prox_logp[idx]
        ratio = log_ratio.exp()
        adv = batch.advantages[idx]
        if cfg.norm_adv and adv.numel() > 1:
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        surrogate = torch.max(
            -adv * ratio, -adv * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)
        )
        pg_loss = (weights[idx] * surrogate).mean()
        v_loss = value_loss(new_values, batch.values[idx], batch.returns[idx], cfg)
        ent = entropy.mean()
        loss = pg_loss - cfg.ent_coef * ent + cfg.vf_coef * v_loss

        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = full_tensor(
            nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        )
        self.optimizer.step()

        with torch.no_grad():
            approx_kl = ((ratio - 1) - log_ratio).mean()
            clipfrac = ((ratio - 1).abs() > cfg.clip_coef).float().mean()
        return {
            "loss": loss.item(),
            "policy_loss": pg_loss.item(),
            "value_loss": v_loss.item(),
            "entropy": ent.item(),
            "approx_kl": approx_kl.item(),
            "clipfrac": clipfrac.item(),
            "grad_norm": float(grad_norm),
        }


def value_loss(
    new_values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, cfg: PPOConfig
) -> torch.Tensor:
    """½ squared error to the returns, clipped around the behaviour values when `clip_vloss`."""
    unclipped = (new_values - returns).pow(2)
    if not cfg.clip_vloss:
        return 0.5 * unclipped.mean()
    clipped_values = old_values + (new_values - old_values).clamp(-cfg.clip_coef, cfg.clip_coef)
    return 0.5 * torch.max(unclipped, (clipped_values - returns).pow(2)).mean()
