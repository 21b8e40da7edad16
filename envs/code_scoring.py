"""Scoring code completions: the format check and one batched sandbox run per `score_many`.

A code task's prompt is a function header and a comment (`def f(x):\\n    # ...\\n`); the
completion is the function's body. The program run is prompt + body, then each hidden test's
call, in a fresh confined sandbox child (envs/sandbox.py); a batch goes to the pool in ONE
`run_many` call, so the servers run its episodes at once. The format check is done here on the
host with `ast` only (nothing is executed): the body is indented, prompt + body parses to
exactly the entry function, and it imports nothing and names no dunder.
"""

from __future__ import annotations

import ast
import threading
import warnings

from shoal.envs.sandbox import Limits, SandboxPool, SandboxResult, Status
from shoal.envs.text_tasks import MAX_COMPLETION_CHARS, Score, TextTask, reward_of

__all__ = ["CODE_LIMITS", "CodeScorer", "body_format_ok"]

CODE_LIMITS = Limits(
    cpu_s=1, memory_mb=256, file_size_mb=1, processes=8, output_bytes=16 * 1024, timeout_s=2.0
)
TOO_LONG = "too_long"
MAX_INFO_CHARS = 300


def body_format_ok(prompt: str, body: str, entry: str) -> bool:
    """True when `body` is an indented function body that, after `prompt`, parses to the one
    function `entry`, imports nothing and names no dunder (`__import__`, `__builtins__`)."""
    lines = [line for line in body.splitlines() if line.strip()]
    if not lines or any(not line.startswith((" ", "\t")) for line in lines):
        return False
    try:
        with warnings.catch_warnings():  # a model's `1x` is scored, not printed on the console
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(prompt + body)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return False
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return False
    if tree.body[0].name != entry:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            return False
        name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        if isinstance(name, str) and name.startswith("__"):
            return False
    return True


def _clip(text: str) -> str:
    return text if len(text) <= MAX_INFO_CHARS else text[: MAX_INFO_CHARS - 1] + "…"


def _failing_test(result: SandboxResult) -> str | None:
    for outcome in result.tests:
        if not outcome.passed:
            got = outcome.error if outcome.error else repr(outcome.actual)
            return _clip(f"{outcome.call} -> {got}, expected {outcome.expected!r}")
    return None


def _verdict(result: SandboxResult) -> tuple[str, str]:
    """The status and message; output beyond the sandbox's limit fails the episode here (the
    sandbox only drops it): a function body has no business flooding stdout."""
    if result.status is Status.OK and result.output_truncated:
        return Status.OUTPUT_LIMIT.value, "the program's output exceeded the sandbox's limit"
    return result.status.value, result.message


def _score(result: SandboxResult, format_ok: bool) -> Score:
    status, message = _verdict(result)
    passed = result.passed if status == Status.OK.value else 0
    return Score(
        reward=reward_of(passed, result.total, status, format_ok),
        passed=passed,
        total=result.total,
        status=status,
        message=_clip(message),
        failing_test=_failing_test(result),
        format_ok=format_ok,
    )


def _too_long(task: TextTask, body: str) -> Score:
    return Score(
        reward=0.0,
        passed=0,
        total=len(task.tests),
        status=TOO_LONG,
        message=f"the completion has {len(body)} characters; at most {MAX_COMPLETION_CHARS} run",
        failing_test=f"{task.tests[0].call} -> not run" if task.tests else None,
        format_ok=False,
    )


class CodeScorer:
    """Scores function bodies against their tasks' hidden tests in a lazily started pool.

    Thread-safe: one `score` call runs at a time; `close()` stops the pool's servers."""

    def __init__(self, workers: int = 2, batch: int = 32, limits: Limits = CODE_LIMITS) -> None:
        self.workers = workers
        self.batch = batch
        self.limits = limits
        self._pool: SandboxPool | None = None
        self._lock = threading.Lock()

    def score(self, tasks: list[TextTask], bodies: list[str]) -> list[Score]:
        scores: list[Score | None] = [None] * len(tasks)
        runnable = []
        for i, (task, body) in enumerate(zip(tasks, bodies)):
            if len(body) > MAX_COMPLETION_CHARS:
                scores[i] = _too_long(task, body)
            else:
                runnable.append(i)
        episodes = [(tasks[i].prompt + bodies[i], tasks[i].tests) for i in runnable]
        with self._lock:
            if self._pool is None:
                self._pool = SandboxPool(self.workers, self.limits, self.batch)
            results = self._pool.run_many(episodes) if episodes else []
        for i, result in zip(runnable, results):
            ok = body_format_ok(tasks[i].prompt, bodies[i], tasks[i].entry)
            scores[i] = _score(result, ok)
        return [s for s in scores if s is not None]

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None
