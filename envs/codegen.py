"""CodeGen-v1: a seeded rule engine of tiny Python tasks whose completion is a function body.

Prompt format (every task; under 160 bytes):

    def f(x):
        # return x plus 3; f(1)=4, f(5)=8

The completion is the body, e.g. ``    return x + 3\\n``; generation ends at EOS or a blank line
(stop string "\\n\\n"). The program prompt + body runs in the sandbox against 5 hidden tests
(calls on fresh inputs, never the two shown); reward is text_tasks' documented formula.

Ten FAMILIES, each a rule with one integer parameter k: eight are trained on, two (`max`,
`list_mul`, neighbours of `min` and `list_add`) are held out as families. Within a train
family the parameter values fall into four disjoint sets (VALUE_SETS), one per use:

- HELD_OUT_VALUES (12, 21, 25, 34): the "heldout" test split asks for exactly those;
- VALIDATION_VALUES (11, 15, 23, 32): the "validation" split, which picks the RL checkpoint,
  asks for exactly those, so it measures what the test measures (values never trained on);
- RL_VALUES (10, 14, 19, 26, 28, 30, 33, 37): the "rl" split, the RL stage's prompts. RL needs
  tests, not references, so it can draw on values supervised training never saw: there a
  policy earns reward only by copying k from the statement, not by recalling a (family, k)
  pair, which is what the held-out values test;
- every other value: "train", the supervised (SFT and distillation) data.

Each reserved value is a two-digit combination whose digits "train" uses in the same places
(1x and x2, 2x and x1, ...), so a model that copies k from the statement digit by digit
generalises, one that memorised (family, k) pairs does not; a byte a model never copied (a
held-out single digit) would test something no training could reach. The string families (k up
to 5 or 6) have no reserved values: they are in "train" only. "validation" and "rl" are pool
splits (POOL_SPLITS): drawn like the others but not test splits, so the cluster's end-of-run
evaluation (learner/text_job.py) never scores them. Every task is drawn from the split's own
seeded stream: the same (split, count, seed) gives the same tasks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shoal.envs.code_scoring import CodeScorer
from shoal.envs.sandbox import TestCase
from shoal.envs.text_tasks import Score, TextEnvError, TextEnvironment, TextTask

__all__ = [
    "FAMILIES",
    "HELD_OUT_VALUES",
    "POOL_SPLITS",
    "RL_VALUES",
    "VALIDATION_VALUES",
    "VALUE_SETS",
    "CodeGenEnv",
    "Family",
    "render",
]

GENERATOR = "codegen"
GENERATOR_VERSION = 2
"""2: the validation and rl value sets carved out of train (1: train was every other value)."""
ENTRY = "f"
HELD_OUT_VALUES = frozenset({12, 21, 25, 34})
VALIDATION_VALUES = frozenset({11, 15, 23, 32})
RL_VALUES = frozenset({10, 14, 19, 26, 28, 30, 33, 37})
VALUE_SETS = {"heldout": HELD_OUT_VALUES, "validation": VALIDATION_VALUES, "rl": RL_VALUES}
"""The reserved values of each split of train families; "train" has the rest."""
POOL_SPLITS = ("validation", "rl")
"""Splits a pipeline draws from that are not test splits (not in `CodeGenEnv.splits`)."""
TESTS_PER_TASK = 5
MAX_PROMPT_BYTES = 192

Value = Any
_ARG_NAMES = {"int": ("x", "n", "a"), "str": ("s", "w", "t"), "list": ("xs", "ys", "nums")}


@dataclass(frozen=True)
class Family:
    """One rule: `wordings` of its statement, the reference `body`, and what it computes.

    Templates use {a} (the argument's name) and {k} (the parameter)."""

    name: str
    kind: str
    """"int", "str" or "list": the argument's type, which picks its inputs."""
    wordings: tuple[str, ...]
    body: str
    values: tuple[int, ...]
    rule: Callable[[Value, int], Value]
    heldout: bool = False
    pivot: bool = False
    """Inputs are drawn around k, and the examples and two hidden tests straddle it (one below,
    one above; for strings, length), so they show the comparison and neither the identity nor
    a constant passes."""

    def describe(self) -> dict[str, Any]:
        """Everything that defines the family, for the environment hash."""
        return {
            "name": self.name,
            "kind": self.kind,
            "wordings": list(self.wordings),
            "body": self.body,
            "values": list(self.values),
            "heldout": self.heldout,
            "pivot": self.pivot,
        }


FAMILIES: tuple[Family, ...] = (
    Family(
        "add",
        "int",
        ("return {a} plus {k}", "return {k} more than {a}"),
        "return {a} + {k}",
        tuple(range(1, 40)),
        lambda x, k: x + k,
    ),
    Family(
        "sub",
        "int",
        ("return {a} minus {k}", "return {k} less than {a}"),
        "return {a} - {k}",
        tuple(range(1, 40)),
        lambda x, k: x - k,
    ),
    Family(
        "mul",
        "int",
        ("return {a} times {k}", "return {a} multiplied by {k}"),
        "return {a} * {k}",
        tuple(range(2, 13)),
        lambda x, k: x * k,
    ),
    Family(
        "min",
        "int",
        ("return the smaller of {a} and {k}", "return {a} but at most {k}"),
        "return min({a}, {k})",
        tuple(range(1, 40)),
        lambda x, k: min(x, k),
        pivot=True,
    ),
    Family(
        "repeat",
        "str",
        ("return {a} repeated {k} times", "return {k} copies of {a} joined"),
        "return {a} * {k}",
        tuple(range(2, 6)),
        lambda s, k: s * k,
    ),
    Family(
        "head",
        "str",
        ("return the first {k} chars of {a}", "return {a} cut to {k} chars"),
        "return {a}[:{k}]",
        tuple(range(1, 7)),
        lambda s, k: s[:k],
        pivot=True,
    ),
    Family(
        "list_add",
        "list",
        ("return {a} with {k} added to each item", "add {k} to every item of {a}"),
        "return [v + {k} for v in {a}]",
        tuple(range(1, 40)),
        lambda xs, k: [v + k for v in xs],
    ),
    Family(
        "filter_gt",
        "list",
        ("return the items of {a} above {k}", "keep the items of {a} over {k}"),
        "return [v for v in {a} if v > {k}]",
        tuple(range(1, 40)),
        lambda xs, k: [v for v in xs if v > k],
        pivot=True,
    ),
    Family(
        "max",
        "int",
        ("return the larger of {a} and {k}", "return {a} but at least {k}"),
        "return max({a}, {k})",
        tuple(range(1, 40)),
        lambda x, k: max(x, k),
        heldout=True,
        pivot=True,
    ),
    Family(
        "list_mul",
        "list",
        ("return {a} with each item times {k}", "multiply every item of {a} by {k}"),
        "return [v * {k} for v in {a}]",
        tuple(range(2, 13)),
        lambda xs, k: [v * k for v in xs],
        heldout=True,
    ),
)
_BY_NAME = {family.name: family for family in FAMILIES}
_LETTERS = "abcdefgh"


def _word(rng: np.random.Generator, low: int, high: int) -> str:
    size = int(rng.integers(low, high + 1))
    return "".join(_LETTERS[int(i)] for i in rng.integers(len(_LETTERS), size=size))


def _input(kind: str, rng: np.random.Generator, wide: bool) -> Value:
    """One argument; `wide` inputs (hidden tests) range further than the shown examples."""
    if kind == "int":
        return int(rng.integers(-20, 31)) if wide else int(rng.integers(0, 10))
    if kind == "str":
        return _word(rng, 0, 7) if wide else _word(rng, 2, 4)
    size = int(rng.integers(0, 5)) if wide else int(rng.integers(2, 4))
    low = -5 if wide else 0
    return [int(v) for v in rng.integers(low, 10, size=size)]


def _side(kind: str, k: int, above: bool, rng: np.random.Generator, floor: int) -> Value:
    """An input on one side of k: an int (or a list's telling item) from max(floor, k - 9) to
    k - 1, or above k; a string no longer than k, or longer."""
    if kind == "str":
        return _word(rng, k + 1, k + 4) if above else _word(rng, 1, k)
    value = int(rng.integers(k + 1, k + 10)) if above else int(rng.integers(max(floor, k - 9), k))
    if kind == "int":
        return value
    other = int(rng.integers(max(0, k - 9), k + 10))
    return [value, other] if rng.random() < 0.5 else [other, value]


def _pivot_input(kind: str, k: int, rng: np.random.Generator) -> Value:
    """A hidden-test input of a pivot family: drawn around k, so both sides are likely."""
    if kind == "int":
        return k + int(rng.integers(-15, 16))
    if kind == "str":
        return _word(rng, 0, k + 4)
    return [k + int(v) for v in rng.integers(-10, 11, size=int(rng.integers(0, 5)))]


def _straddle(family: Family, k: int, rng: np.random.Generator) -> list[Value]:
    """Two shown inputs, one on each side of k (none negative), in random order."""
    pair = [_side(family.kind, k, False, rng, 0), _side(family.kind, k, True, rng, 0)]
    return pair if rng.random() < 0.5 else pair[::-1]


def _distinct(draw: Callable[[], Value], count: int, avoid: list[Value]) -> list[Value]:
    """`count` inputs from `draw` that differ from each other and from `avoid` (tries bounded:
    a repeat is allowed rather than looping when the input space is small)."""
    out: list[Value] = []
    for _ in range(count * 20):
        value = draw()
        if value not in out and value not in avoid:
            out.append(value)
            if len(out) == count:
                return out
    while len(out) < count:
        out.append(draw())
    return out


def _examples(family: Family, k: int, rng: np.random.Generator) -> list[Value]:
    if family.pivot:
        return _straddle(family, k, rng)
    return _distinct(lambda: _input(family.kind, rng, wide=False), 2, [])


def _hidden(family: Family, k: int, rng: np.random.Generator, shown: list[Value]) -> list[Value]:
    """TESTS_PER_TASK fresh inputs; a pivot family's start with one on each side of k, so
    neither the identity nor a constant passes them all."""
    if not family.pivot:
        return _distinct(lambda: _input(family.kind, rng, wide=True), TESTS_PER_TASK, shown)
    below = _distinct(lambda: _side(family.kind, k, False, rng, k - 9), 1, shown)
    above = _distinct(lambda: _side(family.kind, k, True, rng, k - 9), 1, shown + below)
    rest = _distinct(
        lambda: _pivot_input(family.kind, k, rng), TESTS_PER_TASK - 2, shown + below + above
    )
    return below + above + rest


def render(family: Family, k: int, arg: str, wording: int, examples: list[Value]) -> str:
    """The prompt: header, then the statement and two examples in one comment line."""
    statement = family.wordings[wording].format(a=arg, k=k)
    shown = ", ".join(f"{ENTRY}({x!r})={family.rule(x, k)!r}" for x in examples)
    return f"def {ENTRY}({arg}):\n    # {statement}; {shown}\n"


def _reference(family: Family, k: int, arg: str) -> str:
    return "    " + family.body.format(a=arg, k=k) + "\n"


def _task(family: Family, k: int, rng: np.random.Generator) -> TextTask:
    arg = _ARG_NAMES[family.kind][0]
    examples = _examples(family, k, rng)
    hidden = _hidden(family, k, rng, examples)
    tests = tuple(TestCase(f"{ENTRY}({x!r})", family.rule(x, k)) for x in hidden)
    prompt = render(family, k, arg, 0, examples)
    key = json.dumps([prompt, [[t.call, t.expected] for t in tests]])
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return TextTask(
        id=f"{family.name}-k{k}-{digest}",
        family=family.name,
        prompt=prompt,
        reference=_reference(family, k, arg),
        tests=tests,
        entry=ENTRY,
        params=(("k", k), ("arg", arg), ("wording", 0), ("examples", tuple(examples))),
    )


def split_pools(split: str) -> list[tuple[Family, tuple[int, ...]]]:
    """The (family, parameter values) a split draws from; a family with no value in the split's
    set is not in it."""
    if split == "heldout_families":
        return [(f, f.values) for f in FAMILIES if f.heldout]
    train = [f for f in FAMILIES if not f.heldout]
    if split in VALUE_SETS:
        wanted = VALUE_SETS[split]
        pools = [(f, tuple(v for v in f.values if v in wanted)) for f in train]
    else:
        reserved = frozenset().union(*VALUE_SETS.values())
        pools = [(f, tuple(v for v in f.values if v not in reserved)) for f in train]
    return [(f, values) for f, values in pools if values]


class CodeGenEnv(TextEnvironment):
    """CodeGen-v1 (see the module docstring); scoring runs in a lazily started sandbox pool."""

    name = "CodeGen-v1"
    generator = GENERATOR
    version = GENERATOR_VERSION
    stop = ("\n\n",)
    max_prompt_tokens = MAX_PROMPT_BYTES
    pool_splits: tuple[str, ...] = POOL_SPLITS
    """Splits beside `splits` that `tasks` draws (learner/lm_validation.py's `pool_split`)."""

    def __init__(
        self,
        tokenizer: Any = "bytes",
        max_new_tokens: int = 64,
        workers: int = 2,
        batch: int = 32,
    ) -> None:
        super().__init__(tokenizer, max_new_tokens)
        self._scorer = CodeScorer(workers, batch)

    def params(self) -> dict[str, Any]:
        return {
            "families": [family.describe() for family in FAMILIES],
            "held_out_values": sorted(HELD_OUT_VALUES),
            "validation_values": sorted(VALIDATION_VALUES),
            "rl_values": sorted(RL_VALUES),
            "tests_per_task": TESTS_PER_TASK,
            "entry": ENTRY,
        }

    def _generate(self, split: str, count: int, rng: np.random.Generator) -> list[TextTask]:
        pools = split_pools(split)
        tasks = []
        for _ in range(count):
            family, values = pools[int(rng.integers(len(pools)))]
            tasks.append(_task(family, int(values[int(rng.integers(len(values)))]), rng))
        return tasks

    def _score(self, tasks: list[TextTask], completions: list[str]) -> list[Score]:
        return self._scorer.score(tasks, completions)

    def perturb(self, task: TextTask, rng: np.random.Generator) -> TextTask:
        """Another wording, another argument name, or the examples swapped (at least one;
        each with probability 1/2); the tests, and so the semantics, are unchanged."""
        family = _BY_NAME.get(task.family)
        if family is None:
            raise TextEnvError(f"task {task.id} is not a CodeGen task (family {task.family!r})")
        k, arg, wording = task.param("k"), task.param("arg"), task.param("wording")
        examples = list(task.param("examples"))
        changes = rng.random(3) < 0.5
        if not changes.any():
            changes[int(rng.integers(3))] = True
        if changes[0]:
            wording = (wording + 1) % len(family.wordings)
        if changes[1]:
            names = [n for n in _ARG_NAMES[family.kind] if n != arg]
            arg = names[int(rng.integers(len(names)))]
        if changes[2]:
            examples.reverse()
        return TextTask(
            id=f"{task.id}~p",
            family=task.family,
            prompt=render(family, k, arg, wording, examples),
            reference=_reference(family, k, arg),
            tests=task.tests,
            entry=task.entry,
            params=(("k", k), ("arg", arg), ("wording", wording), ("examples", tuple(examples))),
        )

    def close(self) -> None:
        self._scorer.close()
