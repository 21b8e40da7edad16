"""Valid `SequenceFragment`s for tests: `groups` prompts × `group_size` samples each."""

from __future__ import annotations

import numpy as np

from shoal.learner.generation import Completions
from shoal.learner.sequences import SequenceFragment


def make_sequences(
    groups: int = 2,
    group_size: int = 3,
    vocab: int = 16,
    max_prompt: int = 4,
    max_completion: int = 5,
    version: int = 0,
    seed: int = 0,
    actor_id: str = "a1",
    seq: int = 0,
    first_group: int = 0,
) -> SequenceFragment:
    """Random prompts and completions (ids in [0, vocab)), rows of a group sharing a prompt,
    behaviour log-probs in (-3, 0) and every completion token stamped with `version`."""
    rng = np.random.default_rng(seed)
    n = groups * group_size
    length = max_prompt + max_completion
    tokens = rng.integers(0, vocab, size=(n, length)).astype(np.int64)
    prompt = np.repeat(rng.integers(1, max_prompt + 1, size=groups), group_size).astype(np.int32)
    for g in range(groups):
        rows = slice(g * group_size, (g + 1) * group_size)
        tokens[rows, :max_prompt] = tokens[g * group_size, :max_prompt]
    completion = rng.integers(1, max_completion + 1, size=n).astype(np.int32)
    position = np.arange(length)[None, :]
    mask = (position >= prompt[:, None]) & (position < (prompt + completion)[:, None])
    return SequenceFragment(
        actor_id=actor_id,
        seq=seq,
        policy_version=version,
        env_hash="h",
        tokens=tokens,
        prompt_lengths=prompt,
        completion_lengths=completion,
        logprobs=np.where(mask, -3 * rng.random((n, length)), 0).astype(np.float32),
        versions=np.where(mask, version, -1).astype(np.int32),
        values=np.where(mask, rng.normal(size=(n, length)), 0).astype(np.float32),
        rewards=rng.random(n).astype(np.float32),
        groups=np.repeat(np.arange(first_group, first_group + groups), group_size).astype(np.int64),
    )


def from_completions(
    prompts: list[list[int]],
    completions: Completions,
    rewards: list[float],
    group_size: int,
    pad_id: int,
    seq: int = 0,
) -> SequenceFragment:
    """Rows of learner/generation.py's output (prompt i // group_size for row i) as a fragment."""
    n = len(prompts)
    width = max(map(len, prompts)) + completions.tokens.shape[1]
    tokens = np.full((n, width), pad_id, dtype=np.int64)
    grids = {
        "logprobs": np.zeros((n, width), np.float32),
        "values": np.zeros((n, width), np.float32),
        "versions": np.full((n, width), -1, np.int32),
    }
    for i, prompt in enumerate(prompts):
        end = len(prompt) + int(completions.lengths[i])
        tokens[i, : len(prompt)] = prompt
        tokens[i, len(prompt) : end] = completions.tokens[i, : completions.lengths[i]]
        for name, grid in grids.items():
            grid[i, len(prompt) : end] = getattr(completions, name)[i, : completions.lengths[i]]
    return SequenceFragment(
        actor_id="a1",
        seq=seq,
        policy_version=int(completions.versions[completions.versions >= 0].min()),
        env_hash="h",
        tokens=tokens,
        prompt_lengths=np.array([len(p) for p in prompts], np.int32),
        completion_lengths=completions.lengths.astype(np.int32),
        rewards=np.asarray(rewards, np.float32),
        groups=np.arange(n, dtype=np.int64) // group_size,
        **grids,
    )
