"""Code-execution environments: the action is a program, the reward the fraction of tests it passes.

`CodeExec-v1` takes free-form source (a string action) and runs it in a `SandboxPool`.
`CodeChoice-v1` is the variant an MLP policy can learn with PPO: the observation is the one-hot
task id and the action an index into the task's four candidate programs (the reference and
three buggy ones, see code_tasks). Its rewards come from running every candidate in the
sandbox once when the environment is built: the candidates and tests are fixed, so a step is
then a table lookup and training is not bound by process creation.
Episodes are one step long: a program is submitted, judged, and the next task is drawn.
"""

from __future__ import annotations

import functools
import string
from collections.abc import Callable
from typing import Any

import numpy as np
from gymnasium import spaces

from shoal.envs.base import BaseEnvironment
from shoal.envs.code_tasks import CodeTask, suite
from shoal.envs.errors import InvalidAction
from shoal.envs.sandbox import Limits, SandboxPool, SandboxResult
from shoal.envs.vector import VectorEnvironment, VectorStep, check_actions, check_num_envs

NUM_CANDIDATES = 4
MAX_SOURCE_CHARS = 8192
TASK_LIMITS = Limits(cpu_s=1, memory_mb=256, file_size_mb=1, processes=8, timeout_s=3.0)


def reference_action(task: CodeTask) -> int:
    """The action index of the task's reference solution in `CodeChoice-v1` (demonstrations)."""
    return task.reference_index()


def reference_policy(suite_name: str = "basic") -> Callable[[np.ndarray], np.ndarray]:
    """The teacher for `CodeChoice-v1`: one-hot task observations [N, T] -> reference actions [N]."""
    tasks = suite(suite_name)
    table = np.array([reference_action(task) for task in tasks], dtype=np.int64)

    def teacher(obs: np.ndarray) -> np.ndarray:
        return table[np.argmax(np.asarray(obs), axis=-1)]

    return teacher


def _one_hot(index: int, size: int) -> np.ndarray:
    obs = np.zeros(size, dtype=np.float32)
    obs[index] = 1.0
    return obs


def _task_info(task: CodeTask, index: int) -> dict[str, Any]:
    return {
        "task_index": index,
        "task_id": task.id,
        "prompt": task.prompt,
        "entry": task.entry,
        "tests": [t.call for t in task.tests],
    }


def _result_info(result: SandboxResult) -> dict[str, Any]:
    return {
        "status": result.status.value,
        "message": result.message,
        "passed": result.passed,
        "total": result.total,
    }


class _TaskEpisodes(BaseEnvironment[np.ndarray, Any]):
    """One-step episodes over a task suite: `reset` draws a task (one-hot observation), `step`
    answers it and ends the episode. Subclasses set the action space and score the answer."""

    def __init__(self, suite_name: str) -> None:
        self.tasks = suite(suite_name)
        self.observation_space = spaces.Box(0.0, 1.0, (len(self.tasks),), np.float32)
        self._rng = np.random.default_rng()
        self._task: int | None = None

    def seed(self, seed: int | None) -> None:
        self._rng = np.random.default_rng(seed)

    def reset(self) -> tuple[np.ndarray, dict[str, Any]]:
        self._task = int(self._rng.integers(len(self.tasks)))
        return _one_hot(self._task, len(self.tasks)), _task_info(self.tasks[self._task], self._task)

    def _drawn(self) -> int:
        """The task `reset` drew; a step answers it, ending the episode."""
        if self._task is None:
            raise InvalidAction("call reset() before step(): no task has been drawn yet")
        return self._task


