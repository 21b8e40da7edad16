"""Counters and summaries rendered in the Prometheus text format (0.0.4), for `/metrics`.

Event-loop only. Names follow Prometheus conventions: `shoal_<what>_total` for counters,
`shoal_<what>_seconds` (sum and count) for durations, base units in gauge names (`_ratio`,
`_bytes`, `_seconds`, `_celsius`, `_watts`). The node daemon's exporter renders with this
module too, so both scrape targets share one format.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Set
from typing import Any

from shoal.raft.model import TASK_STATES, Node, Task

Labels = tuple[tuple[str, str], ...]
Gauges = dict[str, tuple[str, dict[Labels, float]]]
"""gauge name -> (HELP text, label set -> value)."""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + inner + "}"


def format_value(value: float) -> str:
    """Exact for integers up to 2**53 (a commit index must not print as 1.23457e+06),
    shortest round-trip text otherwise, and Prometheus's spelling of NaN and infinities."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def _family(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {_escape_help(help_text)}", f"# TYPE {name} {kind}"]


def render_gauges(gauges: Gauges, kind: str = "gauge") -> list[str]:
    """`kind="counter"` renders values counted elsewhere (a GPU's ECC counters, which the
    driver keeps); their names must end in `_total`."""
    lines: list[str] = []
    for name, (help_text, cells) in sorted(gauges.items()):
        lines += _family(name, kind, help_text)
        lines += [f"{name}{_labels(k)} {format_value(v)}" for k, v in sorted(cells.items())]
    return lines


class Metrics:
    """A registry of counters and durations; gauges are passed in when rendering."""

    def __init__(self) -> None:
        self._counters: dict[str, dict[Labels, float]] = defaultdict(lambda: defaultdict(float))
        self._durations: dict[str, dict[Labels, list[float]]] = defaultdict(dict)
        self._help: dict[str, str] = {}

    def inc(self, name: str, help_text: str, amount: float = 1.0, **labels: str) -> None:
        self._help[name] = help_text
        self._counters[name][tuple(sorted(labels.items()))] += amount

    def observe(self, name: str, help_text: str, seconds: float, **labels: str) -> None:
        self._help[name] = help_text
        cell = self._durations[name].setdefault(tuple(sorted(labels.items())), [0.0, 0.0])
        cell[0] += seconds
        cell[1] += 1

    def counter(self, name: str, **labels: str) -> float:
        return self._counters[name][tuple(sorted(labels.items()))]

    def render(self, gauges: Gauges, counted: Gauges | None = None) -> str:
        """`counted`: counters kept outside this registry, rendered beside its own."""
        lines: list[str] = render_gauges(counted or {}, "counter")
        for name, cells in sorted(self._counters.items()):
            lines += _family(name, "counter", self._help[name])
            lines += [f"{name}{_labels(k)} {format_value(v)}" for k, v in sorted(cells.items())]
        for name, summaries in sorted(self._durations.items()):
            lines += _family(name, "summary", self._help[name])
            for k, (total, count) in sorted(summaries.items()):
                lines += [
                    f"{name}_sum{_labels(k)} {format_value(total)}",
                    f"{name}_count{_labels(k)} {format_value(count)}",
                ]
        lines += render_gauges(gauges)
        return "\n".join(lines) + "\n"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def cluster_gauges(
    nodes: Iterable[Node], tasks: Iterable[Task], running_jobs: Set[str], now: float
) -> Gauges:
    """Per-node, per-GPU and per-job gauges from the replicated state (pure: tests feed it
    plain records). A node's health is whatever its last heartbeat said, so a GPU value
    appears only for GPUs the node reported. Only running jobs get series: one per job ever
    submitted would grow without bound on a long-lived cluster."""
    age: dict[Labels, float] = {}
    gpus: dict[Labels, float] = {}
    util: dict[Labels, float] = {}
    for node in nodes:
        key: Labels = (("node", node.id),)
        gpus[key] = float(len(node.resources.gpus))
        if node.last_heartbeat:
            age[key] = max(0.0, now - node.last_heartbeat)
        for gpu in _reported_gpus(node.health):
            value = _number(gpu.get("utilisation"))
            index = gpu.get("index")
            if value is not None and isinstance(index, int):
                util[(("gpu", str(index)), ("node", node.id))] = value
    jobs: dict[Labels, float] = {}
    for task in tasks:
        if task.job_id not in running_jobs:
            continue
        cell: Labels = (("job", task.job_id), ("state", task.state))
        jobs[cell] = jobs.get(cell, 0.0) + 1
    return {
        "shoal_node_heartbeat_age_seconds": (
            "seconds since the node's last heartbeat reached the replicated state",
            age,
        ),
        "shoal_node_gpus": ("GPUs the node registered", gpus),
        "shoal_gpu_utilisation_ratio": (
            "GPU utilisation (0..1) from the node's last heartbeat, like DCGM_FI_DEV_GPU_UTIL",
            util,
        ),
        "shoal_job_tasks": (
            f"tasks of each running job by state ({', '.join(TASK_STATES)})",
            jobs,
        ),
    }


def _reported_gpus(health: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    listed = health.get("gpus") if isinstance(health, Mapping) else None
    if not isinstance(listed, list):
        return []
    return [g for g in listed if isinstance(g, Mapping)]
