"""The one interface every health source implements, and the report it returns.

A collector never raises because hardware is missing: it returns a report with
`available=False` and a reason a person can act on, so a node without GPUs (or without DCGM,
or without ptp4l) still reports what it has. `summarise` folds a node's reports into the
`NodeHealth` record the balancer reads; `merge_gpus` first makes one sample per GPU of the
samples that several sources (NVML and DCGM) took of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from shoal.scheduler.model import NodeHealth


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment. `None` where the device does not support the query."""

    index: int
    name: str = ""
    uuid: str = ""
    utilisation: float | None = None
    memory_used_mb: int | None = None
    memory_total_mb: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    ecc_uncorrected_new: int = 0
    xid_events: tuple[int, ...] = ()
    """XID codes new since the previous collection (each event is new in one collection)."""
    xid_total: int = 0
    """Every XID this GPU raised since the collector started; only grows."""
    xid_last: int | None = None
    """The newest XID's code, new or not."""
    nvlinks_up: int = 0
    nvlinks_total: int = 0

    @property
    def memory_fraction(self) -> float | None:
        if self.memory_used_mb is None or not self.memory_total_mb:
            return None
        return self.memory_used_mb / self.memory_total_mb

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["xid_events"] = list(self.xid_events)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GpuSample:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        known["xid_events"] = tuple(known.get("xid_events", ()))
        return cls(**known)


@dataclass(frozen=True)
class Report:
    """What one collector saw: numbers in `metrics`, per-GPU samples in `gpus`."""

    source: str
    available: bool
    reason: str = ""
    gpus: tuple[GpuSample, ...] = ()
    metrics: Mapping[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "available": self.available,
            "reason": self.reason,
            "gpus": [g.to_dict() for g in self.gpus],
            "metrics": dict(self.metrics),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Report:
        return cls(
            source=str(data["source"]),
            available=bool(data["available"]),
            reason=str(data.get("reason", "")),
            gpus=tuple(GpuSample.from_dict(g) for g in data.get("gpus", ())),
            metrics={str(k): float(v) for k, v in data.get("metrics", {}).items()},
        )


def unavailable(source: str, reason: str) -> Report:
    """The report of a collector that has nothing to measure here; `reason` says why."""
    return Report(source=source, available=False, reason=f"unavailable: {reason}")


class Collector(Protocol):
    """A health source. `collect` may block briefly (file reads, a subprocess, a UDP round
    trip): node daemons call it from a worker thread, never on the event loop."""

    name: str

    def collect(self) -> Report: ...

    def close(self) -> None: ...


UTILISATION_SOURCE = "dcgm"
"""The source whose GPU utilisation wins where two sources measure the same GPU."""


def merge_gpus(reports: Iterable[Report]) -> list[GpuSample]:
    """One sample per GPU index from the available reports, in index order.

    Where NVML and DCGM both see a GPU, NVML's sample is kept (memory, temperature, power,
    ECC, NVLink, and XIDs counted event by event, where DCGM's field holds only the last XID)
    with DCGM's utilisation in it when DCGM has a value: the host engine's watch is the number
    operators read in DCGM's own tools and exporter, so the balancer judges the same number.
    A GPU only one source sees keeps that source's sample.
    """
    kept: dict[int, tuple[str, GpuSample]] = {}
    preferred: dict[int, float] = {}
    for report in reports:
        if not report.available:
            continue
        for gpu in report.gpus:
            if report.source == UTILISATION_SOURCE and gpu.utilisation is not None:
                preferred[gpu.index] = gpu.utilisation
            held = kept.get(gpu.index)
            if held is None or (held[0] == UTILISATION_SOURCE != report.source):
                kept[gpu.index] = (report.source, gpu)
    return [
        replace(gpu, utilisation=preferred.get(index, gpu.utilisation))
        for index, (_, gpu) in sorted(kept.items())
    ]


def utilisation_source(reports: Iterable[Report]) -> str | None:
    """The source the node's GPU utilisation comes from (DCGM's where it has values), or None
    when no source measured any GPU's utilisation."""
    measured = [
        r.source for r in reports if r.available and any(g.utilisation is not None for g in r.gpus)
    ]
    if UTILISATION_SOURCE in measured:
        return UTILISATION_SOURCE
    return measured[0] if measured else None


def summarise(node: str, reports: Iterable[Report]) -> NodeHealth:
    """One node's `NodeHealth` from its collectors' reports (unavailable ones are skipped).

    GPU utilisation is the mean over GPUs (a group's throughput follows the average), GPU
    memory the fullest GPU (one full GPU stalls its rank), XID and new uncorrectable ECC
    errors are summed: any of them on any GPU makes the node faulty. Beside the new ones,
    `xid_total` and `ecc_total` carry the running counts, so a summary seen twice (heartbeats
    repeat the newest collection) is told apart from a new collection. A GPU that two
    sources measured counts once (`merge_gpus`).
    """
    values: dict[str, Any] = {"node": node}
    reports = list(reports)
    gpus = merge_gpus(reports)
    for report in reports:
        if not report.available:
            continue
        m = report.metrics
        for key, name in (
            ("cpu_fraction", "cpu"),
            ("memory_fraction", "memory"),
            ("latency_ms", "latency_ms"),
            ("offset_ms", "clock_offset_ms"),
            ("steps_per_s", "steps_per_s"),
            ("steps_baseline", "steps_baseline"),
        ):
            if key in m:
                values[name] = float(m[key])
        if "xid_errors" in m:
            values["xid_errors"] = values.get("xid_errors", 0) + int(m["xid_errors"])
    utils = [g.utilisation for g in gpus if g.utilisation is not None]
    mems = [f for f in (g.memory_fraction for g in gpus) if f is not None]
    if utils:
        values["gpu_util"] = sum(utils) / len(utils)
    if mems:
        values["gpu_memory"] = max(mems)
    values["xid_errors"] = values.get("xid_errors", 0) + sum(len(g.xid_events) for g in gpus)
    values["xid_total"] = sum(g.xid_total for g in gpus)
    values["ecc_errors"] = sum(g.ecc_uncorrected_new for g in gpus)
    values["ecc_total"] = sum(g.ecc_uncorrected or 0 for g in gpus)
    return NodeHealth(**values)
