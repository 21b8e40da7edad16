"""pass@k of a code-writing policy on task splits, with the sandbox's failure breakdown.

A policy is evaluated through a `Sampler` (tasks, n -> n completions per task), so this module
knows nothing of models or generation: the pipeline hands it one over its `Generator`, a test
hands it a function. Each split's n samples per task are scored in ONE batched `score_many`
call; a sample *passes* when every hidden test passes. pass@k is the unbiased estimator of Chen
et al. (2021), 1 - C(n-c, k)/C(n, k) averaged over tasks, which has a far smaller variance than
drawing k of the samples once.

Every sample that does not pass is put in one bucket of the failure breakdown: the sandbox's
status (syntax_error, timeout, runtime_error, ...) when the program did not run to the end, or
`wrong_answer` when it ran and a test failed.

Policies evaluated on the same tasks are compared task by task (`compare`): the report says how
far RL moved held-out pass@1 from the distilled student, with the paired standard error, which
is far smaller than either policy's own (a task one finds hard the other mostly does too).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shoal.envs import report_html
from shoal.files import write_atomically
from shoal.learner.errors import LearnerError

PASSED = "passed"
WRONG_ANSWER = "wrong_answer"
MAX_EXAMPLES = 4
"""Failing samples kept per split for the report (the first of each failure kind)."""
MAX_SHOWN_CHARS = 400
COMPARED = (("rl", "student"), ("student", "teacher"))
"""(policy, baseline) pairs `compare` reports where both were evaluated: what RL added to the
distilled student, and what distillation kept of the teacher."""


class EvalError(LearnerError):
    """An evaluation that cannot be computed (bad n/c/k, a sampler that returned the wrong
    number of completions); the message says which."""


class ScoreLike(Protocol):
    passed: int
    total: int
    reward: float
    status: Any
    format_ok: bool


class ScoringEnv(Protocol):
    def score_many(self, tasks: Sequence[Any], completions: Sequence[str]) -> Sequence[Any]: ...


Sampler = Callable[[Sequence[Any], int], list[list[str]]]
"""(tasks, n) -> for each task, n sampled completions (texts)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one task from n samples of which c passed: 1 - C(n-c,k)/C(n,k),
    computed as a product so it neither overflows nor loses precision."""
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise EvalError(f"pass_at_k needs integers, got n={n!r}, c={c!r}, k={k!r}")
    if not 0 <= c <= n or not 1 <= k <= n:
        raise EvalError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


@dataclass
class SplitResult:
    """One policy on one split: pass@k per k, rewards, failure kinds, per-family pass@1."""

    split: str
    tasks: int
    samples_per_task: int
    pass_at: dict[str, float]
    """"1", "4", ... -> mean pass@k over the split's tasks (string keys: they go to JSON)."""
    mean_reward: float
    format_rate: float
    """Fraction of samples that met the environment's format check (parsed, defined the entry)."""
    outcomes: dict[str, int]
    """passed / wrong_answer / each sandbox status -> samples."""
    family_pass_at_1: dict[str, float]
    pass_at_1_se: float = float("nan")
    """Standard error of pass@1 over the tasks (sample standard deviation of the per-task
    pass@1 / sqrt(tasks)); NaN for one task."""
    passes: list[int] = field(default_factory=list)
    """Passing samples per task, in the split's task order: two policies evaluated on the same
    tasks compare task by task (a paired difference and its standard error)."""
    examples: list[dict[str, str]] = field(default_factory=list)
    """A few failing samples (task id, outcome, completion), one per failure kind."""
    wall_s: float = 0.0
    tasks_digest: str = ""
    """sha256 of the task ids in order (16 hex digits): `compare` pairs only equal digests."""
    families: list[str] = field(default_factory=list)
    """Each task's family, in task order: `compare`'s clusters."""


