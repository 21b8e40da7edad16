"""A simulated GPU backend with the same functions as pynvml, for `--sim-gpus N`, tests and chaos.

`NvmlCollector(SimGpuBackend(8))` runs the real NVML collector code over simulated devices.
The devices' load, ECC counters, NVLink state and pending XID events live in a small JSON
state file when one is given, so another process (a chaos scenario, a test) can set the load
or raise an XID on a running node daemon: `SimGpuBackend.attach(path).raise_xid(3, 79)`.
Errors are pynvml's own exception classes, so the collector's error handling is exercised too.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml

from shoal.files import write_atomically
from shoal.scheduler.errors import HealthError
from shoal.scheduler.health.nvml import NvmlCollector

_MIB = 1024 * 1024


def _fresh_gpu() -> dict[str, Any]:
    return {
        "utilisation": 0.0,
        "memory_fraction": 0.0,
        "ecc_corrected": 0,
        "ecc_uncorrected": 0,
        "nvlinks_down": 0,
    }


class _Store:
    """The simulated devices' state: in memory, or in a JSON file shared between processes
    (each change is read-modify-write under an flock, then atomically renamed into place)."""

    def __init__(self, path: Path | None, count: int) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._memory = {"count": count, "gpus": [_fresh_gpu() for _ in range(count)], "xids": []}
        if path is not None and not path.exists():
            with _locked(path):
                if not path.exists():
                    _write(path, self._memory)

    def read(self) -> dict[str, Any]:
        if self.path is None:
            with self._lock:
                return json.loads(json.dumps(self._memory))
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise HealthError(
                f"simulated GPU state {self.path} is unreadable ({exc}); delete it to start afresh"
            ) from exc
        if not isinstance(data, dict) or not isinstance(data.get("gpus"), list):
            raise HealthError(f"simulated GPU state {self.path} has no 'gpus' list; delete it")
        return data

    def update(self, change: Callable[[dict[str, Any]], None]) -> None:
        if self.path is None:
            with self._lock:
                change(self._memory)
            return
        with _locked(self.path):
            data = self.read()
            change(data)
            _write(self.path, data)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Exclusive flock on `<path>.lock`, so writers in several processes take turns."""
    with open(f"{path}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write(path: Path, data: dict[str, Any]) -> None:
    """Write beside, then rename: a reader never sees half a file."""
    write_atomically(path, json.dumps(data), durable=False)


@dataclass(frozen=True)
class SimHandle:
    index: int


@dataclass(frozen=True)
class SimUtilization:
    gpu: int
    memory: int


@dataclass(frozen=True)
class SimMemory:
    total: int
    used: int
    free: int


@dataclass(frozen=True)
class SimEventData:
    device: SimHandle
    eventType: int
    eventData: int


@dataclass
class SimEventSet:
    seen: int
    devices: set[int] = field(default_factory=set)


class SimGpuBackend:
    """`count` simulated GPUs of `memory_mb` each. Every GPU has `nvlink_group - 1` NVLinks
    (one per peer in its fully connected island, at most NVML's link count). Thread-safe."""

    def __init__(
        self,
        count: int,
        nvlink_group: int = 16,
        state_file: str | Path | None = None,
        memory_mb: int = 80 * 1024,
        poll_s: float = 0.02,
    ) -> None:
        if not isinstance(count, int) or count < 0:
            raise HealthError(f"--sim-gpus must be an int >= 0, got {count!r}")
        if not isinstance(nvlink_group, int) or nvlink_group < 1:
            raise HealthError(
                f"simulated NVLink group size must be an int >= 1, got {nvlink_group!r}"
            )
        self.count = count
        self.nvlink_group = nvlink_group
        self.memory_mb = memory_mb
        self._poll_s = poll_s
        self._store = _Store(Path(state_file) if state_file is not None else None, count)
        stored = len(self._store.read()["gpus"])
        if stored != count:
            raise HealthError(
                f"simulated GPU state {state_file} describes {stored} GPUs, not {count}; "
                "delete it or pass the same --sim-gpus"
            )

    @classmethod
    def attach(cls, state_file: str | Path, nvlink_group: int = 16) -> SimGpuBackend:
        """Open the state file a running node daemon uses (e.g. from a chaos process)."""
        path = Path(state_file)
        if not path.exists():
            raise HealthError(
                f"no simulated GPU state at {path}; is the node running with --sim-gpus?"
            )
        count = len(_Store(path, 0).read()["gpus"])
        return cls(count, nvlink_group, path)

    # --- controls (tests and chaos) ----------------------------------------------------

    def set_load(
        self, index: int, utilisation: float, memory_fraction: float | None = None
    ) -> None:
        self._check(index)
        if not 0 <= utilisation <= 1 or (
            memory_fraction is not None and not 0 <= memory_fraction <= 1
        ):
            raise HealthError("simulated load: utilisation and memory_fraction must be in 0..1")

        def change(data: dict[str, Any]) -> None:
            data["gpus"][index]["utilisation"] = utilisation
            if memory_fraction is not None:
                data["gpus"][index]["memory_fraction"] = memory_fraction

        self._store.update(change)

    def raise_xid(self, index: int, xid: int = 79, ecc_uncorrected: int = 0) -> None:
        """Queue an XID event on GPU `index` (79: fallen off the bus, 48: double-bit ECC) and
        optionally bump its uncorrectable ECC counter."""
        self._check(index)

        def change(data: dict[str, Any]) -> None:
            seq = max((e["seq"] for e in data["xids"]), default=0) + 1
            data["xids"].append({"seq": seq, "gpu": index, "xid": int(xid)})
            data["gpus"][index]["ecc_uncorrected"] += int(ecc_uncorrected)

        self._store.update(change)

    def set_nvlinks_down(self, index: int, links: int) -> None:
        self._check(index)

        def change(data: dict[str, Any]) -> None:
            data["gpus"][index]["nvlinks_down"] = int(links)

        self._store.update(change)

    def _check(self, index: int) -> None:
        if not isinstance(index, int) or not 0 <= index < self.count:
            raise HealthError(f"simulated GPU index {index!r} out of range 0..{self.count - 1}")

    # --- the pynvml subset NvmlCollector uses (pynvml's names and signatures) ----------

    def nvmlInit(self) -> None:
        self._store.read()

    def nvmlShutdown(self) -> None:
        return None

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> SimHandle:
        if not 0 <= index < self.count:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return SimHandle(index)

    def nvmlDeviceGetIndex(self, handle: SimHandle) -> int:
        return handle.index

    def nvmlDeviceGetName(self, handle: SimHandle) -> str:
        return "shoal simulated GPU"

    def nvmlDeviceGetUUID(self, handle: SimHandle) -> str:
        return f"GPU-sim-{handle.index:08d}"

    def nvmlDeviceGetUtilizationRates(self, handle: SimHandle) -> SimUtilization:
        gpu = self._gpu(handle)
        return SimUtilization(round(gpu["utilisation"] * 100), round(gpu["memory_fraction"] * 100))

    def nvmlDeviceGetMemoryInfo(self, handle: SimHandle) -> SimMemory:
        total = self.memory_mb * _MIB
        used = int(self._gpu(handle)["memory_fraction"] * total)
        return SimMemory(total, used, total - used)

    def nvmlDeviceGetTemperature(self, handle: SimHandle, sensor: int) -> int:
        return round(35 + 45 * self._gpu(handle)["utilisation"])

    def nvmlDeviceGetPowerUsage(self, handle: SimHandle) -> int:
        return round((70 + 630 * self._gpu(handle)["utilisation"]) * 1000)

    def nvmlDeviceGetTotalEccErrors(self, handle: SimHandle, error_type: int, counter: int) -> int:
        gpu = self._gpu(handle)
        if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return int(gpu["ecc_uncorrected"])
        return int(gpu["ecc_corrected"])

    def nvmlDeviceGetNvLinkState(self, handle: SimHandle, link: int) -> int:
        links = min(self.nvlink_group - 1, pynvml.NVML_NVLINK_MAX_LINKS)
        if link >= links:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        down = int(self._gpu(handle)["nvlinks_down"])
        return pynvml.NVML_FEATURE_DISABLED if link < down else pynvml.NVML_FEATURE_ENABLED

    def nvmlEventSetCreate(self) -> SimEventSet:
        xids = self._store.read()["xids"]
        return SimEventSet(seen=max((e["seq"] for e in xids), default=0))

    def nvmlDeviceRegisterEvents(self, handle: SimHandle, types: int, events: SimEventSet) -> None:
        events.devices.add(handle.index)

    def nvmlEventSetWait(self, events: SimEventSet, timeout_ms: int) -> SimEventData:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            for e in self._store.read()["xids"]:
                if e["seq"] > events.seen and e["gpu"] in events.devices:
                    events.seen = e["seq"]
                    return SimEventData(
                        SimHandle(e["gpu"]), pynvml.nvmlEventTypeXidCriticalError, e["xid"]
                    )
            if time.monotonic() >= deadline:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            time.sleep(self._poll_s)

    def nvmlEventSetFree(self, events: SimEventSet) -> None:
        return None

    def _gpu(self, handle: SimHandle) -> dict[str, Any]:
        gpus = self._store.read()["gpus"]
        if not 0 <= handle.index < len(gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        merged = _fresh_gpu()
        merged.update(gpus[handle.index])
        return merged


def gpu_collector(
    sim_gpus: int = 0, nvlink_group: int = 16, state_file: str | Path | None = None
) -> NvmlCollector:
    """The node daemon's GPU collector: real NVML, or `sim_gpus` simulated GPUs when > 0."""
    if sim_gpus:
        return NvmlCollector(SimGpuBackend(sim_gpus, nvlink_group, state_file))
    return NvmlCollector()