class CodeExecEnv(_TaskEpisodes):
    """Write a program for the drawn task; it runs in a sandbox child against the task's tests.

    The sandbox servers start on the first step and stop in `close()`.
    """

    def __init__(self, suite_name: str = "basic", workers: int = 1) -> None:
        super().__init__(suite_name)
        self.action_space = spaces.Text(MAX_SOURCE_CHARS, min_length=0, charset=string.printable)
        self._workers = workers
        self._pool: SandboxPool | None = None

    def step(self, action: str) -> tuple[np.ndarray, float, bool, dict[str, Any]]:
        index = self._drawn()
        if not isinstance(action, str):
            raise InvalidAction(
                f"CodeExec actions are Python source strings, got {type(action).__name__}"
            )
        if len(action) > MAX_SOURCE_CHARS:
            raise InvalidAction(
                f"source has {len(action)} characters; the limit is {MAX_SOURCE_CHARS}"
            )
        if self._pool is None:
            self._pool = SandboxPool(self._workers, TASK_LIMITS)
        task = self.tasks[index]
        result = self._pool.run(action, task.tests)
        self._task = None
        info = {**_task_info(task, index), **_result_info(result)}
        return _one_hot(index, len(self.tasks)), result.reward, True, info

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def candidate_rewards(tasks: tuple[CodeTask, ...], workers: int = 2) -> np.ndarray:
    """Reward [task, candidate] of every candidate program, each run once in the sandbox.

    `run_many` (blocking, on the pool's own threads, not asyncio) runs them in batches: this
    may be called from inside a running event loop (a rollout actor building its environments)."""
    table = np.zeros((len(tasks), NUM_CANDIDATES), dtype=np.float32)
    jobs = [
        (t, c, source) for t, task in enumerate(tasks) for c, source in enumerate(task.candidates())
    ]
    with SandboxPool(workers, TASK_LIMITS) as pool:
        results = pool.run_many([(source, tasks[t].tests) for t, _, source in jobs])
    for (t, c, _), result in zip(jobs, results):
        table[t, c] = result.reward
    return table


@functools.cache
def suite_rewards(suite_name: str) -> np.ndarray:
    """`candidate_rewards` of a suite, computed once per process (read-only).

    Every `CodeChoice` environment of a process shares it: an evaluation builds one vector per
    noise level, and each would otherwise rerun the same 96 sandbox episodes for the same table.
    """
    table = candidate_rewards(suite(suite_name))
    table.setflags(write=False)
    return table


class CodeChoiceEnv(_TaskEpisodes):
    """Pick one of four candidate programs for the drawn task (one-hot observation)."""

    def __init__(self, suite_name: str = "basic", rewards: np.ndarray | None = None) -> None:
        super().__init__(suite_name)
        self.rewards = suite_rewards(suite_name) if rewards is None else rewards
        self.action_space = spaces.Discrete(NUM_CANDIDATES)

    def step(self, action: int) -> tuple[np.ndarray, float, bool, dict[str, Any]]:
        task = self._drawn()
        if not self.action_space.contains(action):
            raise InvalidAction(f"action {action!r} is not in {self.action_space}")
        self._task = None
        reward = float(self.rewards[task, int(action)])
        info = {
            **_task_info(self.tasks[task], task),
            "reference_action": reference_action(self.tasks[task]),
        }
        return _one_hot(task, len(self.tasks)), reward, True, info


class CodeChoiceVector(VectorEnvironment):
    """N `CodeChoice` slots stepped as array operations; every step ends every slot's episode."""

    def __init__(
        self,
        num_envs: int,
        seed: int | None = None,
        suite_name: str = "basic",
        max_episode_steps: int | None = None,
    ) -> None:
        check_num_envs(num_envs)
        self.tasks = suite(suite_name)
        self.rewards = suite_rewards(suite_name)
        self.num_envs = num_envs
        self.single_observation_space = spaces.Box(0.0, 1.0, (len(self.tasks),), np.float32)
        self.single_action_space = spaces.Discrete(NUM_CANDIDATES)
        self._rng = np.random.default_rng(seed)
        self._eye = np.eye(len(self.tasks), dtype=np.float32)
        self._task = self._draw()

    def _draw(self) -> np.ndarray:
        return self._rng.integers(len(self.tasks), size=self.num_envs)

    def reference_actions(self) -> np.ndarray:
        """The reference solution's index for each slot's current task (for demonstrations)."""
        return np.array([reference_action(self.tasks[t]) for t in self._task], dtype=np.int64)

    def reset(self, seed: int | None = None) -> np.ndarray:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._task = self._draw()
        return self._eye[self._task]

    def step(self, actions: np.ndarray) -> VectorStep:
        actions = check_actions(actions, self.num_envs, self.single_action_space)
        reward = self.rewards[self._task, actions].astype(np.float32)
        final_obs = self._eye[self._task]
        self._task = self._draw()
        return VectorStep(
            obs=self._eye[self._task],
            reward=reward,
            done=np.ones(self.num_envs, dtype=bool),
            truncated=np.zeros(self.num_envs, dtype=bool),
            final_obs=final_obs,
            episode_return=reward.copy(),
            episode_length=np.ones(self.num_envs, dtype=np.int32),
        )


def make_choice_vector(num_envs: int, seed: int | None = None, **kwargs: Any) -> CodeChoiceVector:
    return CodeChoiceVector(num_envs, seed, **kwargs)
