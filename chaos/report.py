"""What a chaos run reports: per fault when it was injected and healed and how fast the
cluster recovered, per invariant whether it held and why; as JSON or as a short text."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

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


@dataclass
class RunReport:
    scenario: str
    run_dir: str
    faults: list[FaultRecord]
    invariants: dict[str, Verdict]
    operations: int
    workload: dict[str, Any] = field(default_factory=dict)

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
            "invariants": {name: v.to_dict() for name, v in self.invariants.items()},
        }


def render_text(report: RunReport) -> str:
    lines = [f"chaos scenario {report.scenario}: {'PASSED' if report.ok else 'FAILED'}"]
    lines.append(f"  {report.operations} operations checked; workload {report.workload}")
    lines.append("  faults:")
    for f in report.faults:
        took = "not recovered" if f.recovery_s is None else f"recovered in {f.recovery_s:.2f} s"
        at = "-" if f.injected_at is None else f"{f.injected_at:.1f}"
        lines.append(f"    t={at:>6} s  {f.kind:<14} {f.target:<9} {f.processes}  {took}")
    lines.append("  invariants:")
    for name, verdict in report.invariants.items():
        lines.append(f"    {'ok  ' if verdict.held else 'FAIL'} {name}: {verdict.detail}")
    if not report.ok:
        lines.append(f"  run directory kept: {report.run_dir}")
    return "\n".join(lines)
