"""`SequenceFragment`: N sampled completions of a text environment, the unit token RL trains on.

One row is one prompt followed by one completion, right-padded to a common length L. A text
rollout actor sends it where a step actor sends a `Fragment`: it carries the same accounting
fields (actor_id, seq, policy_version, policy_source, num_steps) so learner/buffer.py's Intake
queues, filters and counts it unchanged, and `to_wire` tags it `kind = "sequences"` so
`fragment_from_wire` tells the two apart at the learner's door.

Every field is checked on construction (and so on `from_wire`): dtypes exactly, shapes that
agree, prompt + completion within L, version stamps and log-probs present exactly on the
completion, finite and bounded numbers, rows of one group sharing one prompt. A malformed
fragment from a buggy or hostile actor is refused with `BadFragment` naming the field, never
allowed to reach the loss. Token ids are checked against the vocabulary where it is known: pass
`vocab_size` (the learner does, from its policy) or the ids are only checked to be >= 0.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from shoal.learner.errors import BadFragment
from shoal.learner.fragment import MAX_SOURCE_CHARS, Fragment

KIND = "sequences"
"""The wire tag `to_wire` adds and `fragment_from_wire` dispatches on."""
MAX_ROWS = 1 << 14
"""Rows (prompt + completion) one fragment may carry."""
MAX_LENGTH = 1 << 16
"""Tokens one row may hold (prompt + completion + padding)."""
MAX_TOKENS = 1 << 24
"""N × L: 128 MiB of int64 ids, well under the wire's frame limit."""
MAX_MAGNITUDE = 1e6
"""|reward| and |value| bound: larger ones overflow float32 once squared in a loss."""
MAX_VOCAB = 1 << 24
"""Token ids above this are refused even where the vocabulary is not known."""

_ARRAYS: dict[str, type[np.generic]] = {
    "tokens": np.int64,
    "prompt_lengths": np.int32,
    "completion_lengths": np.int32,
    "logprobs": np.float32,
    "versions": np.int32,
    "values": np.float32,
    "rewards": np.float32,
    "groups": np.int64,
}
_SCALARS: dict[str, type] = {
    "actor_id": str,
    "seq": int,
    "policy_version": int,
    "env_hash": str,
    "policy_source": str,
}