@dataclass(frozen=True)
class PairedDifference:
    """pass@1 of `policy` minus `baseline` on one split's tasks, task by task."""

    split: str
    policy: str
    baseline: str
    tasks: int
    difference: float
    se: float
    """Standard error of the mean per-task difference; NaN for one task."""
    se_by_family: float
    """The same with the tasks clustered by family (a cluster-robust standard error): tasks of
    one family share most of what a policy learnt (CodeGen-v1's held-out split is 24 groups of
    one family and one constant), so they are not independent draws and the per-task error
    understates a result's spread. NaN with fewer than two families."""
    families: int
    better: int
    """Tasks where `policy`'s pass@1 is higher."""
    worse: int


Results = Mapping[str, Mapping[str, SplitResult]]
"""policy name -> split name -> result."""


def outcome_of(score: ScoreLike) -> str:
    """The failure-breakdown bucket of one scored sample."""
    if score.total > 0 and score.passed == score.total:
        return PASSED
    status = str(getattr(score.status, "value", score.status))
    return WRONG_ANSWER if status == "ok" else status


def evaluate_split(
    env: ScoringEnv, split: str, tasks: Sequence[Any], sample: Sampler, n: int, ks: Sequence[int]
) -> SplitResult:
    """Sample n completions per task, score them in one batch, and summarise."""
    if not tasks:
        raise EvalError(f"split {split!r} has no tasks to evaluate")
    if any(not 1 <= k <= n for k in ks):
        raise EvalError(f"every k must be from 1 to n = {n}, got {list(ks)}")
    started = time.perf_counter()
    completions = sample(tasks, n)
    if len(completions) != len(tasks) or any(len(c) != n for c in completions):
        raise EvalError(f"the sampler must return {n} completions for each of {len(tasks)} tasks")
    flat_tasks = [t for t in tasks for _ in range(n)]
    flat = [text for row in completions for text in row]
    scores = list(env.score_many(flat_tasks, flat))
    if len(scores) != len(flat):
        raise EvalError(f"score_many returned {len(scores)} scores for {len(flat)} completions")
    outcomes = [outcome_of(s) for s in scores]
    passes = [sum(o == PASSED for o in outcomes[i * n : (i + 1) * n]) for i in range(len(tasks))]
    by_family: dict[str, list[float]] = {}
    for task, c in zip(tasks, passes):
        by_family.setdefault(str(task.family), []).append(pass_at_k(n, c, 1))
    return SplitResult(
        split=split,
        tasks=len(tasks),
        samples_per_task=n,
        pass_at={str(k): _mean([pass_at_k(n, c, k) for c in passes]) for k in ks},
        mean_reward=_mean([float(s.reward) for s in scores]),
        format_rate=_mean([float(bool(s.format_ok)) for s in scores]),
        outcomes=dict(Counter(outcomes).most_common()),
        family_pass_at_1={f: _mean(v) for f, v in sorted(by_family.items())},
        pass_at_1_se=_standard_error([pass_at_k(n, c, 1) for c in passes]),
        passes=passes,
        examples=_examples(flat_tasks, flat, outcomes),
        wall_s=time.perf_counter() - started,
        tasks_digest=tasks_digest([str(t.id) for t in tasks]),
        families=[str(t.family) for t in tasks],
    )


def tasks_digest(ids: Sequence[str]) -> str:
    """The `tasks_digest` of a split whose tasks have these ids, in this order."""
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]


