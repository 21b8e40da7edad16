"""GPU health through NVML (nvidia-ml-py): utilisation, memory, temperature, power, ECC
counts, NVLink state, and XID events from NVML's event-set API in a worker thread.

The NVML module is a constructor argument: the real `pynvml` by default, or the simulated
backend in simgpu.py, which implements the same functions. So tests and chaos drive exactly
this code; only the driver underneath differs. Reading (`read_device`) is apart from parsing
(`parse_sample`), so the conversions are tested on plain values.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, TypeVar

import pynvml

from shoal.scheduler.health.collector import GpuSample, Report, unavailable
from shoal.scheduler.health.xids import XidCount, XidLedger

T = TypeVar("T")

# Errors that mean "this device or link does not have that", not "NVML is broken".
_ABSENT = (
    pynvml.NVMLError_NotSupported,
    pynvml.NVMLError_InvalidArgument,
    pynvml.NVMLError_NoPermission,
)


def init_failure_reason(exc: pynvml.NVMLError) -> str:
    """Why NVML is unusable, in the words an operator searches for."""
    kind = type(exc).__name__
    if isinstance(exc, pynvml.NVMLError_LibraryNotFound | pynvml.NVMLError_DriverNotLoaded):
        return f"no NVIDIA driver ({kind})"
    if isinstance(exc, pynvml.NVMLError_NoPermission):
        return f"no permission to open the NVIDIA device files ({kind})"
    return f"NVML failed to initialise ({kind}: {exc})"


def _optional(call: Callable[[], T]) -> T | None:
    try:
        return call()
    except _ABSENT:
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_device(nvml: Any, handle: Any) -> dict[str, Any]:
    """Raw values of one device, in NVML's units; absent features are None."""
    util = _optional(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
    mem = _optional(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    links = []
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        state = _optional(partial(nvml.nvmlDeviceGetNvLinkState, handle, link))
        if state is not None:
            links.append(state)
    return {
        "name": _optional(lambda: _text(nvml.nvmlDeviceGetName(handle))),
        "uuid": _optional(lambda: _text(nvml.nvmlDeviceGetUUID(handle))),
        "gpu_percent": None if util is None else util.gpu,
        "memory_used_bytes": None if mem is None else mem.used,
        "memory_total_bytes": None if mem is None else mem.total,
        "temperature_c": _optional(
            lambda: nvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
        ),
        "power_mw": _optional(lambda: nvml.nvmlDeviceGetPowerUsage(handle)),
        "ecc_corrected": _optional(
            lambda: nvml.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC
            )
        ),
        "ecc_uncorrected": _optional(
            lambda: nvml.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
            )
        ),
        "nvlink_states": links,
    }


NO_XIDS = XidCount()


def parse_sample(
    index: int,
    raw: Mapping[str, Any],
    xids: XidCount = NO_XIDS,
    previous_uncorrected: int | None = None,
) -> GpuSample:
    """NVML's units to ours: percent → fraction, bytes → MiB, mW → W; counts new ECC errors
    against the previous reading (a counter that went down means the driver reset it)."""
    mib = 1024 * 1024
    uncorrected = raw.get("ecc_uncorrected")
    new = 0
    if uncorrected is not None:
        base = previous_uncorrected if previous_uncorrected is not None else uncorrected
        new = uncorrected - base if uncorrected >= base else uncorrected
    links = list(raw.get("nvlink_states") or [])
    percent = raw.get("gpu_percent")
    used, total = raw.get("memory_used_bytes"), raw.get("memory_total_bytes")
    power = raw.get("power_mw")
    return GpuSample(
        index=index,
        name=raw.get("name") or "",
        uuid=raw.get("uuid") or "",
        utilisation=None if percent is None else percent / 100.0,
        memory_used_mb=None if used is None else used // mib,
        memory_total_mb=None if total is None else total // mib,
        temperature_c=None if raw.get("temperature_c") is None else float(raw["temperature_c"]),
        power_w=None if power is None else power / 1000.0,
        ecc_corrected=raw.get("ecc_corrected"),
        ecc_uncorrected=uncorrected,
        ecc_uncorrected_new=new,
        xid_events=xids.new,
        xid_total=xids.total,
        xid_last=xids.last,
        nvlinks_up=sum(1 for s in links if s == pynvml.NVML_FEATURE_ENABLED),
        nvlinks_total=len(links),
    )


class NvmlCollector:
    """GPU health of this host. Thread-safe: `collect` may run in any one thread while the XID
    watcher runs in its own; `close` stops the watcher and shuts NVML down."""

    name = "nvml"

    def __init__(self, nvml: Any = pynvml, xid_poll_ms: int = 200) -> None:
        self._nvml = nvml
        self._poll_ms = xid_poll_ms
        self._lock = threading.Lock()
        self._xids = XidLedger()
        self._ecc: dict[int, int] = {}
        self._watch_error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handles: list[Any] = []
        try:
            nvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self._reason = init_failure_reason(exc)
            return
        self._reason = ""
        count = nvml.nvmlDeviceGetCount()
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self._thread = threading.Thread(target=self._watch_xids, name="nvml-xid", daemon=True)
        self._thread.start()

    @property
    def available(self) -> bool:
        return not self._reason

    def collect(self) -> Report:
        if self._reason:
            return unavailable(self.name, self._reason)
        try:
            raws = [read_device(self._nvml, h) for h in self._handles]
        except pynvml.NVMLError as exc:
            return unavailable(self.name, f"NVML query failed ({type(exc).__name__}: {exc})")
        xids = self._xids.take(list(range(len(raws))))
        with self._lock:
            previous = dict(self._ecc)
            watch_error = self._watch_error
        samples = tuple(
            parse_sample(i, raw, xids[i], previous.get(i)) for i, raw in enumerate(raws)
        )
        with self._lock:
            for s in samples:
                if s.ecc_uncorrected is not None:
                    self._ecc[s.index] = s.ecc_uncorrected
        metrics = {"gpus": float(len(samples)), "xid_watch_ok": 0.0 if watch_error else 1.0}
        return Report(self.name, True, watch_error, samples, metrics)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if not self._reason:
            try:
                self._nvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass
            self._reason = "collector closed"

    def _watch_xids(self) -> None:
        """Worker thread: wait on NVML's event set and count each XID under its GPU index."""
        nvml = self._nvml
        try:
            events = nvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            self._note_watch_error(f"XID events unavailable ({type(exc).__name__})")
            return
        try:
            for handle in self._handles:
                _optional(
                    partial(
                        nvml.nvmlDeviceRegisterEvents,
                        handle,
                        pynvml.nvmlEventTypeXidCriticalError,
                        events,
                    )
                )
            while not self._stop.is_set():
                try:
                    data = nvml.nvmlEventSetWait(events, self._poll_ms)
                except pynvml.NVMLError_Timeout:
                    continue
                self._xids.record(nvml.nvmlDeviceGetIndex(data.device), int(data.eventData))
        except pynvml.NVMLError as exc:
            self._note_watch_error(f"XID watch stopped ({type(exc).__name__}: {exc})")
        finally:
            try:
                nvml.nvmlEventSetFree(events)
            except pynvml.NVMLError:
                pass

    def _note_watch_error(self, message: str) -> None:
        with self._lock:
            self._watch_error = message
