"""Counters and summaries rendered in the Prometheus text format, for `/metrics`.

Event-loop only. Names follow Prometheus conventions: `shoal_<what>_total` for counters,
`shoal_<what>_seconds` (sum and count) for durations, plain names for gauges.
"""

from __future__ import annotations

from collections import defaultdict

Labels = tuple[tuple[str, str], ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + inner + "}"


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

    def render(self, gauges: dict[str, tuple[str, dict[Labels, float]]]) -> str:
        lines: list[str] = []
        for name, cells in sorted(self._counters.items()):
            lines += [f"# HELP {name} {self._help[name]}", f"# TYPE {name} counter"]
            lines += [f"{name}{_labels(k)} {v:g}" for k, v in sorted(cells.items())]
        for name, summaries in sorted(self._durations.items()):
            lines += [f"# HELP {name} {self._help[name]}", f"# TYPE {name} summary"]
            for k, (total, count) in sorted(summaries.items()):
                lines += [
                    f"{name}_sum{_labels(k)} {total:.6f}",
                    f"{name}_count{_labels(k)} {count:g}",
                ]
        for name, (help_text, cells) in sorted(gauges.items()):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
            lines += [f"{name}{_labels(k)} {v:g}" for k, v in sorted(cells.items())]
        return "\n".join(lines) + "\n"
