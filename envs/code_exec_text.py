"""CodeExec-v1's 24 tasks as a text environment, so a causal LM can be trained to write them.

Each task becomes a CodeGen-style prompt: the reference's `def` line, then the task statement
as a comment; the completion is the function body (ending at EOS or a blank line), scored by
the same sandbox path as CodeGen-v1 (envs/code_scoring.py). The suite is fixed, so there is
one split, "train"; `tasks` cycles through the suite in a seeded order. A perturbation puts the
statement in a docstring instead of a comment.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.envs.code_scoring import CodeScorer
from shoal.envs.code_tasks import CodeTask, suite
from shoal.envs.text_tasks import Score, TextEnvError, TextEnvironment, TextTask

__all__ = ["CodeExecTextEnv", "text_task"]

GENERATOR = "code_tasks"
GENERATOR_VERSION = 1


def text_task(task: CodeTask, docstring: bool = False) -> TextTask:
    """The text form of one suite task: header + statement as the prompt, the body as the
    reference."""
    header, _, body = task.reference.partition("\n")
    statement = f'    """{task.prompt}"""' if docstring else f"    # {task.prompt}"
    return TextTask(
        id=f"{task.id}~p" if docstring else task.id,
        family=task.id,
        prompt=f"{header}\n{statement}\n",
        reference=body,
        tests=task.tests,
        entry=task.entry,
        params=(("suite_task", task.id), ("docstring", docstring)),
    )


class CodeExecTextEnv(TextEnvironment):
    """The suite's tasks as prompts; scoring runs in a lazily started sandbox pool."""

    name = "CodeExec-v1"
    generator = GENERATOR
    version = GENERATOR_VERSION
    splits = ("train",)
    stop = ("\n\n",)
    max_prompt_tokens = 256

    def __init__(
        self,
        tokenizer: Any = "bytes",
        max_new_tokens: int = 384,
        suite_name: str = "basic",
        workers: int = 2,
        batch: int = 32,
    ) -> None:
        super().__init__(tokenizer, max_new_tokens)
        self.suite_name = suite_name
        self.suite = tuple(text_task(task) for task in suite(suite_name))
        self._by_id = {task.id: task for task in suite(suite_name)}
        self._scorer = CodeScorer(workers, batch)

    def params(self) -> dict[str, Any]:
        return {
            "suite": self.suite_name,
            "tasks": [[t.id, t.prompt, t.reference, [x.call for x in t.tests]] for t in self.suite],
        }

    def _generate(self, split: str, count: int, rng: np.random.Generator) -> list[TextTask]:
        rounds = -(-count // len(self.suite))
        order = np.concatenate([rng.permutation(len(self.suite)) for _ in range(rounds)])
        return [self.suite[int(i)] for i in order[:count]]

    def _score(self, tasks: list[TextTask], completions: list[str]) -> list[Score]:
        return self._scorer.score(tasks, completions)

    def perturb(self, task: TextTask, rng: np.random.Generator) -> TextTask:
        """The statement as a docstring instead of a comment (the tests are the same)."""
        source = self._by_id.get(task.family)
        if source is None:
            raise TextEnvError(f"task {task.id} is not in the {self.suite_name!r} suite")
        return text_task(source, docstring=True)

    def close(self) -> None:
        self._scorer.close()
