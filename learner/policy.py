"""`ActorCritic`: the MLP policy and value function every rollout actor and learner shares.

Two separate tanh MLPs (policy and value), orthogonally initialised as in CleanRL: small gains on
the output layers start the policy near uniform and the value near zero, which is what lets PPO
solve CartPole-class tasks in a few updates. Rollout actors call `act` on numpy batches under
`torch.inference_mode` (no autograd bookkeeping); the learner calls `evaluate_actions` with grads.
Weights travel as `get_weights()` (name -> numpy array), never pickled.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from shoal.learner.errors import PolicyError

_LOG_2PI = math.log(2.0 * math.pi)


def _layer(n_in: int, n_out: int, gain: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.constant_(layer.bias, 0.0)
    return layer


def _mlp(n_in: int, hidden: tuple[int, ...], n_out: int, out_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = n_in
    for size in hidden:
        layers += [_layer(width, size, math.sqrt(2.0)), nn.Tanh()]
        width = size
    layers.append(_layer(width, n_out, out_gain))
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """Policy π(a|s) and value V(s) for a Box observation space and a Discrete or Box action space.

    Discrete actions: a categorical over logits; actions are int64 [B]. Box actions: a diagonal
    Gaussian with a state-independent learned log-std; actions are float32 [B, A], unclipped (the
    environment clips to its bounds, the log-prob stays that of the sampled action).
    Not thread-safe: one owner calls it at a time.
    """

    def __init__(
        self,
        obs_shape: tuple[int, ...],
        action_space: spaces.Space[Any],
        hidden: tuple[int, ...] = (64, 64),
    ) -> None:
        super().__init__()
        self.obs_shape = tuple(int(d) for d in obs_shape)
        if not self.obs_shape or any(d < 1 for d in self.obs_shape):
            raise PolicyError(f"obs_shape must be non-empty with positive sizes, got {obs_shape}")
        if not hidden or any(h < 1 for h in hidden):
            raise PolicyError(f"hidden must list positive layer widths, got {hidden}")
        self.hidden = tuple(int(h) for h in hidden)
        self.obs_dim = math.prod(self.obs_shape)
        self.action_space = action_space
        if isinstance(action_space, spaces.Discrete):
            self.discrete = True
            self.action_dim = int(action_space.n)
            self.actor = _mlp(self.obs_dim, self.hidden, self.action_dim, 0.01)
        elif isinstance(action_space, spaces.Box) and len(action_space.shape) == 1:
            self.discrete = False
            self.action_dim = int(action_space.shape[0])
            self.actor = _mlp(self.obs_dim, self.hidden, self.action_dim, 0.01)
            self.log_std = nn.Parameter(torch.zeros(self.action_dim))
        else:
            raise PolicyError(
                f"ActorCritic supports Discrete or 1-D Box action spaces, got {action_space}"
            )
        self.critic = _mlp(self.obs_dim, self.hidden, 1, 1.0)

    # -- inference on numpy batches (rollout actors) -------------------------------------

    def act(
        self, obs: np.ndarray, deterministic: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sample actions for a batch [B, *obs_shape]; returns (actions, logprobs [B], values [B]).

        `deterministic` takes the mode (argmax or the Gaussian mean), for evaluation.
        """
        with torch.inference_mode():
            x = self._obs_tensor(obs)
            out = self.actor(x)
            values = self.critic(x).squeeze(-1)
            if self.discrete:
                log_probs = torch.log_softmax(out, dim=-1)
                actions = out.argmax(dim=-1) if deterministic else self._sample(log_probs.exp())
                logp = log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
                actions_np = actions.cpu().numpy()
            else:
                std = self.log_std.exp()
                sampled = out if deterministic else out + std * torch.randn_like(out)
                logp = self._gaussian_logp(out, sampled)
                actions_np = sampled.cpu().numpy()
            return actions_np, logp.cpu().numpy(), values.cpu().numpy()

    def value(self, obs: np.ndarray) -> np.ndarray:
        """V(s) for a batch [B, *obs_shape] as float32 [B] (bootstrap and time-limit values)."""
        with torch.inference_mode():
            return self.critic(self._obs_tensor(obs)).squeeze(-1).cpu().numpy()

    # -- training (the learner) ----------------------------------------------------------

    def evaluate_actions(
        self, obs: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probs, entropies and values [B] of given actions, with autograd, for the PPO loss."""
        x = obs.reshape(obs.shape[0], self.obs_dim)
        out = self.actor(x)
        values = self.critic(x).squeeze(-1)
        if self.discrete:
            log_probs = torch.log_softmax(out, dim=-1)
            logp = log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
        else:
            logp = self._gaussian_logp(out, actions)
            entropy = (0.5 + 0.5 * _LOG_2PI + self.log_std).sum().expand(out.shape[0])
        return logp, entropy, values

    # -- weights on the wire and in checkpoints ------------------------------------------

    def get_weights(self) -> dict[str, np.ndarray]:
        """A copy of every parameter as numpy (safe to ship while training goes on)."""
        return {k: v.detach().cpu().numpy().copy() for k, v in self.state_dict().items()}

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Load `get_weights()` output; raises PolicyError naming the first key or shape that differs."""
        own = self.state_dict()
        missing = sorted(set(own) - set(weights))
        unknown = sorted(set(weights) - set(own))
        if missing or unknown:
            raise PolicyError(
                f"weights don't fit this policy: missing {missing}, unknown {unknown}; "
                "were they exported from a policy with the same spaces and hidden sizes?"
            )
        with torch.no_grad():
            for name, tensor in own.items():
                array = np.asarray(weights[name])
                if tuple(array.shape) != tuple(tensor.shape):
                    raise PolicyError(
                        f"weight {name!r} has shape {list(array.shape)}, this policy needs "
                        f"{list(tensor.shape)}"
                    )
                tensor.copy_(torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)))

    def spec(self) -> dict[str, Any]:
        """Plain values that rebuild an identical architecture with `from_spec` (for checkpoints)."""
        space: dict[str, Any]
        if self.discrete:
            space = {"kind": "discrete", "n": self.action_dim}
        else:
            box = self.action_space
            assert isinstance(box, spaces.Box)
            space = {
                "kind": "box",
                "low": [float(v) for v in box.low],
                "high": [float(v) for v in box.high],
            }
        return {
            "obs_shape": list(self.obs_shape),
            "action_space": space,
            "hidden": list(self.hidden),
        }

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> ActorCritic:
        """Build the architecture `spec()` described (weights are fresh; load them after)."""
        try:
            space_spec = spec["action_space"]
            kind = space_spec["kind"]
            if kind == "discrete":
                space: spaces.Space[Any] = spaces.Discrete(int(space_spec["n"]))
            elif kind == "box":
                low = np.asarray(space_spec["low"], dtype=np.float32)
                high = np.asarray(space_spec["high"], dtype=np.float32)
                space = spaces.Box(low, high, dtype=np.float32)
            else:
                raise PolicyError(f"unknown action space kind {kind!r}; valid: 'discrete', 'box'")
            return cls(tuple(spec["obs_shape"]), space, tuple(spec["hidden"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise PolicyError(f"malformed policy spec {spec!r}: {exc}") from exc

    # -- helpers -------------------------------------------------------------------------

    def _obs_tensor(self, obs: np.ndarray) -> torch.Tensor:
        array = np.asarray(obs, dtype=np.float32)
        if array.shape[1:] != self.obs_shape and array.shape[1:] != (self.obs_dim,):
            raise PolicyError(
                f"observations must be [B, {', '.join(map(str, self.obs_shape))}], got "
                f"{list(array.shape)}"
            )
        tensor = torch.from_numpy(array).reshape(array.shape[0], self.obs_dim)
        device = next(self.critic.parameters()).device
        return tensor if device.type == "cpu" else tensor.to(device)

    def _sample(self, probs: torch.Tensor) -> torch.Tensor:
        """Inverse-CDF sampling: 4x cheaper than torch.multinomial for a batch of small categoricals."""
        u = torch.rand(probs.shape[0], 1, device=probs.device)
        return (probs.cumsum(-1) < u).sum(-1).clamp_(max=self.action_dim - 1)

    def _gaussian_logp(self, mean: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        z = (actions - mean) / self.log_std.exp()
        return (-0.5 * z.pow(2) - self.log_std - 0.5 * _LOG_2PI).sum(-1)
