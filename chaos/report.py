"""What a chaos run reports: per fault when it was injected and healed and how fast the
cluster recovered, per invariant whether it held and why; as JSON or as a short text."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from shoal.chaos.curve import Sample, plot, recovery_stats
from shoal.chaos.invariants import Verdict


@dataclass
class FaultRecord:
    kind: str
    target: str
    processes: list[str]
    injected_at: float | None = None
    healed_at: float | None = None
    recovered: bool = False
    recovery_s: float | None = None
    detail: str = ""
    bound_s: float = 0.0
    """duration + recover_within_s: recovery (and training progress) must come within it."""
    progress_s: float | None = None
    """Seconds from injection until the training job progressed again after the heal."""
    masked_by: str | None = None
    """A later fault that restarted the learner group before training recovered from this
    one ("kind target"): this one's recovery cannot be timed apart from it."""
    held_to_s: float | None = None
    """The bound training progress is held to, from injection: `bound_s`, or the masking
    fault's deadline when that is later (chaos/curve.py `held_to`)."""
    liveness: dict[str, list[str]] = field(default_factory=dict)
    """Node faults: each faulted node's liveness as the leader gave it, in order."""
    tasks_elsewhere_s: float | None = None
    """Node faults: seconds from injection until every task of the job the node ran was
    running on another node (None: nothing moved, e.g. the node was back before it was
    declared dead; `detail` says why)."""
    tasks_elsewhere_target_s: float | None = None
    unsupported: str | None = None
    """Why this machine could not make the fault at all (a kernel without netem, no hosts):
    nothing was injected, so no recovery is due; shown, never counted as recovered."""


@dataclass
class RunReport:
    scenario: str
    run_dir: str
    faults: list[FaultRecord]
    invariants: dict[str, Verdict]
    operations: int
    workload: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(v.held for v in self.invariants.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "ok": self.ok,
            "run_dir": self.run_dir,
            "operations": self.operations,
            "workload": self.workload,
            "faults": [asdict(f) for f in self.faults],
            "recovery": recovery_stats([asdict(f) for f in self.faults]),
            "tasks_elsewhere": _elsewhere(self.faults),
            "invariants": {name: v.to_dict() for name, v in self.invariants.items()},
            "training": self.training,
        }


def render_text(report: RunReport) -> str:
    lines = [f"chaos scenario {report.scenario}: {'PASSED' if report.ok else 'FAILED'}"]
    lines.append(f"  {report.operations} operations checked; workload {report.workload}")
    lines.append("  faults:")
    for f in report.faults:
        took = "not recovered" if f.recovery_s is None else f"recovered in {f.recovery_s:.2f} s"
        if f.unsupported is not None:
            took = f"UNSUPPORTED here: {f.unsupported}"
        at = "-" if f.injected_at is None else f"{f.injected_at:.1f}"
        trained = "" if f.progress_s is None else f"; training again after {f.progress_s:.2f} s"
        if f.masked_by is not None:
            trained += f" (masked by {f.masked_by})"
        moved = (
            ""
            if f.tasks_elsewhere_s is None
            else f"; tasks running elsewhere after {f.tasks_elsewhere_s:.2f} s "
            f"(target {f.tasks_elsewhere_target_s:g} s)"
        )
        lines.append(
            f"    t={at:>6} s  {f.kind:<15} {f.target:<9} {f.processes}  {took}{trained}{moved}"
        )
    lines.append("  recovery (s):")
    for kind, stats in recovery_stats([asdict(f) for f in report.faults]).items():
        lines.append(
            f"    {kind:<15} {stats['faults']:>3} faults  p50 {_secs(stats['p50_s'])}  "
            f"max {_secs(stats['max_s'])}  unrecovered {stats['unrecovered']}"
        )
    lines += _elsewhere_lines(report.faults)
    lines += _training_lines(report)
    lines.append("  invariants:")
    for name, verdict in report.invariants.items():
        lines.append(f"    {'ok  ' if verdict.held else 'FAIL'} {name}: {verdict.detail}")
    if not report.ok:
        lines.append(f"  run directory kept: {report.run_dir}")
    return "\n".join(lines)


def _elsewhere(faults: list[FaultRecord]) -> dict[str, Any]:
    """Node failures measured as the issue states them: seconds until the node's tasks ran
    elsewhere, each fault that moved them, against the target."""
    moved = [f for f in faults if f.tasks_elsewhere_s is not None]
    worst = max((f.tasks_elsewhere_s or 0.0 for f in moved), default=None)
    target = max((f.tasks_elsewhere_target_s or 0.0 for f in moved), default=None)
    return {
        "measured": len(moved),
        "max_s": worst,
        "target_s": target,
        "met": None if worst is None or target is None else worst <= target,
    }


def _elsewhere_lines(faults: list[FaultRecord]) -> list[str]:
    summary = _elsewhere(faults)
    if not summary["measured"]:
        return []
    verdict = "within" if summary["met"] else "OVER"
    return [
        f"  node failure -> its tasks running elsewhere: {summary['measured']} measured, max "
        f"{summary['max_s']:.2f} s ({verdict} the target {summary['target_s']:g} s)"
    ]


def _secs(value: float | None) -> str:
    return "    -" if value is None else f"{value:5.2f}"


def _training_lines(report: RunReport) -> list[str]:
    """The job's curve (policy version and mean return against time), faults marked `^`."""
    training = report.training
    if not training:
        return []
    samples = [Sample(**s) for s in training.get("curve", [])]
    faults = [f.injected_at for f in report.faults if f.injected_at is not None]
    lines = [
        f"  training: {training.get('env')} job {training.get('job')}, "
        f"{training.get('ranks')} ranks, {training.get('workers')} rollout workers, "
        f"{training.get('env_steps')} env steps, {training.get('restarts')} task restarts",
        "  policy version (^ = fault injected):",
    ]
    lines += [f"    {line}" for line in plot(samples, faults, "version")]
    lines.append("  mean return of recent episodes:")
    lines += [f"    {line}" for line in plot(samples, faults, "mean_return")]
    return lines