def paired_difference(
    policy: str, result: SplitResult, baseline: str, base: SplitResult
) -> PairedDifference:
    """`result` minus `base` task by task; EvalError unless both scored the same tasks in the
    same order (equal `tasks_digest`) and kept their passes."""
    if result.tasks_digest != base.tasks_digest or len(result.passes) != len(base.passes):
        raise EvalError(
            f"{policy} and {baseline} were not evaluated on the same {result.split} tasks in "
            "the same order: evaluate both on one split to compare them"
        )
    if not result.passes or len(result.passes) != result.tasks:
        raise EvalError(f"{policy}'s {result.split} result holds no per-task passes to compare")
    ours = [pass_at_k(result.samples_per_task, c, 1) for c in result.passes]
    theirs = [pass_at_k(base.samples_per_task, c, 1) for c in base.passes]
    deltas = [a - b for a, b in zip(ours, theirs)]
    families = result.families or ["?"] * len(deltas)  # none recorded: one cluster, NaN
    return PairedDifference(
        split=result.split,
        policy=policy,
        baseline=baseline,
        tasks=len(deltas),
        difference=_mean(deltas),
        se=_standard_error(deltas),
        se_by_family=clustered_standard_error(deltas, families),
        families=len(set(families)),
        better=sum(d > 0 for d in deltas),
        worse=sum(d < 0 for d in deltas),
    )


def clustered_standard_error(values: Sequence[float], clusters: Sequence[str]) -> float:
    """Standard error of the mean of `values` when those of one cluster may be correlated: the
    sum of each cluster's deviations from the mean, squared and summed, with the G / (G - 1)
    small-sample factor (CR1); NaN with fewer than two clusters."""
    sums: dict[str, float] = {}
    mean = _mean(values)
    for value, cluster in zip(values, clusters, strict=True):
        sums[cluster] = sums.get(cluster, 0.0) + value - mean
    groups = len(sums)
    if groups < 2:
        return float("nan")
    spread = math.fsum(total * total for total in sums.values()) * groups / (groups - 1)
    return math.sqrt(spread) / len(values)


def compare(results: Results) -> list[PairedDifference]:
    """Every `COMPARED` pair on every split both policies were evaluated on."""
    return [
        paired_difference(policy, results[policy][split], baseline, results[baseline][split])
        for policy, baseline in COMPARED
        if policy in results and baseline in results
        for split in results[policy]
        if split in results[baseline]
    ]


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else float("nan")


def _standard_error(values: Sequence[float]) -> float:
    if len(values) < 2:
        return float("nan")
    mean = _mean(values)
    variance = math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return math.sqrt(variance / len(values))


def _examples(
    tasks: Sequence[Any], texts: Sequence[str], outcomes: Sequence[str]
) -> list[dict[str, str]]:
    seen: dict[str, dict[str, str]] = {}
    for task, text, outcome in zip(tasks, texts, outcomes):
        if outcome != PASSED and outcome not in seen and len(seen) < MAX_EXAMPLES:
            seen[outcome] = {"task": str(task.id), "outcome": outcome,
                             "completion": text[:MAX_SHOWN_CHARS]}  # fmt: skip
    return list(seen.values())


def evaluate_policy(
    env: ScoringEnv,
    splits: Mapping[str, Sequence[Any]],
    sample: Sampler,
    n: int,
    ks: Sequence[int],
) -> dict[str, SplitResult]:
    """`evaluate_split` on every split, in order."""
    return {name: evaluate_split(env, name, tasks, sample, n, ks) for name, tasks in splits.items()}


