"""`PolicyModel`: the one interface rollout actors and learners use for every family of policy.

A family says how observations become action logits (or Gaussian means) and values
(`heads`), how wire observations become the tensor its network takes (`prepare`), and which of
its submodules are the units a sharded learner wraps one by one (`shard_units`). Everything
else (sampling on numpy batches, log-probs and entropies for PPO, weights on the wire, the
spec that rebuilds the architecture from a checkpoint, the fragment check) is written once,
here, so the families cannot drift apart.

`forward(obs, actions)` is the training path: it goes through `nn.Module.__call__`, which is
where DDP and FSDP2 hook in. Rollout actors call `act`/`value` on numpy batches under
`torch.inference_mode` (no autograd bookkeeping). Weights travel as name -> numpy array (never
pickled), unsharded.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Self, cast

import numpy as np
import torch
from gymnasium import spaces
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from shoal.learner.errors import BadFragment, PolicyError
from shoal.learner.models.config import LIMITS, MAX_LAYERS
from shoal.learner.models.spaces import space_to_json

_LOG_2PI = math.log(2.0 * math.pi)

PRECISIONS: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The dtypes a rollout worker may sample in (`rollout.precision`); learners train in float32."""


def action_layout(action_space: spaces.Space[Any]) -> tuple[bool, int]:
    """(discrete, action_dim) of a Discrete or 1-D Box action space; PolicyError otherwise."""
    if isinstance(action_space, spaces.Discrete):
        return True, int(action_space.n)
    if isinstance(action_space, spaces.Box) and len(action_space.shape) == 1:
        return False, int(action_space.shape[0])
    raise PolicyError(f"policies support Discrete or 1-D Box action spaces, got {action_space}")


def check_widths(
    family: str, key: str, widths: tuple[int, ...], most: int = MAX_LAYERS
) -> tuple[int, ...]:
    """`widths` (a family's `hidden` or `channels`: one layer each) when it lists 1 to `most`
    integers within `LIMITS[key]`; else PolicyError naming the family and the key. A spec is
    read back from storage, so this holds for a rebuilt model as for a new one."""
    low, high = LIMITS[key]
    widths = tuple(widths)
    if not 1 <= len(widths) <= most or any(
        isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high for v in widths
    ):
        raise PolicyError(
            f"{family} {key} must list 1 to {most} widths from {low} to {high}, got {widths}"
        )
    return widths


