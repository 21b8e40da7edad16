"""The RL stage's validation split and its best-by-validation checkpoint.

RL on a weak student can raise the training reward while held-out pass@1 falls (it overfits the
training families' prompts), so the stage keeps the checkpoint that does best on tasks it never
trains on and the final evaluation never sees: the *validation* split. Where the environment
offers a "validation" pool split (CodeGen-v1: train families, parameter values that neither
supervised training, RL nor the test uses; envs/codegen.py) the split is drawn from it, so it is
distributed like the held-out test; elsewhere from the train distribution. Either way it is
drawn on its own seed, with every task whose prompt is in train or in an evaluation split left
out. The held-out test splits take no part in the choice.

The distilled student is the starting point: step 0's validation score is the student's, and an
RL checkpoint is kept only if it scores strictly higher; otherwise the stage keeps the student
and says so.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal import boundedjson
from shoal.envs.text_tasks import TextEnvironment, TextTask
from shoal.learner.errors import PipelineError

CANDIDATES_PER_TASK = 4
"""Draws per wanted validation task: room for the ones that repeat a train or evaluation prompt."""


def validation_seed(seed: int) -> int:
    """The validation split's own seed: derived from the run's seed, but no stream another
    split of this run draws from (train uses `seed`, train_dist `seed + 1`)."""
    digest = hashlib.sha256(f"shoal-validation:{seed}".encode()).digest()
    return int.from_bytes(digest[:7], "big")


def pool_split(env: TextEnvironment, name: str) -> str:
    """`name` where the environment offers it as a pool split (`pool_splits`), else "train"."""
    return name if name in env.pool_splits else "train"


def validation_tasks(
    env: TextEnvironment, count: int, seed: int, taken: Iterable[Sequence[TextTask]]
) -> list[TextTask]:
    """`count` tasks of the validation split (`pool_split(env, "validation")`) on the validation
    seed, none of whose prompts appears in `taken` (the train and evaluation splits) or twice
    among themselves."""
    seen = {task.prompt for tasks in taken for task in tasks}
    chosen = []
    split = pool_split(env, "validation")
    for task in env.tasks(split, count * CANDIDATES_PER_TASK, validation_seed(seed)):
        if task.prompt not in seen:
            seen.add(task.prompt)
            chosen.append(task)
            if len(chosen) == count:
                return chosen
    raise PipelineError(
        f"only {len(chosen)} of {count} validation tasks are new prompts (the rest repeat train or "
        "evaluation tasks); lower pipeline.rl.val_tasks or pipeline.train_tasks"
    )


@dataclass
class BestByValidation:
    """The validation curve and the best point on it; step 0 (the student) is the baseline,
    and a later step replaces the best only by scoring strictly higher."""

    curve: list[tuple[int, float]] = field(default_factory=list)
    best_step: int = 0
    best_score: float = float("-inf")

    def record(self, step: int, score: float) -> bool:
        """Add a point; True when it is the new best (the caller then keeps its weights)."""
        self.curve.append((step, float(score)))
        if score > self.best_score:
            self.best_step, self.best_score = step, float(score)
            return True
        return False

    def summary(self) -> dict[str, Any]:
        """The manifest's and the report's account of the choice (after one point at least)."""
        if not self.curve:
            raise PipelineError("no validation score was recorded")
        return {
            "validation_curve": [[step, score] for step, score in self.curve],
            "validation_student": self.curve[0][1],
            "validation_selected": self.best_score,
            "selected_step": self.best_step,
            "kept_student": self.best_step == 0,
        }


MAX_RECORD_BYTES = 1 << 20
"""The RL stage's validation.json at most: the evaluation stage reads it back from disk."""
MAX_CURVE_POINTS = 100_000
RECORD_DEPTH = 3
"""The record nests three levels: object → validation_curve → [step, pass@1]."""


def parse_record(text: bytes) -> dict[str, Any]:
    """The validation record the RL stage wrote (`BestByValidation.summary`), checked: a file
    edited by hand is hostile input. PipelineError says what is wrong."""
    try:
        record = boundedjson.loads(text, max_bytes=MAX_RECORD_BYTES, max_depth=RECORD_DEPTH)
    except boundedjson.JsonRefused as exc:
        raise PipelineError(f"validation record refused ({exc}); rerun stage rl") from None
    if not isinstance(record, dict) or set(record) != RECORD_KEYS:
        raise PipelineError(f"validation record must have exactly {sorted(RECORD_KEYS)}; "
                            "rerun stage rl")  # fmt: skip
    curve = record["validation_curve"]
    if (
        not isinstance(curve, list)
        or not 1 <= len(curve) <= MAX_CURVE_POINTS
        or not all(_is_point(p) for p in curve)
    ):
        raise PipelineError("validation_curve must be 1+ [step, pass@1] pairs; rerun stage rl")
    for key in ("validation_student", "validation_selected"):
        if not _is_rate(record[key]):
            raise PipelineError(f"{key} must be a pass@1 in [0, 1]; rerun stage rl")
    if not _is_step(record["selected_step"]) or not isinstance(record["kept_student"], bool):
        raise PipelineError("selected_step / kept_student are malformed; rerun stage rl")
    return record


RECORD_KEYS = frozenset(
    ("validation_curve", "validation_student", "validation_selected", "selected_step",
     "kept_student")
)  # fmt: skip


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1 << 40


def _is_rate(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= 1


def _is_point(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and _is_step(value[0]) and _is_rate(value[1])
