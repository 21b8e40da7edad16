"""The training curve of a chaos run, and what it says about recovery. Pure: samples in,
numbers and text out.

A `Sample` is what learner rank 0 last wrote to its status file (status-0.json), stamped with
the scenario's clock. A dead rank's status file stops changing, so "training progresses" is
read as: two consecutive samples after a moment in which both the policy version and the
environment steps rose. After a fault that restarts the learner group, the rise must also
come from a new incarnation (the old one's last write before it died does not count).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

PLOT_WIDTH = 64
PLOT_HEIGHT = 8


@dataclass(frozen=True)
class Sample:
    t: float
    """Seconds since the scenario's workload started."""
    env_steps: int
    version: int
    mean_return: float | None
    """Mean of the rank's recent episode returns; None before the first episode ended."""
    restarts: int
    """Restarts of the job's tasks the coordinator recorded so far."""
    incarnation: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def mean_return(returns: Sequence[float]) -> float | None:
    finite = [float(r) for r in returns if math.isfinite(float(r))]
    return round(statistics.fmean(finite), 3) if finite else None


def progressed_at(
    samples: Sequence[Sample], after: float, old_incarnation: str | None = None
) -> float | None:
    """The time of the first sample at or after `after` whose version and env_steps both rose
    over the sample before it (also at or after `after`); with `old_incarnation`, only samples
    of another incarnation count. None if training never progressed again."""
    later = [s for s in samples if s.t >= after]
    for before, now in itertools.pairwise(later):
        if old_incarnation is not None and old_incarnation in (before.incarnation, now.incarnation):
            continue
        if now.version > before.version and now.env_steps > before.env_steps:
            return now.t
    return None


@dataclass(frozen=True)
class Recovery:
    """One injected fault as the masking rule sees it: when it came (s into the run), its own
    bound (s from injection), when training progressed again (s from injection; None: never),
    and whether it restarts the learner group."""

    injected_at: float
    bound_s: float
    progress_s: float | None
    restarts_group: bool


def held_to(recoveries: Sequence[Recovery]) -> list[tuple[int | None, float]]:
    """Per fault: the later fault that masked its recovery (its index, or None) and the bound
    it is held to (s from its injection).

    A fault whose recovery is interrupted — a later fault restarts the learner group before
    training progressed again — cannot be timed apart from that fault: the new group starts
    from scratch. It is then held to the masking fault's deadline (injection + bound) if that
    is later than its own, and so on along the chain, so the last fault of a chain is always
    held to its own bound and a scenario cannot pass without training recovering at its end."""
    order = sorted(range(len(recoveries)), key=lambda i: recoveries[i].injected_at)
    result: list[tuple[int | None, float]] = [(None, r.bound_s) for r in recoveries]
    deadline = {i: recoveries[i].injected_at + recoveries[i].bound_s for i in order}
    for pos in reversed(range(len(order))):
        i = order[pos]
        mine = recoveries[i]
        back = None if mine.progress_s is None else mine.injected_at + mine.progress_s
        masker = next(
            (
                j
                for j in order[pos + 1 :]
                if recoveries[j].restarts_group
                and recoveries[j].injected_at > mine.injected_at
                and (back is None or recoveries[j].injected_at < back)
            ),
            None,
        )
        if masker is not None:
            deadline[i] = max(deadline[i], deadline[masker])
        result[i] = (masker, round(deadline[i] - mine.injected_at, 3))
    return result


def incarnation_at(samples: Sequence[Sample], t: float) -> str | None:
    """The incarnation of the newest sample taken at or before `t`."""
    earlier = [s for s in samples if s.t <= t]
    return earlier[-1].incarnation if earlier else None


def thin(samples: Sequence[Sample], every: float) -> list[Sample]:
    """At most one sample per `every` seconds (the first of each period), and the last one."""
    kept: list[Sample] = []
    for sample in samples:
        if not kept or sample.t >= kept[-1].t + every:
            kept.append(sample)
    if samples and kept[-1] is not samples[-1]:
        kept.append(samples[-1])
    return kept


def recovery_stats(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """p50 and max of the measured recovery times per fault kind and overall ("all"); a fault
    that never recovered counts in `unrecovered`, not in the times; one this machine could not
    make (`unsupported`) in neither."""
    made = [r for r in records if not r.get("unsupported")]
    groups: dict[str, list[dict[str, Any]]] = {"all": made}
    for record in made:
        groups.setdefault(str(record["kind"]), []).append(record)
    out = {}
    for kind, members in groups.items():
        times = [float(r["recovery_s"]) for r in members if r.get("recovery_s") is not None]
        out[kind] = {
            "faults": len(members),
            "p50_s": round(statistics.median(times), 3) if times else None,
            "max_s": round(max(times), 3) if times else None,
            "unrecovered": sum(1 for r in members if not r.get("recovered")),
        }
    return out


def plot(
    samples: Sequence[Sample],
    fault_times: Sequence[float],
    value: str = "version",
    width: int = PLOT_WIDTH,
    height: int = PLOT_HEIGHT,
) -> list[str]:
    """A small text plot of one sample field over time, one column per time slot (the slot's
    newest sample), with a `^` under each fault's injection time."""
    if not samples:
        return ["(no training samples)"]
    start, end = samples[0].t, max(samples[-1].t, max(fault_times, default=0.0))
    span = max(end - start, 1e-9)

    def column(t: float) -> int:
        return min(width - 1, max(0, int((t - start) / span * (width - 1))))

    slots: dict[int, float] = {}
    for sample in samples:
        raw = getattr(sample, value)
        if raw is not None:
            slots[column(sample.t)] = float(raw)
    if not slots:
        return [f"(no {value} samples)"]
    # A slot without a sample of its own shows the last value before it (nothing changed).
    last = slots[min(slots)]
    for col in range(min(slots), column(samples[-1].t) + 1):
        last = slots.setdefault(col, last)
    low, high = min(slots.values()), max(slots.values())
    scale = (high - low) or 1.0
    rows = [[" "] * width for _ in range(height)]
    for col, v in slots.items():
        level = round((v - low) / scale * (height - 1))
        rows[height - 1 - level][col] = "*"
    marks = [" "] * width
    for t in fault_times:
        marks[column(t)] = "^"
    label = max(len(f"{high:g}"), len(f"{low:g}"))
    lines = []
    for i, row in enumerate(rows):
        tag = f"{high:g}" if i == 0 else f"{low:g}" if i == height - 1 else ""
        lines.append(f"{tag:>{label}} |{''.join(row)}")
    lines.append(f"{'':>{label}} +{'-' * width}")
    lines.append(f"{'':>{label}}  {''.join(marks).rstrip()}")
    axis = f"t={start:.0f} s"
    lines.append(f"{'':>{label}}  {axis}{f't={end:.0f} s':>{width - len(axis)}}")
    return lines
