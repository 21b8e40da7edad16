"""Countdown-v1: make a target from given numbers with + - *, checked exactly, no sandbox.

Prompt ``make 13 from 3 5 2\\n``, completion an expression using each number exactly once,
e.g. ``3*5-2\\n`` (generation stops at the newline or EOS). The checker parses the expression
with `ast` and evaluates it itself: only integer literals, + - * and parentheses are accepted,
so nothing a completion says is ever executed. The format term is "it parses as such an
expression"; the test is "it uses exactly the given numbers and equals the target".

Families: three numbers (trained on) and four numbers (held out). Targets that are multiples
of 5 never appear in "train"; the "heldout" split asks only for those.
"""

from __future__ import annotations

import ast
import warnings
from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np

from shoal.envs.text_tasks import Score, TextEnvError, TextEnvironment, TextTask, reward_of

__all__ = ["CountdownEnv", "ExpressionError", "evaluate"]

GENERATOR = "countdown"
GENERATOR_VERSION = 1
MAX_EXPRESSION_CHARS = 64
MAX_TARGET = 99
HELD_OUT_DIVISOR = 5
FAMILIES = {"three": 3, "four": 4}
HELD_OUT_FAMILIES = frozenset({"four"})
_OPS: dict[type, Any] = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__}
_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}
_WORDINGS = ("make {t} from {n}\n", "use {n} to make {t}\n")


class ExpressionError(ValueError):
    """The text is not an expression of integer literals, + - * and parentheses."""


def _value(node: ast.AST, literals: list[int]) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        literals.append(node.value)
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left, literals), _value(node.right, literals)
        result: int = _OPS[type(node.op)](left, right)
        return result
    raise ExpressionError(f"{type(node).__name__} is not allowed: use integers, + - * and ()")


def evaluate(text: str) -> tuple[int, list[int]]:
    """The value of an arithmetic expression and the literals it uses, or ExpressionError.

    Hostile input is bounded first (length), so parsing and the recursion stay small."""
    stripped = text.strip()
    if not stripped or len(stripped) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"an expression has 1 to {MAX_EXPRESSION_CHARS} characters")
    try:
        with warnings.catch_warnings():  # `2x` is scored, not printed on the console
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(stripped, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ExpressionError(f"not an expression: {exc}") from None
    literals: list[int] = []
    return _value(tree.body, literals), literals


def _expression(numbers: list[int], rng: np.random.Generator) -> tuple[str, str]:
    """A random expression tree over `numbers` in order, written with the parentheses it
    needs and no others; returns the text and its top operator ("" for a literal)."""
    if len(numbers) == 1:
        return str(numbers[0]), ""
    cut = int(rng.integers(1, len(numbers)))
    (left, left_op), (right, right_op) = (
        _expression(numbers[:cut], rng),
        _expression(numbers[cut:], rng),
    )
    op = "+-*"[int(rng.integers(3))]
    if op == "*" and left_op in ("+", "-"):
        left = f"({left})"
    if op in ("-", "*") and right_op in ("+", "-"):
        right = f"({right})"
    return f"{left}{op}{right}", op


def _draw(size: int, split: str, rng: np.random.Generator) -> tuple[list[int], str, int]:
    """Numbers, a reference expression and its target, fitting the split's target rule."""
    while True:
        numbers = [int(v) for v in rng.integers(1, 10, size=size)]
        text, _ = _expression(numbers, rng)
        target, _ = evaluate(text)
        if not 0 < target <= MAX_TARGET:
            continue
        held_out = target % HELD_OUT_DIVISOR == 0
        if split == "heldout_families" or held_out == (split == "heldout"):
            return numbers, text, target


def _prompt(numbers: list[int], target: int, wording: int) -> str:
    return _WORDINGS[wording].format(t=target, n=" ".join(map(str, numbers)))


def check(task: TextTask, completion: str) -> Score:
    """The exact verdict on one completion (pure: nothing is executed)."""
    numbers = list(task.param("numbers"))
    target = int(task.param("target"))
    try:
        value, used = evaluate(completion)
    except ExpressionError as exc:
        return Score(0.0, 0, 1, "syntax_error", str(exc)[:300], f"{completion[:64]!r}", False)
    if Counter(used) != Counter(numbers):
        message = f"uses {sorted(used)}; the numbers are {sorted(numbers)}, each exactly once"
        return Score(reward_of(0, 1, "ok", True), 0, 1, "ok", message, message, True)
    if value != target:
        message = f"equals {value}, not {target}"
        return Score(reward_of(0, 1, "ok", True), 0, 1, "ok", message, message, True)
    return Score(reward_of(1, 1, "ok", True), 1, 1, "ok", "1/1 tests passed", None, True)


class CountdownEnv(TextEnvironment):
    """Countdown-v1 (see the module docstring); scoring is pure Python on the caller's thread."""

    name = "Countdown-v1"
    generator = GENERATOR
    version = GENERATOR_VERSION
    stop = ("\n",)
    max_prompt_tokens = 48

    def params(self) -> dict[str, Any]:
        return {
            "families": dict(FAMILIES),
            "held_out_families": sorted(HELD_OUT_FAMILIES),
            "held_out_divisor": HELD_OUT_DIVISOR,
            "max_target": MAX_TARGET,
            "wordings": list(_WORDINGS),
            "operators": sorted(_SYMBOLS.values()),
        }

    def _generate(self, split: str, count: int, rng: np.random.Generator) -> list[TextTask]:
        held = split == "heldout_families"
        names = [name for name in FAMILIES if (name in HELD_OUT_FAMILIES) == held]
        tasks = []
        for _ in range(count):
            family = names[int(rng.integers(len(names)))]
            numbers, reference, target = _draw(FAMILIES[family], split, rng)
            tasks.append(_task(family, numbers, target, reference, 0))
        return tasks

    def _score(self, tasks: list[TextTask], completions: list[str]) -> list[Score]:
        return [check(task, completion) for task, completion in zip(tasks, completions)]

    def perturb(self, task: TextTask, rng: np.random.Generator) -> TextTask:
        """The numbers shown in another order and the other wording (same numbers, same target)."""
        if task.family not in FAMILIES:
            raise TextEnvError(f"task {task.id} is not a Countdown task (family {task.family!r})")
        numbers = list(task.param("numbers"))
        shuffled = [numbers[int(i)] for i in rng.permutation(len(numbers))]
        wording = (int(task.param("wording")) + 1) % len(_WORDINGS)
        perturbed = _task(
            task.family, shuffled, int(task.param("target")), task.reference[:-1], wording
        )
        return replace(perturbed, id=f"{task.id}~p")

    def close(self) -> None:
        """Countdown holds nothing to release."""


def _task(family: str, numbers: list[int], target: int, reference: str, wording: int) -> TextTask:
    shown = "-".join(map(str, numbers))
    return TextTask(
        id=f"{family}-{shown}-t{target}",
        family=family,
        prompt=_prompt(numbers, target, wording),
        reference=reference + "\n",
        answer=str(target),
        params=(("numbers", tuple(numbers)), ("target", target), ("wording", wording)),
    )
