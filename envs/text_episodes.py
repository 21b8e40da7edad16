"""The gym-style form of a text environment: one-step episodes, a whole completion per step.

This is what `make("CodeGen-v1")` gives, so text environments sit in the registry beside the
others (`shoal envs list` probes them, `shoal envs hash` hashes them). `reset` draws a task from
the train split and observes its prompt as token ids (right-padded with PAD to the observation
length); `step(completion)` scores the completion and ends the episode, with the `Score` in
info. Training goes through the token path instead (text_registry.make_text_env), which samples
and scores whole batches.
"""

from __future__ import annotations

import string
from typing import Any

import numpy as np
from gymnasium import spaces

from shoal.envs.base import BaseEnvironment
from shoal.envs.errors import InvalidAction
from shoal.envs.text_registry import make_text_env
from shoal.envs.text_tasks import MAX_COMPLETION_CHARS, TextTask

__all__ = ["TextEpisodes", "codegen_episodes", "countdown_episodes"]

MAX_SAMPLED_CHARS = 256


class TextEpisodes(BaseEnvironment[np.ndarray, str]):
    """One task per episode from a text environment's train split; not thread-safe."""

    def __init__(self, env_id: str, **kwargs: Any) -> None:
        self.text = make_text_env(env_id, **kwargs)
        self.observation_space = self.text.observation_space
        self.action_space = spaces.Text(MAX_SAMPLED_CHARS, min_length=0, charset=string.printable)
        self._rng = np.random.default_rng()
        self._task: TextTask | None = None

    def seed(self, seed: int | None) -> None:
        self._rng = np.random.default_rng(seed)

    def reset(self) -> tuple[np.ndarray, dict[str, Any]]:
        seed = int(self._rng.integers(2**62))
        self._task = self.text.tasks("train", 1, seed)[0]
        return self._observe(self._task), _task_info(self._task)

    def step(self, action: str) -> tuple[np.ndarray, float, bool, dict[str, Any]]:
        task = self._task
        if task is None:
            raise InvalidAction("call reset() before step(): no task has been drawn yet")
        if not isinstance(action, str):
            raise InvalidAction(f"actions are completion strings, got {type(action).__name__}")
        if len(action) > MAX_COMPLETION_CHARS:
            raise InvalidAction(
                f"the completion has {len(action)} characters; the limit is {MAX_COMPLETION_CHARS}"
            )
        score = self.text.score_many([task], [action])[0]
        self._task = None
        return self._observe(task), score.reward, True, {**_task_info(task), **score.info()}

    def _observe(self, task: TextTask) -> np.ndarray:
        length = self.text.max_prompt_tokens + self.text.max_new_tokens
        obs = np.full(length, self.text.tokenizer.pad_id, dtype=np.int64)
        ids = self.text.prompt_ids(task)
        obs[: len(ids)] = ids
        return obs

    def close(self) -> None:
        self.text.close()


def _task_info(task: TextTask) -> dict[str, Any]:
    return {"task_id": task.id, "family": task.family, "prompt": task.prompt}


def codegen_episodes(**kwargs: Any) -> TextEpisodes:
    return TextEpisodes("CodeGen-v1", **kwargs)


def countdown_episodes(**kwargs: Any) -> TextEpisodes:
    return TextEpisodes("Countdown-v1", **kwargs)