@dataclass
class SequenceFragment:
    """N rows of prompt + completion tokens with what the behaviour policy said about each.

    Shapes: tokens int64 [N, L] (row i: prompt_lengths[i] prompt ids, then completion_lengths[i]
    sampled ids, then padding; every id a valid token); prompt_lengths, completion_lengths int32
    [N] (each >= 1: a token is predicted from the tokens before it, and every completion has at
    least the token that ended it); logprobs float32 [N, L]: at a completion position i, the
    behaviour log-prob of tokens[:, i] under the sampling distribution (learner/generation.py:
    after temperature), 0 elsewhere; versions int32 [N, L]: the policy version that sampled
    token i, -1 outside the completion; values float32 [N, L]: V of the state token i was sampled
    in (zeros are fine for GRPO), 0 outside the completion; rewards float32 [N], one per
    completion; groups int64 [N]: rows with one id answered one prompt (GRPO normalises within a
    group) and a group never straddles fragments.

    `policy_version` is the OLDEST version stamped on any completion token, so the intake's
    staleness bound, which reads only this field, holds for every token in the fragment.
    """

    actor_id: str
    seq: int
    policy_version: int
    env_hash: str
    tokens: np.ndarray
    prompt_lengths: np.ndarray
    completion_lengths: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    values: np.ndarray
    rewards: np.ndarray
    groups: np.ndarray
    policy_source: str = ""
    """The learner incarnation whose weights sampled (empty: none known); see Fragment."""

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def num_envs(self) -> int:
        """N, the number of completions (rows)."""
        return int(self.rewards.shape[0])

    @property
    def horizon(self) -> int:
        """L, the padded row length."""
        return int(self.tokens.shape[1])

    @property
    def num_steps(self) -> int:
        """How many completion tokens (the actions the policy took) this fragment holds."""
        return int(self.completion_lengths.sum())

    @property
    def obs_shape(self) -> tuple[int, ...]:
        return (self.horizon,)

    @property
    def episode_returns(self) -> np.ndarray:
        """Each completion is one episode: its reward."""
        return self.rewards

    @property
    def episode_lengths(self) -> np.ndarray:
        """Each completion is one episode: its token count."""
        return self.completion_lengths

    def completion_mask(self) -> np.ndarray:
        """bool [N, L]: True at the completion positions."""
        return _completion_mask(self.prompt_lengths, self.completion_lengths, self.horizon)

    def to_wire(self) -> dict[str, Any]:
        """A dict of str/int values and numpy arrays tagged kind = "sequences" (no copies)."""
        return {"kind": KIND, **{f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def from_wire(cls, payload: object, vocab_size: int | None = None) -> SequenceFragment:
        """Rebuild from `to_wire`'s dict; raises BadFragment naming the first wrong field.
        With `vocab_size`, token ids must also be below it."""
        if not isinstance(payload, dict):
            raise BadFragment(f"a fragment must arrive as a dict, got {type(payload).__name__}")
        kind = payload.get("kind")
        if not (isinstance(kind, str) and kind == KIND):
            raise BadFragment(f"a sequence fragment has kind {KIND!r}, got {kind!r:.40}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in payload]
        if missing:
            raise BadFragment(f"sequence fragment is missing field(s) {missing}; it has {names}")
        unknown = sorted(str(k)[:40] for k in set(payload) - {*names, "kind"})
        if unknown:
            raise BadFragment(f"sequence fragment has unknown field(s) {unknown}; it has {names}")
        fragment = cls(**{n: payload[n] for n in names})
        if vocab_size is not None:
            check_vocab(fragment, vocab_size)
        return fragment


AnyFragment = Fragment | SequenceFragment
"""What a rollout actor pushes: steps of a step environment or completions of a text one."""


def fragment_from_wire(payload: object, vocab_size: int | None = None) -> AnyFragment:
    """The fragment a wire dict holds: a SequenceFragment when it is tagged kind = "sequences",
    a step Fragment when it has no kind; anything else is refused with BadFragment."""
    if not isinstance(payload, dict):
        raise BadFragment(f"a fragment must arrive as a dict, got {type(payload).__name__}")
    if "kind" not in payload:
        return Fragment.from_wire(payload)
    return SequenceFragment.from_wire(payload, vocab_size)


def check_vocab(fragment: SequenceFragment, vocab_size: int) -> None:
    """Refuse token ids the policy has no embedding for (the learner calls this with its vocabulary)."""
    if fragment.tokens.size and int(fragment.tokens.max()) >= vocab_size:
        raise BadFragment(
            f"fragment.tokens holds id {int(fragment.tokens.max())}, but the policy's vocabulary "
            f"has {vocab_size} ids: is the actor using another tokenizer?"
        )


def _completion_mask(prompt: np.ndarray, completion: np.ndarray, length: int) -> np.ndarray:
    position = np.arange(length)[None, :]
    start = prompt.astype(np.int64)[:, None]
    return (position >= start) & (position < start + completion.astype(np.int64)[:, None])


def _validate(fragment: SequenceFragment) -> None:
    _check_scalars(fragment)
    arrays = {name: _array(name, getattr(fragment, name), dtype) for name, dtype in _ARRAYS.items()}
    length = _check_shapes(arrays)
    prompt, completion = arrays["prompt_lengths"], arrays["completion_lengths"]
    if prompt.min() < 1 or completion.min() < 1:
        raise BadFragment(
            "fragment.prompt_lengths and completion_lengths must be >= 1 in every row (a token is "
            "predicted from the ones before it; a completion holds at least its last token)"
        )
    if (prompt.astype(np.int64) + completion.astype(np.int64)).max() > length:
        raise BadFragment(
            f"fragment.prompt_lengths + completion_lengths exceeds the row length {length}"
        )
    tokens = arrays["tokens"]
    if tokens.min() < 0 or tokens.max() >= MAX_VOCAB:
        raise BadFragment(
            f"fragment.tokens must be ids in [0, {MAX_VOCAB}), got {tokens.min()}..{tokens.max()}"
        )
    mask = _completion_mask(prompt, completion, length)
    _check_numbers(arrays, mask)
    _check_versions(fragment.policy_version, arrays["versions"], mask)
    _check_groups(arrays["groups"], tokens, prompt)


def _check_scalars(fragment: SequenceFragment) -> None:
    for name, kind in _SCALARS.items():
        value = getattr(fragment, name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise BadFragment(f"fragment.{name} must be {kind.__name__}, got {value!r:.60}")
    for name in ("actor_id", "env_hash", "policy_source"):
        if len(getattr(fragment, name)) > MAX_SOURCE_CHARS * 4:
            raise BadFragment(f"fragment.{name} is longer than {MAX_SOURCE_CHARS * 4} characters")
    if len(fragment.policy_source) > MAX_SOURCE_CHARS:
        raise BadFragment(
            f"fragment.policy_source has {len(fragment.policy_source)} characters, at most "
            f"{MAX_SOURCE_CHARS}"
        )
    if fragment.seq < 0 or fragment.policy_version < 0:
        raise BadFragment(
            f"fragment.seq and policy_version must be >= 0, got {fragment.seq}, "
            f"{fragment.policy_version}"
        )


def _array(name: str, value: object, dtype: type[np.generic]) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise BadFragment(f"fragment.{name} must be a numpy array, got {type(value).__name__}")
    if value.dtype != dtype:
        raise BadFragment(f"fragment.{name} must have dtype {np.dtype(dtype)}, got {value.dtype}")
    return value


def _check_shapes(arrays: dict[str, np.ndarray]) -> int:
    """The row length L, once every array's shape agrees with tokens' [N, L]."""
    tokens = arrays["tokens"]
    if tokens.ndim != 2 or not (
        1 <= tokens.shape[0] <= MAX_ROWS and 2 <= tokens.shape[1] <= MAX_LENGTH
    ):
        raise BadFragment(
            f"fragment.tokens must be [N, L] with 1 <= N <= {MAX_ROWS} and 2 <= L <= "
            f"{MAX_LENGTH}, got {list(tokens.shape)}"
        )
    n, length = (int(d) for d in tokens.shape)
    if n * length > MAX_TOKENS:
        raise BadFragment(f"fragment.tokens holds {n * length} ids, at most {MAX_TOKENS}")
    for name, array in arrays.items():
        shape = (n, length) if name in ("tokens", "logprobs", "versions", "values") else (n,)
        if array.shape != shape:
            raise BadFragment(
                f"fragment.{name} must have shape {list(shape)} (tokens are {[n, length]}), "
                f"got {list(array.shape)}"
            )
    return length


def _check_numbers(arrays: dict[str, np.ndarray], mask: np.ndarray) -> None:
    """Finite, bounded, and zero outside the completion: a NaN would poison every weight."""
    for name in ("logprobs", "values", "rewards"):
        array = arrays[name]
        if not np.isfinite(array).all():
            raise BadFragment(
                f"fragment.{name} holds NaN or infinite values; the actor's policy or environment "
                "is broken"
            )
    for name in ("values", "rewards"):
        if np.abs(arrays[name]).max() > MAX_MAGNITUDE:
            raise BadFragment(f"fragment.{name} must lie within ±{MAX_MAGNITUDE:g}")
    logprobs = arrays["logprobs"]
    if (logprobs > 0).any():
        raise BadFragment("fragment.logprobs must be <= 0 (log-probabilities)")
    for name in ("logprobs", "values"):
        if arrays[name][~mask].any():
            raise BadFragment(f"fragment.{name} must be 0 outside the completion tokens")


def _check_versions(policy_version: int, versions: np.ndarray, mask: np.ndarray) -> None:
    if (versions[~mask] != -1).any():
        raise BadFragment("fragment.versions must be -1 outside the completion tokens")
    stamped = versions[mask]
    if int(stamped.min()) < 0:
        raise BadFragment("fragment.versions must be >= 0 on every completion token")
    if int(stamped.min()) != policy_version:
        raise BadFragment(
            f"fragment.policy_version is {policy_version} but the oldest version stamped on a "
            f"completion token is {int(stamped.min())}: policy_version must be that oldest one, "
            "so the intake's staleness bound covers every token"
        )


def _check_groups(groups: np.ndarray, tokens: np.ndarray, prompt: np.ndarray) -> None:
    """Rows of one group answered one prompt: equal prompt lengths and prompt ids."""
    if groups.min() < 0:
        raise BadFragment("fragment.groups must be ids >= 0")
    order = np.argsort(groups, kind="stable")
    ids = groups[order]
    same = ids[1:] == ids[:-1]
    if not same.any():
        return
    first, second = order[:-1][same], order[1:][same]
    width = int(prompt.max())
    positions = np.arange(width)[None, :]
    in_prompt = positions < prompt[first].astype(np.int64)[:, None]
    differ = (prompt[first] != prompt[second]) | (
        (tokens[first, :width] != tokens[second, :width]) & in_prompt
    ).any(axis=1)
    if differ.any():
        k = int(np.argmax(differ))
        raise BadFragment(
            f"fragment.groups puts rows {int(first[k])} and {int(second[k])} in group "
            f"{int(ids[1:][same][k])} but their prompts differ: a group is one prompt's samples"
        )