class PolicyModel(nn.Module):
    """π(a|s) and V(s) for one observation space and a Discrete or 1-D Box action space.

    Discrete actions: a categorical over logits; actions are int64 [B]. Box actions: a diagonal
    Gaussian with a state-independent learned `log_std` (the family creates it); actions are
    float32 [B, A], unclipped (the environment clips, the log-prob stays the sampled one's).
    Not thread-safe: one owner calls it at a time.
    """

    family: ClassVar[str] = ""
    cpu_autocast: ClassVar[bool] = False
    """Whether a CPU learner's step gets faster under bf16 autocast (`learner.mixed_precision`
    on a CPU with bf16 instructions): measured per family, docs/benchmarks.md."""
    compute_dtype: torch.dtype = torch.float32
    """The dtype `prepare` gives floating inputs: the weights' dtype, which `run_in` sets."""
    obs_dtype: np.dtype[Any]
    discrete: bool
    action_dim: int
    log_std: nn.Parameter

    def __init__(
        self,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
        obs_dtype: type[np.generic],
    ) -> None:
        super().__init__()
        shape = observation_space.shape
        if not shape or any(int(d) < 1 for d in shape):
            raise PolicyError(
                f"observations must have a non-empty shape with positive sizes, got {shape}"
            )
        self.observation_space = observation_space
        self.action_space = action_space
        self.obs_shape = tuple(int(d) for d in shape)
        self.obs_dtype = np.dtype(obs_dtype)
        self.discrete, self.action_dim = action_layout(action_space)
        self.custom_factory: tuple[str, dict[str, Any]] | None = None

    # -- what a family provides ----------------------------------------------------------

    def prepare(self, obs: torch.Tensor) -> torch.Tensor:
        """Wire observations [B, *obs_shape] on the model's device -> the network's input."""
        raise NotImplementedError

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits or Gaussian means [B, A], values [B]) for prepared observations."""
        raise NotImplementedError

    def values_of(self, x: torch.Tensor) -> torch.Tensor:
        """Values [B] alone; a family with a separate critic overrides this to skip the actor."""
        return self.heads(x)[1]

    def shard_units(self) -> list[nn.Module]:
        """The submodules a sharded learner wraps one by one (then the root)."""
        raise NotImplementedError

    def init_module(self, module: nn.Module) -> None:
        """Give `module`'s own parameters and buffers (not its children's) the values a fresh
        build would draw: what a deferred build (learner/materialize.py) calls once the module
        has storage. Only the families materialize.py defers implement it."""
        raise NotImplementedError

    spec_keys: ClassVar[tuple[str, ...]] = ()
    """The constructor's width-list arguments after the spaces, in order (`hidden`; the cnn's
    `channels`, `hidden`), each kept as an attribute of the same name: what `family_spec`
    stores and `from_spec` passes back, so a checkpoint rebuilds the same architecture."""

    @classmethod
    def from_spec(
        cls,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
        spec: Mapping[str, Any],
    ) -> Self:
        """The family's model rebuilt from a stored spec (read back from storage, so each key
        is checked to be a list before the constructor checks its widths)."""
        widths: list[tuple[Any, ...]] = []
        for key in cls.spec_keys:
            value = spec.get(key)
            if not isinstance(value, list):
                raise PolicyError(
                    f"{cls.family} spec: {key} must be a list of widths, got {value!r:.80}"
                )
            widths.append(tuple(value))
        build: Callable[..., Self] = cls  # a family's constructor: the spaces, then spec_keys
        return build(observation_space, action_space, *widths)

    def family_spec(self) -> dict[str, Any]:
        """The family's own keys of `spec()` (sizes), JSON-able."""
        return {key: list(getattr(self, key)) for key in self.spec_keys}

    def accepts_obs_shape(self, obs_shape: tuple[int, ...]) -> bool:
        """Whether wire observations of this shape fit (the MLP also takes them flattened)."""
        return obs_shape == self.obs_shape

    # -- training ------------------------------------------------------------------------

    def forward(
        self, obs: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probs, entropies and values [B] of given actions, with autograd, for the PPO loss."""
        device = self.device
        out, values = self.heads(self.prepare(obs.to(device)))
        actions = actions.to(device)
        if self.discrete:
            log_probs = torch.log_softmax(out.float(), dim=-1)
            logp = log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
        else:
            logp = self._gaussian_logp(out, actions)
            entropy = (0.5 + 0.5 * _LOG_2PI + self.log_std).sum().expand(out.shape[0])
        return logp, entropy, values

    def enable_activation_checkpointing(self) -> None:
        """Recompute each shard unit's activations in backward instead of keeping them.

        The unit's `forward` is wrapped on the instance, so parameter names do not change and
        FSDP2's hooks (on `__call__`) still run; without grad (rollout) it runs as before.
        """
        for unit in self.shard_units():
            unit.forward = functools.partial(_checkpointed, unit.forward)

    # -- inference on numpy batches (rollout actors) -------------------------------------

    def run_in(self, precision: str) -> Self:
        """Cast every weight to `precision` (a `PRECISIONS` key) for sampling; returns self.

        Why bfloat16 on a rollout worker: the forward reads half the weight bytes, so on a
        GPU or a CPU with AVX512-BF16 a conv net's costs about a quarter less (the Nature CNN
        on Pong, `shoal bench precision`) while the learner keeps training in float32. The two
        policies then differ by rounding; the learner recomputes π_prox in float32 and the decoupled
        importance weight π_prox/μ (capped) corrects for it as it does for staleness. Logits,
        log-probs and values leave `act` as float32. A family that ignores `compute_dtype`
        fails here, on a probe batch, with a PolicyError, not in the first fragment.
        """
        dtype = PRECISIONS.get(precision)
        if dtype is None:
            raise PolicyError(
                f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}"
            )
        if dtype == self.compute_dtype:
            return self
        self.to(dtype)
        for module in self.modules():
            if hasattr(module, "compute_dtype"):
                cast(Any, module).compute_dtype = dtype
        probe = np.zeros((1, *self.obs_shape), self.obs_dtype)
        try:
            self.act(probe, deterministic=True)
        except (RuntimeError, TypeError) as exc:
            raise PolicyError(
                f"the {self.family or 'custom'} policy does not run in {precision} ({exc}); "
                'set rollout.precision = "float32"'
            ) from exc
        return self

    def act(
        self, obs: np.ndarray, deterministic: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sample actions for a batch [B, *obs_shape]; returns (actions, logprobs [B], values [B]).

        `deterministic` takes the mode (argmax or the Gaussian mean), for evaluation.
        """
        with torch.inference_mode():
            out, values = self.heads(self.prepare(self._obs_tensor(obs)))
            out = out.float()
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
            return actions_np, logp.cpu().numpy(), values.float().cpu().numpy()

    def value(self, obs: np.ndarray) -> np.ndarray:
        """V(s) for a batch [B, *obs_shape] as float32 [B] (bootstrap and time-limit values)."""
        with torch.inference_mode():
            values = self.values_of(self.prepare(self._obs_tensor(obs)))
            return values.float().cpu().numpy()

    # -- weights on the wire and in checkpoints ------------------------------------------

    def get_weights(self) -> dict[str, np.ndarray]:
        """A full (unsharded) copy of every tensor as numpy, safe to ship while training goes on.

        bfloat16 tensors are widened to float32 (numpy has no bfloat16).
        """
        out: dict[str, np.ndarray] = {}
        for name, tensor in self.state_dict().items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            full = full.detach().cpu()
            if full.dtype == torch.bfloat16:
                full = full.float()
            out[name] = full.numpy().copy()
        return out

    def set_weights(self, weights: Mapping[str, np.ndarray | torch.Tensor]) -> None:
        """Load full weights (numpy or torch, any float dtype incl. bfloat16, cast to each
        tensor's own dtype); PolicyError naming the first key or shape that differs."""
        own = self.state_dict()
        missing = sorted(set(own) - set(weights))
        unknown = sorted(set(weights) - set(own))
        if missing or unknown:
            raise PolicyError(
                f"weights don't fit this policy: missing {missing[:8]}, unknown {unknown[:8]}; "
                "were they exported from a policy of the same family, spaces and sizes?"
            )
        with torch.no_grad():
            for name, tensor in own.items():
                source = _as_tensor(name, weights[name])
                if tuple(source.shape) != tuple(tensor.shape):
                    raise PolicyError(
                        f"weight {name!r} has shape {list(source.shape)}, this policy needs "
                        f"{list(tensor.shape)}"
                    )
                if isinstance(tensor, DTensor):
                    source = distribute_tensor(
                        source.to(tensor.device, tensor.dtype),
                        tensor.device_mesh,
                        tensor.placements,
                    )
                tensor.copy_(source)  # casts as it copies: no whole-tensor temporary

    def spec(self) -> dict[str, Any]:
        """Plain JSON values that `model_from_spec` rebuilds this architecture from (fresh
        weights; load them after), stored with every checkpoint."""
        family = self.family
        extra: dict[str, Any] = {}
        if self.custom_factory is not None:
            family, options = self.custom_factory
            extra = {"options": options}
        return {
            "family": family,
            "observation_space": space_to_json(self.observation_space),
            "action_space": space_to_json(self.action_space),
            **self.family_spec(),
            **extra,
        }

    def check_fragment(
        self,
        obs_shape: tuple[int, ...],
        actions: np.ndarray,
        obs_dtype: np.dtype[Any] | None = None,
    ) -> None:
        """Refuse a fragment from another environment before it reaches the network.

        `actions` is the fragment's [T, N] or [T, N, A] array; discrete actions must also be
        in 0..n-1, or the log-prob gather would index out of range.
        """
        obs_ok = self.accepts_obs_shape(tuple(obs_shape)) and (
            obs_dtype is None or np.dtype(obs_dtype) == self.obs_dtype
        )
        if self.discrete:
            actions_ok = actions.dtype == np.int64 and actions.ndim == 2
            actions_ok = actions_ok and (
                actions.size == 0 or (actions.min() >= 0 and actions.max() < self.action_dim)
            )
        else:
            actions_ok = actions.dtype == np.float32 and actions.shape[2:] == (self.action_dim,)
        if not (obs_ok and actions_ok):
            kind = "discrete actions 0.." if self.discrete else "continuous actions of size "
            raise BadFragment(
                f"fragment (obs {list(obs_shape)} {obs_dtype or ''}, actions {actions.dtype} "
                f"{list(actions.shape[2:])}) does not fit the {self.family or 'custom'} policy "
                f"(obs {list(self.obs_shape)} {self.obs_dtype}, {kind}"
                f"{self.action_dim - 1 if self.discrete else self.action_dim}): is the actor "
                "running another environment?"
            )

    # -- helpers -------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def _obs_tensor(self, obs: np.ndarray) -> torch.Tensor:
        array = np.asarray(obs)
        if array.ndim < 1 or not self.accepts_obs_shape(tuple(array.shape[1:])):
            raise PolicyError(
                f"observations must be [B, {', '.join(map(str, self.obs_shape))}], got "
                f"{list(array.shape)}"
            )
        if self.obs_dtype.kind != "f" and array.dtype.kind not in "iu":
            raise PolicyError(
                f"the {self.family} policy takes integer observations ({self.obs_dtype}), got "
                f"{array.dtype}"
            )
        tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=self.obs_dtype))
        device = self.device
        return tensor if device.type == "cpu" else tensor.to(device)

    def _sample(self, probs: torch.Tensor) -> torch.Tensor:
        """Inverse-CDF sampling: 4x cheaper than torch.multinomial for a batch of small categoricals."""
        u = torch.rand(probs.shape[0], 1, device=probs.device)
        return (probs.cumsum(-1) < u).sum(-1).clamp_(max=self.action_dim - 1)

    def _gaussian_logp(self, mean: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        z = (actions - mean) / self.log_std.exp()
        return (-0.5 * z.pow(2) - self.log_std - 0.5 * _LOG_2PI).sum(-1)


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _as_tensor(name: str, value: object) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        full = value.full_tensor() if isinstance(value, DTensor) else value
        return full.detach()
    array = np.asarray(value)
    if array.dtype.kind not in "biuf":
        raise PolicyError(f"weight {name!r} has dtype {array.dtype}: send numbers")
    return torch.from_numpy(np.ascontiguousarray(array))
