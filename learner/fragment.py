"""`Fragment`: T steps of one rollout actor over its N environments, the unit the learner trains on.

A fragment travels from a rollout actor to a learner as a dict of plain values and numpy arrays
(`to_wire`), which the runtime's wire format carries without pickle. Every array's dtype and shape
is checked on `from_wire` and on construction, so a malformed fragment from a buggy or hostile peer
is refused with `BadFragment` at the door instead of breaking a PPO update later.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from shoal.learner.errors import BadFragment

# field -> required dtype; the actions' dtype depends on the action space (see _check_actions)
_STEP_ARRAYS: dict[str, type[np.generic]] = {
    "logprobs": np.float32,
    "values": np.float32,
    "rewards": np.float32,
    "dones": np.bool_,
    "truncated": np.bool_,
    "final_values": np.float32,
}
OBS_DTYPES = (np.dtype(np.float32), np.dtype(np.uint8), np.dtype(np.int64))
"""What observations travel as: float32 (mlp), uint8 images (cnn), int64 token ids (causal-lm)."""
_SCALARS: dict[str, type] = {
    "actor_id": str,
    "seq": int,
    "policy_version": int,
    "env_hash": str,
    "policy_source": str,
}
MAX_SOURCE_CHARS = 64


@dataclass
class Fragment:
    """One actor's T×N steps with the behaviour policy's log-probs and values.

    Shapes: obs [T, N, *obs_shape] in the policy's observation dtype (float32 vectors, uint8
    images, int64 token ids; see `OBS_DTYPES`); actions [T, N] int64 (discrete) or [T, N, A] float32
    (continuous); logprobs, values, rewards, final_values [T, N] float32; dones, truncated [T, N]
    bool; bootstrap_value [N] float32 (value of the observation after the last step);
    episode_returns float32 [k] and episode_lengths int32 [k] for the k episodes that ended inside.
    `dones` is True at every episode end (terminal or time limit); `truncated` marks the time-limit
    ones, where `final_values` holds the value of the final observation so GAE can bootstrap.
    """

    actor_id: str
    seq: int
    policy_version: int
    env_hash: str
    obs: np.ndarray
    actions: np.ndarray
    logprobs: np.ndarray
    values: np.ndarray
    rewards: np.ndarray
    dones: np.ndarray
    truncated: np.ndarray
    bootstrap_value: np.ndarray
    final_values: np.ndarray
    episode_returns: np.ndarray
    episode_lengths: np.ndarray
    policy_source: str = ""
    """The learner incarnation whose weights acted (empty: none known). A version number only
    means something within one lineage of weights: after a restart from a checkpoint at
    version V, the old incarnation's V+1 is not the new one's (see Intake.is_stale)."""

    def __post_init__(self) -> None:
        self._validate()

    @property
    def num_envs(self) -> int:
        return int(self.rewards.shape[1])

    @property
    def horizon(self) -> int:
        """T, the number of steps each environment took in this fragment."""
        return int(self.rewards.shape[0])

    @property
    def num_steps(self) -> int:
        """T*N: how many environment steps this fragment holds."""
        return self.horizon * self.num_envs

    @property
    def obs_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.obs.shape[2:])

    def to_wire(self) -> dict[str, Any]:
        """A dict of str/int values and numpy arrays, ready for the runtime's wire codec (no copies)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_wire(cls, payload: object) -> Fragment:
        """Rebuild a fragment from `to_wire`'s dict; raises BadFragment naming the first wrong field."""
        if not isinstance(payload, dict):
            raise BadFragment(f"a fragment must arrive as a dict, got {type(payload).__name__}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in payload]
        if missing:
            raise BadFragment(f"fragment is missing field(s) {missing}; a fragment has {names}")
        unknown = sorted(set(payload) - set(names))
        if unknown:
            raise BadFragment(f"fragment has unknown field(s) {unknown}; a fragment has {names}")
        return cls(**{n: payload[n] for n in names})

    def _validate(self) -> None:
        for name, kind in _SCALARS.items():
            value = getattr(self, name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise BadFragment(f"fragment.{name} must be {kind.__name__}, got {value!r}")
        if len(self.policy_source) > MAX_SOURCE_CHARS:
            raise BadFragment(
                f"fragment.policy_source has {len(self.policy_source)} characters, at most "
                f"{MAX_SOURCE_CHARS}"
            )
        if self.seq < 0 or self.policy_version < 0:
            raise BadFragment(
                f"fragment.seq and policy_version must be >= 0, got {self.seq}, {self.policy_version}"
            )
        for name in (*_STEP_ARRAYS, "obs", "actions", "bootstrap_value"):
            _array(name, getattr(self, name))
        rewards = self.rewards
        if rewards.ndim != 2 or rewards.shape[0] < 1 or rewards.shape[1] < 1:
            raise BadFragment(
                f"fragment.rewards must be [T, N] with T, N >= 1, got {rewards.shape}"
            )
        tn = rewards.shape
        for name, dtype in _STEP_ARRAYS.items():
            _check(name, getattr(self, name), dtype, tn)
        if self.obs.ndim < 2 or self.obs.shape[:2] != tn:
            raise BadFragment(
                f"fragment.obs must be [T, N, *obs_shape] = [{tn[0]}, {tn[1]}, ...], got {self.obs.shape}"
            )
        if self.obs.dtype not in OBS_DTYPES:
            raise BadFragment(
                f"fragment.obs must have dtype float32, uint8 or int64, got {self.obs.dtype}"
            )
        _check_actions(self.actions, tn)
        _check("bootstrap_value", self.bootstrap_value, np.float32, (tn[1],))
        _check_episodes(self.episode_returns, self.episode_lengths)
        _check_finite(self)


def _check_finite(fragment: Fragment) -> None:
    """A NaN or infinity would poison every weight it touches; refuse it with its field's name."""
    for name in ("obs", "logprobs", "values", "rewards", "bootstrap_value", "final_values"):
        array = getattr(fragment, name)
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise BadFragment(
                f"fragment.{name} holds NaN or infinite values; the actor's policy or environment is broken"
            )
    if fragment.actions.dtype == np.float32 and not np.isfinite(fragment.actions).all():
        raise BadFragment("fragment.actions holds NaN or infinite values")


def _array(name: str, value: object) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise BadFragment(f"fragment.{name} must be a numpy array, got {type(value).__name__}")
    return value


def _check_dtype(name: str, array: np.ndarray, dtype: type[np.generic]) -> None:
    if array.dtype != dtype:
        raise BadFragment(f"fragment.{name} must have dtype {np.dtype(dtype)}, got {array.dtype}")


def _check(name: str, array: np.ndarray, dtype: type[np.generic], shape: tuple[int, ...]) -> None:
    _check_dtype(name, array, dtype)
    if array.shape != shape:
        raise BadFragment(f"fragment.{name} must have shape {list(shape)}, got {list(array.shape)}")


def _check_actions(actions: np.ndarray, tn: tuple[int, ...]) -> None:
    if actions.dtype == np.int64 and actions.shape == tn:
        return
    if actions.dtype == np.float32 and actions.ndim == 3 and actions.shape[:2] == tn:
        return
    raise BadFragment(
        f"fragment.actions must be int64 [{tn[0]}, {tn[1]}] (discrete) or float32 "
        f"[{tn[0]}, {tn[1]}, A] (continuous), got {actions.dtype} {list(actions.shape)}"
    )


def _check_episodes(returns_value: object, lengths_value: object) -> None:
    returns = _array("episode_returns", returns_value)
    lengths = _array("episode_lengths", lengths_value)
    _check_dtype("episode_returns", returns, np.float32)
    _check_dtype("episode_lengths", lengths, np.int32)
    if returns.ndim != 1 or lengths.shape != returns.shape:
        raise BadFragment(
            "fragment.episode_returns and episode_lengths must be 1-D of equal length, got "
            f"{list(returns.shape)} and {list(lengths.shape)}"
        )
