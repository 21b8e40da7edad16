"""`TokenRLConfig`: the token update's hyper-parameters (a job's `[token]` section), checked on
construction so a hostile or mistyped value is refused with a ConfigError naming the key."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal

from shoal.errors import ConfigError
from shoal.learner.ppo import PPOConfig

Algo = Literal["ppo", "grpo"]
LossNorm = Literal["token", "sequence"]
MAX_GROUP_SIZE = 4096


@dataclass
class TokenRLConfig:
    """The token update's hyper-parameters (the `[token]` section of a job)."""

    algo: Algo = "grpo"
    """"grpo" (group-normalised rewards, no critic) or "ppo" (value head + GAE)."""
    group_size: int = 4
    """Completions sampled per prompt; GRPO refuses a group of another size (>= 2 for GRPO)."""
    temperature: float = 1.0
    """The actors' sampling temperature: log-probs are recomputed under softmax(logits / it)."""
    lr: float = 1e-4
    """AdamW learning rate when TokenPPO owns its optimiser (under PPOLearner: ppo.lr)."""
    adam_eps: float = 1e-8
    clip_coef: float = 0.2
    """PPO's ratio clip ε around π_prox (also the value clip when clip_vloss)."""
    is_cap: float = 2.0
    """Cap on the per-token importance weight π_prox/μ (>= 1)."""
    update_epochs: int = 1
    """Passes over the batch per update."""
    num_minibatches: int = 1
    """Minibatches (of whole completions) per epoch."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the frozen reference policy; 0 keeps no reference."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus."""
    vf_coef: float = 0.5
    """Weight of the value loss (ppo only)."""
    gamma: float = 1.0
    """Discount over completion tokens (ppo only)."""
    gae_lambda: float = 0.95
    """GAE's λ over completion tokens (ppo only)."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip."""
    target_kl: float | None = None
    """Stop the epochs early once an epoch's approximate KL to π_prox exceeds this (averaged
    over a learner group's ranks); None never stops."""
    clip_vloss: bool = True
    """Clip the value update around the behaviour values (ppo only)."""
    norm_adv: bool = True
    """Whiten the token advantages per minibatch (ppo only; GRPO's are normalised per group)."""
    adv_eps: float = 1e-6
    """GRPO's eps in (r − mean) / (std + eps): a group whose rewards are all equal gets 0."""
    loss_norm: LossNorm = "token"
    """"token": mean over the minibatch's completion tokens; "sequence": per completion first
    (see the module docstring for why token is the default)."""

    def __post_init__(self) -> None:
        if self.algo not in ("ppo", "grpo"):
            raise ConfigError(f"token.algo = {self.algo!r:.40} is invalid: use 'ppo' or 'grpo'")
        if self.loss_norm not in ("token", "sequence"):
            raise ConfigError(
                f"token.loss_norm = {self.loss_norm!r:.40} is invalid: use 'token' or 'sequence'"
            )
        low = 2 if self.algo == "grpo" else 1
        _integer("group_size", self.group_size, low, MAX_GROUP_SIZE)
        _integer("update_epochs", self.update_epochs, 1, 1000)
        _integer("num_minibatches", self.num_minibatches, 1, 1 << 16)
        _real("temperature", self.temperature, low=0, open_low=True, high=100)
        for key in ("lr", "adam_eps", "clip_coef", "max_grad_norm", "adv_eps"):
            _real(key, getattr(self, key), low=0, open_low=True)
        for key in ("kl_coef", "ent_coef", "vf_coef"):
            _real(key, getattr(self, key), low=0)
        for key in ("gamma", "gae_lambda"):
            _real(key, getattr(self, key), low=0, high=1)
        _real("is_cap", self.is_cap, low=1)
        if self.target_kl is not None:
            _real("target_kl", self.target_kl, low=0, open_low=True)
        for key in ("clip_vloss", "norm_adv"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"token.{key} must be true or false")

    @classmethod
    def from_ppo(cls, ppo: PPOConfig, **overrides: Any) -> TokenRLConfig:
        """The shared hyper-parameters taken from a `[ppo]` section, the rest defaulted or given."""
        shared = {f.name for f in fields(cls)} & {f.name for f in fields(PPOConfig)}
        shared -= {"gamma"}  # steps are discounted, completion tokens are not
        return cls(**{**{k: getattr(ppo, k) for k in shared}, **overrides})


def _integer(key: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(
            f"token.{key} = {value!r:.40} is invalid: use an integer from {low} to {high}"
        )


def _real(
    key: str, value: object, low: float, high: float = math.inf, open_low: bool = False
) -> None:
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    if not (math.isfinite(number) and low <= number <= high) or (open_low and number == low):
        above = f"> {low:g}" if open_low else f">= {low:g}"
        bound = f" and <= {high:g}" if math.isfinite(high) else ""
        raise ConfigError(
            f"token.{key} = {value!r:.40} is invalid: use a finite number {above}{bound}"
        )
