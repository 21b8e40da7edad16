"""Text environments: a prompt, a completion written token by token, and a verifiable score.

A `TextEnvironment` hands out `TextTask`s from a seeded generator (`tasks(split, count, seed)`)
and scores completions in batches (`score_many`). It is not a step-by-step environment: the
policy's actions are tokens of one completion, so a rollout worker samples whole completions
(learner/generation.py) and scores them together. `observation_space` (int64 token ids, prompt
plus completion) and `action_space` (`Discrete(vocab)`) tell `build_model` to make a causal LM.

Reward (every text environment): ``0.9 * passed / total + 0.1 * format_ok`` when the program
ran to its end (status "ok"), else 0. `format_ok` is each environment's cheap shape check (a
function body that parses and imports nothing; an arithmetic expression). So 1.0 means every
hidden test passed in the right format, a well-formed wrong answer earns 0.1, and anything that
crashes, loops, floods its output or does not parse earns 0.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces

from shoal.envs.errors import EnvError
from shoal.envs.sandbox import TestCase
from shoal.envs.tokenizer import Tokenizer, load_tokenizer
from shoal.errors import ConfigError

__all__ = [
    "FORMAT_WEIGHT",
    "SPLITS",
    "BadTask",
    "Score",
    "TextEnvError",
    "TextEnvironment",
    "TextTask",
    "cut_at_stop",
    "reward_of",
    "task_from_dict",
    "task_to_dict",
]

SPLITS = ("train", "heldout", "heldout_families")
"""train: train families, train parameter values; heldout: train families, parameter values
never used in train; heldout_families: families never seen in train."""
FORMAT_WEIGHT = 0.1
MAX_COMPLETION_CHARS = 4096
"""Longer completions are not run: they score 0 with status "too_long"."""
MAX_TASKS = 1_000_000
MAX_FIELD_CHARS = 64 * 1024
MAX_PAIRS = 256


class TextEnvError(EnvError, ConfigError):
    """A text environment asked for something it cannot give (an unknown split, a bad count,
    mismatched batches); the message names what is valid."""


class BadTask(TextEnvError, ValueError):
    """A task record (read back from JSON) has the wrong shape; the message names the field."""


@dataclass(frozen=True)
class TextTask:
    """One prompt and how a completion of it is checked.

    Code tasks carry hidden `tests` (run after prompt + completion) and the `entry` function;
    exact-checker tasks carry `answer`. `reference` is a completion that scores 1.0 (the SFT
    target); `params` are the generator's parameters, kept so `perturb` can re-render the task."""

    id: str
    family: str
    prompt: str
    reference: str
    tests: tuple[TestCase, ...] = ()
    answer: str | None = None
    entry: str = ""
    params: tuple[tuple[str, Any], ...] = ()

    def param(self, name: str) -> Any:
        """One generator parameter of this task (KeyError naming it when absent)."""
        for key, value in self.params:
            if key == name:
                return value
        raise KeyError(f"task {self.id} has no parameter {name!r}")


@dataclass(frozen=True)
class Score:
    """The verdict on one completion; `info()` is what a rollout reports beside the reward."""

    reward: float
    passed: int
    total: int
    status: str
    """"ok" when the program (or expression) ran to its end, else why not (the sandbox's
    status names: syntax_error, timeout, output_limit, ...; or "too_long")."""
    message: str
    failing_test: str | None
    """The first failing test as `call -> actual, expected value`, None when all passed."""
    format_ok: bool

    def info(self) -> dict[str, Any]:
        return {
            "reward": self.reward,
            "passed": self.passed,
            "total": self.total,
            "status": self.status,
            "message": self.message,
            "failing_test": self.failing_test,
            "format_ok": self.format_ok,
        }


def task_to_dict(task: TextTask) -> dict[str, Any]:
    """A task as JSON values (`task_from_dict` reads it back to an equal task)."""
    return {
        "id": task.id,
        "family": task.family,
        "prompt": task.prompt,
        "reference": task.reference,
        "tests": [[test.call, test.expected] for test in task.tests],
        "answer": task.answer,
        "entry": task.entry,
        "params": [[name, value] for name, value in task.params],
    }


def _field(record: dict[str, Any], name: str, kinds: type | tuple[type, ...]) -> Any:
    value = record.get(name)
    if not isinstance(value, kinds):
        raise BadTask(f"task field {name!r} is {type(value).__name__}, not {kinds}")
    if isinstance(value, str) and len(value) > MAX_FIELD_CHARS:
        raise BadTask(f"task field {name!r} has {len(value)} characters; at most {MAX_FIELD_CHARS}")
    return value


def _pairs(record: dict[str, Any], name: str) -> list[tuple[str, Any]]:
    items = _field(record, name, list)
    if len(items) > MAX_PAIRS or any(
        not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
        for item in items
    ):
        raise BadTask(f"task field {name!r} must be at most {MAX_PAIRS} [name, value] pairs")
    return [(item[0], item[1]) for item in items]


def task_from_dict(record: Any) -> TextTask:
    """The task `task_to_dict` wrote, every field checked (hostile input: a file on disk).

    A list parameter value comes back as a tuple, as the generators store it."""
    if not isinstance(record, dict):
        raise BadTask(f"a task record is a JSON object, not {type(record).__name__}")
    answer = record.get("answer")
    if answer is not None:
        answer = _field(record, "answer", str)
    return TextTask(
        id=_field(record, "id", str),
        family=_field(record, "family", str),
        prompt=_field(record, "prompt", str),
        reference=_field(record, "reference", str),
        tests=tuple(TestCase(call, expected) for call, expected in _pairs(record, "tests")),
        answer=answer,
        entry=_field(record, "entry", str),
        params=tuple(
            (key, tuple(value) if isinstance(value, list) else value)
            for key, value in _pairs(record, "params")
        ),
    )


