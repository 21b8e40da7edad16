"""Per-token advantages from one reward per completion: GRPO's normalisation within a prompt's
group, and GAE over the completion tokens with the reward at the last one. Pure numpy, so their
properties are tested on their own (tests/learner/test_token_ppo.py)."""

from __future__ import annotations

import numpy as np


def grpo_advantages(rewards: np.ndarray, groups: np.ndarray, eps: float) -> np.ndarray:
    """(r − mean) / (std + eps) within each group (population std); float32 [N].

    `groups` [N] holds any integer labels; a row's group is the rows with its label."""
    _, label = np.unique(groups, return_inverse=True)
    label = label.reshape(-1)
    count = np.bincount(label).astype(np.float64)
    r = rewards.astype(np.float64)
    mean = np.bincount(label, weights=r) / count
    centred = r - mean[label]
    std = np.sqrt(np.bincount(label, weights=centred**2) / count)
    return (centred / (std[label] + eps)).astype(np.float32)


def token_gae(
    rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, gamma: float, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    """GAE over each row's completion tokens (mask [N, L], one contiguous run per row), the
    reward [N] arriving at the last one, nothing after it (terminal). Returns (advantages,
    returns = advantages + values), float32 [N, L], 0 outside the mask."""
    n, length = mask.shape
    last = np.zeros((n, length), dtype=bool)
    ends = length - 1 - np.argmax(mask[:, ::-1], axis=1)
    last[np.arange(n), ends] = True
    advantages = np.zeros((n, length), dtype=np.float32)
    next_value = np.zeros(n, dtype=np.float32)
    next_advantage = np.zeros(n, dtype=np.float32)
    for t in reversed(range(length)):
        inside = mask[:, t]
        reward = np.where(last[:, t], rewards, 0.0)
        delta = reward + gamma * next_value - values[:, t]
        advantage = np.where(inside, delta + gamma * lam * next_advantage, 0.0)
        advantages[:, t] = advantage
        next_value = np.where(inside, values[:, t], 0.0)
        next_advantage = advantage
    returns = np.where(mask, advantages + values, 0.0)
    return advantages, returns.astype(np.float32)