def report_dict(
    results: Results, meta: Mapping[str, Any], validation: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON report: `meta` (env, hashes, seeds), every policy's split results and, from a
    pipeline, the RL stage's validation curve and checkpoint choice."""
    report = {
        "meta": dict(meta),
        "policies": {p: {s: asdict(r) for s, r in by.items()} for p, by in results.items()},
        "comparisons": [asdict(c) for c in compare(results)],
    }
    if validation is not None:
        report["validation"] = dict(validation)
    return report


def validation_html(validation: Mapping[str, Any]) -> str:
    """The RL stage's validation curve and which checkpoint it kept, in words and a chart."""
    curve = [report_html.Point(float(step), float(score))
             for step, score in validation["validation_curve"]]  # fmt: skip
    if validation["kept_student"]:
        choice = "no RL checkpoint beat the student on validation: the student was kept"
    else:
        choice = f"kept the RL checkpoint of update {validation['selected_step']}"
    words = (
        f"<p>Validation pass@1: student {validation['validation_student']:.3f}, kept "
        f"{validation['validation_selected']:.3f}; {choice}.</p>"
    )
    chart = report_html.line_svg(curve, "validation pass@1 during RL", "update", "pass@1")
    return f'{words}<div class="plots">{chart}</div>'


def comparisons_html(differences: Sequence[PairedDifference]) -> str:
    """One row per compared pair and split: the mean difference, its paired standard error
    over tasks and clustered by family, and how many tasks went each way."""
    if not differences:
        return "<p>Only one policy was evaluated: nothing to compare.</p>"
    return report_html.table_html(
        ["policy", "minus", "split", "tasks", "pass@1 difference", "paired SE",
         "SE by family", "families", "better", "worse"],
        [[d.policy, d.baseline, d.split, d.tasks, d.difference, d.se, d.se_by_family,
          d.families, d.better, d.worse] for d in differences],
    )  # fmt: skip


def render_html(
    results: Results, meta: Mapping[str, Any], validation: Mapping[str, Any] | None = None
) -> str:
    """A static page: pass@k per policy and split, a pass@1 chart, the failure breakdown."""
    splits = list(dict.fromkeys(s for by in results.values() for s in by))
    ks = list(dict.fromkeys(k for by in results.values() for r in by.values() for k in r.pass_at))
    rows = [
        [policy, split, r.tasks, r.samples_per_task, *[r.pass_at.get(k) for k in ks],
         r.mean_reward, r.format_rate]
        for policy, by in results.items() for split, r in by.items()
    ]  # fmt: skip
    table = report_html.table_html(
        ["policy", "split", "tasks", "samples", *[f"pass@{k}" for k in ks], "reward", "format"],
        rows,
    )
    charts = [
        report_html.bar_svg(
            list(results), [by[s].pass_at.get("1", math.nan) if s in by else math.nan
                            for by in results.values()], f"pass@1: {s}", "pass@1")
        for s in splits
    ]  # fmt: skip
    kinds = list(
        dict.fromkeys(o for by in results.values() for r in by.values() for o in r.outcomes)
    )
    failures = report_html.table_html(
        ["policy", "split", *kinds],
        [
            [p, s, *[r.outcomes.get(o, 0) for o in kinds]]
            for p, by in results.items()
            for s, r in by.items()
        ],
    )
    families = report_html.table_html(
        ["policy", "split", "family", "pass@1"],
        [[p, s, f, v] for p, by in results.items() for s, r in by.items()
         for f, v in r.family_pass_at_1.items()],
    )  # fmt: skip
    examples = report_html.table_html(
        ["policy", "split", "task", "outcome", "completion"],
        [[p, s, e["task"], e["outcome"], e["completion"]] for p, by in results.items()
         for s, r in by.items() for e in r.examples],
    )  # fmt: skip
    run = report_html.table_html(["field", "value"], [[k, json.dumps(v)] for k, v in meta.items()])
    sections = [
        ("Run", run),
        ("pass@k", f'{table}<div class="plots">{"".join(charts)}</div>'),
        ("pass@1 differences, task by task", comparisons_html(compare(results))),
        ("Failure breakdown (samples)", failures),
        ("pass@1 by task family", families),
        ("Failing samples", examples),
    ]
    if validation is not None:
        sections.insert(2, ("RL validation (checkpoint choice)", validation_html(validation)))
    return report_html.page(f"shoal pipeline evaluation: {meta.get('env_id', '')}", sections)


def write_report(
    results: Results,
    meta: Mapping[str, Any],
    out_dir: Path,
    validation: Mapping[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write report.json (strict JSON: NaN as null) and report.html into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, html_path = out_dir / "report.json", out_dir / "report.html"
    report = report_dict(results, meta, validation)
    text = json.dumps(_strict(report), indent=2, sort_keys=True) + "\n"
    write_atomically(json_path, text, durable=True)
    write_atomically(html_path, render_html(results, meta, validation), durable=True)
    return json_path, html_path


def _strict(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value