def reward_of(passed: int, total: int, status: str, format_ok: bool) -> float:
    """The documented reward: 0.9 × fraction passed + 0.1 × format, only when status is "ok"."""
    if status != "ok" or total <= 0:
        return 0.0
    if passed == total and format_ok:
        return 1.0  # exactly: 0.9 × 9/9 + 0.1 is 0.9999999999999999 in floating point
    return (1.0 - FORMAT_WEIGHT) * passed / total + FORMAT_WEIGHT * float(format_ok)


def cut_at_stop(completion: str, stops: Sequence[str]) -> str:
    """The completion up to its first stop string (which generation may or may not include)."""
    end = len(completion)
    for stop in stops:
        found = completion.find(stop)
        if found != -1:
            end = min(end, found + len(stop))
    return completion[:end]


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | np.integer)
        or not low <= value <= high
    ):
        raise TextEnvError(f"{name}={value!r}: expected an integer from {low} to {high}")
    return int(value)


class TextEnvironment(ABC):
    """A generator of prompts and a batched scorer of completions.

    `score_many` and `tasks` may be called from a worker thread (one caller at a time);
    `close()` releases what scoring holds (sandbox servers) and is idempotent."""

    name: str
    """The environment id, e.g. CodeGen-v1."""
    generator: str
    version: int
    splits: tuple[str, ...] = SPLITS
    pool_splits: tuple[str, ...] = ()
    """Splits that only this environment's own pipeline stages draw on (validation, RL prompts),
    never a test split a text job's evaluation scores; their streams come after `splits`', so
    adding one leaves every test split's tasks unchanged."""
    stop: tuple[str, ...] = ()
    """Generation ends at any of these (and at EOS); scoring cuts a completion after the first."""
    max_prompt_tokens: int
    max_new_tokens: int

    def __init__(self, tokenizer: str | Tokenizer = "bytes", max_new_tokens: int = 64) -> None:
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1, 65536)
        vocab = self.tokenizer.vocab_size
        length = self.max_prompt_tokens + self.max_new_tokens
        self.observation_space = spaces.Box(0, vocab - 1, (length,), np.int64)
        self.action_space = spaces.Discrete(vocab)

    @abstractmethod
    def params(self) -> dict[str, Any]:
        """The generator's parameters (JSON values): everything that shapes its tasks."""

    def manifest(self) -> dict[str, Any]:
        """What defines this environment's tasks and rewards; `digest()` hashes it."""
        return {
            "env": self.name,
            "generator": self.generator,
            "version": self.version,
            "params": self.params(),
            "tokenizer": self.tokenizer.fingerprint(),
            "max_new_tokens": self.max_new_tokens,
            "stop": list(self.stop),
            "format_weight": FORMAT_WEIGHT,
        }

    def digest(self) -> str:
        text = json.dumps(self.manifest(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def tasks(self, split: str = "train", count: int = 64, seed: int = 0) -> list[TextTask]:
        """`count` tasks of `split`, the same for the same seed (a split's own random stream)."""
        streams = (*self.splits, *self.pool_splits)
        if split not in streams:
            raise TextEnvError(f"{self.name} has no split {split!r}; choose one of {streams}")
        count = _check_int("count", count, 1, MAX_TASKS)
        seed = _check_int("seed", seed, 0, 2**63 - 1)
        rng = np.random.default_rng([seed, streams.index(split)])
        return self._generate(split, count, rng)

    @abstractmethod
    def _generate(self, split: str, count: int, rng: np.random.Generator) -> list[TextTask]: ...

    def score_many(self, tasks: Sequence[TextTask], completions: Sequence[str]) -> list[Score]:
        """Score completion i against task i, all in one batch; never raises on a completion."""
        if len(tasks) != len(completions):
            raise TextEnvError(
                f"score_many got {len(tasks)} tasks and {len(completions)} completions: "
                "pass one task per completion"
            )
        for completion in completions:
            if not isinstance(completion, str):
                raise TextEnvError(f"completions are str, got {type(completion).__name__}")
        if not tasks:
            return []
        return self._score(list(tasks), [cut_at_stop(c, self.stop) for c in completions])

    @abstractmethod
    def _score(self, tasks: list[TextTask], completions: list[str]) -> list[Score]: ...

    @abstractmethod
    def perturb(self, task: TextTask, rng: np.random.Generator) -> TextTask:
        """The same task (same tests, same answer) with its prompt reworded, its variables
        renamed or its examples reordered: a robustness probe."""

    def prompt_ids(self, task: TextTask) -> list[int]:
        """The prompt's token ids; a prompt longer than `max_prompt_tokens` is an error."""
        ids = self.tokenizer.encode(task.prompt)
        if len(ids) > self.max_prompt_tokens:
            raise TextEnvError(
                f"task {task.id} has a {len(ids)}-token prompt; {self.name} allows "
                f"{self.max_prompt_tokens}: use a tokenizer with fewer tokens per byte"
            )
        return ids

    @abstractmethod
    def close(self) -> None:
        """Release what scoring holds (sandbox servers); idempotent."""

    def __enter__(self) -> TextEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} tokenizer={self.tokenizer!r}>"
