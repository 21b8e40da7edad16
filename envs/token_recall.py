"""TokenRecall: name the token that follows the marker, a small learnable task for language-model policies.

Each step shows a fresh sequence of `length` token ids: random content tokens 0..num_tokens-1
with one MARKER (id `num_tokens`) somewhere before the last position; the right action is the
content token right after the marker (reward 1, else 0). An episode is `episode_steps` such
questions. Observations are int64 token ids, what the causal-lm family reads; a policy that
attends from the last position back to the marker's successor solves it, one that guesses
scores 1/num_tokens. Cheap enough to step thousands of copies in microseconds.
"""

from __future__ import annotations

import numpy as np
from gymnasium import spaces

from shoal.envs.batched import BatchedDynamics, NativeVector, SingleEnv
from shoal.errors import ConfigError

__all__ = ["TokenRecallDynamics", "make_batched", "make_single"]


def _check(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name}={value!r}: expected an integer from {low} to {high}")
    return value


class TokenRecallDynamics(BatchedDynamics):
    """N copies, each holding its current question and how many it has answered."""

    def __init__(
        self, num_envs: int, length: int = 8, num_tokens: int = 4, episode_steps: int = 4
    ) -> None:
        self.num_envs = num_envs
        self.length = _check("length", length, 2, 4096)
        self.num_tokens = _check("num_tokens", num_tokens, 2, 1 << 20)
        self.episode_steps = _check("episode_steps", episode_steps, 1, 1 << 20)
        self.marker = self.num_tokens
        self.observation_space = spaces.Box(0, self.marker, shape=(self.length,), dtype=np.int64)
        self.action_space = spaces.Discrete(self.num_tokens)
        self.tokens = np.zeros((num_envs, self.length), dtype=np.int64)
        self.target = np.zeros(num_envs, dtype=np.int64)
        self.answered = np.zeros(num_envs, dtype=np.int64)
        self._rng = np.random.default_rng(0)

    def reset_rows(self, rows: np.ndarray, rng: np.random.Generator) -> None:
        self._rng = rng
        self.answered[rows] = 0
        self._ask(rows)

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        reward = (actions == self.target).astype(np.float32)
        self.answered += 1
        terminated = self.answered >= self.episode_steps
        self._ask(np.flatnonzero(~terminated))
        return reward, terminated

    def observe(self) -> np.ndarray:
        """Every copy's token ids, int64 [N, length]."""
        return self.tokens.copy()

    def _ask(self, rows: np.ndarray) -> None:
        """Draw a new question for `rows`: content tokens, a marker, the token to recall after it."""
        n = len(rows)
        if n == 0:
            return
        tokens = self._rng.integers(self.num_tokens, size=(n, self.length))
        where = self._rng.integers(self.length - 1, size=n)
        picked = np.arange(n)
        tokens[picked, where] = self.marker
        self.tokens[rows] = tokens
        self.target[rows] = tokens[picked, where + 1]


def make_single(length: int = 8, num_tokens: int = 4, episode_steps: int = 4) -> SingleEnv:
    """One TokenRecall copy."""
    return SingleEnv(TokenRecallDynamics(1, length, num_tokens, episode_steps))


def make_batched(
    num_envs: int,
    seed: int | None = None,
    max_episode_steps: int | None = None,
    length: int = 8,
    num_tokens: int = 4,
    episode_steps: int = 4,
) -> NativeVector:
    """N TokenRecall copies stepped with whole-array operations."""
    dynamics = TokenRecallDynamics(num_envs, length, num_tokens, episode_steps)
    return NativeVector(dynamics, max_episode_steps, seed)
