"""GPU field values and health checks from NVIDIA DCGM, where it is installed.

Three ways, best first: DCGM's Python bindings (`pydcgm`, shipped with DCGM under
/usr/share/datacenter-gpu-manager*/bindings, importable when on PYTHONPATH) against the host
engine (the local one unless `host` names another); else the `dcgmi` command line
(`dcgmi dmon -e 203,230 -c 1` for GPU utilisation and the last XID, `dcgmi health -c` for the
health watches); else an unavailable report that says which of the two is missing. The text parsers are pure and tested on output written by
hand in DCGM's documented format.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from shoal.scheduler.errors import HealthError
from shoal.scheduler.health.collector import GpuSample, Report, unavailable
from shoal.scheduler.health.xids import XidLedger

GPU_UTIL = 203  # DCGM_FI_DEV_GPU_UTIL, percent
XID_ERRORS = 230  # DCGM_FI_DEV_XID_ERRORS, the last XID seen (0 = none)
FIELDS = (GPU_UTIL, XID_ERRORS)
DEFAULT_HOST = "127.0.0.1"  # nv-hostengine's default listener (port 5555)
# DCGM marks "no value" with sentinels from 0x7ffffff0 (DCGM_INT32_BLANK) upwards.
_BLANK = 0x7FFFFFF0


def parse_dmon(text: str, fields: tuple[int, ...] = FIELDS) -> dict[int, dict[int, float | None]]:
    """GPU id → field id → value from `dcgmi dmon -e <fields>` output.

    dmon prints a `#Entity` header naming the columns, an `ID` line, then one line per entity
    and sample (`GPU 0   37   0`); `N/A` means no value yet. Later samples overwrite earlier
    ones, so the result holds the latest. Non-GPU entities (switches, links) are skipped.
    """
    out: dict[int, dict[int, float | None]] = {}
    header_seen = False
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if parts[0].startswith("#"):
            header_seen = True
            continue
        if parts[0] != "GPU" or len(parts) < 2 or not parts[1].isdigit():
            continue
        values = parts[2:]
        if len(values) != len(fields):
            raise HealthError(
                f"dcgmi dmon line {line.strip()!r} has {len(values)} values for {len(fields)} fields"
            )
        out[int(parts[1])] = {f: _number(v) for f, v in zip(fields, values)}
    if not header_seen:
        raise HealthError("dcgmi dmon printed no '#Entity' header; is nv-hostengine running?")
    return out


def _number(text: str) -> float | None:
    if text.upper() in ("N/A", "NA", "-"):
        return None
    try:
        return float(text)
    except ValueError as exc:
        raise HealthError(f"dcgmi dmon value {text!r} is not a number") from exc


@dataclass(frozen=True)
class HealthCheck:
    """`dcgmi health -c`: the overall verdict and each GPU's verdict with its messages."""

    overall: str
    gpus: dict[int, tuple[str, tuple[str, ...]]]

    @property
    def healthy(self) -> bool:
        return self.overall.lower() in ("healthy", "pass")


_GPU_ROW = re.compile(r"GPU(?: ID)?\s*:?\s*(\d+)", re.IGNORECASE)


def parse_health(text: str) -> HealthCheck:
    """Parse the boxed table of `dcgmi health -c`:

        | Overall Health            | Warning                          |
        | GPU ID: 0                 | Warning                          |
        |                           | PCIe system: Warning - Detected  |
        |                           | more than 8 PCIe replays ...     |

    A row whose left cell names a GPU starts that GPU's entry; rows with an empty left cell
    continue the message above them (DCGM wraps long messages).
    """
    overall = ""
    gpus: dict[int, tuple[str, list[str]]] = {}
    current: int | None = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if "|" in line else []
        if len(cells) < 2:
            continue
        left, right = cells[0], cells[1]
        if left.lower().startswith("overall health"):
            overall = right or left.partition(":")[2].strip()
            current = None
        elif (m := _GPU_ROW.match(left)) is not None:
            current = int(m.group(1))
            gpus[current] = (right, [])
        elif not left and current is not None and right:
            messages = gpus[current][1]
            if messages and not re.match(r"^[A-Za-z ]+ system:", right):
                messages[-1] = f"{messages[-1]} {right}"
            else:
                messages.append(right)
    if not overall:
        raise HealthError(
            "dcgmi health -c printed no 'Overall Health' row; were watches set (-s a)?"
        )
    return HealthCheck(overall, {g: (v, tuple(m)) for g, (v, m) in gpus.items()})


def report_from(
    source: str,
    values: dict[int, dict[int, float | None]],
    health: HealthCheck | None,
    xids: XidLedger,
) -> Report:
    """One Report from dmon values (and the health check, when there is one). The XID field
    holds only the last XID's code: `xids` turns its changes into counted events."""
    for index in sorted(values):
        last = values[index].get(XID_ERRORS)
        xids.observe_last(index, None if last is None else int(last))
    counts = xids.take(sorted(values))
    gpus = []
    for index in sorted(values):
        util = values[index].get(GPU_UTIL)
        gpus.append(
            GpuSample(
                index=index,
                utilisation=None if util is None else util / 100.0,
                xid_events=counts[index].new,
                xid_total=counts[index].total,
                xid_last=counts[index].last,
            )
        )
    metrics: dict[str, float] = {"gpus": float(len(gpus))}
    reason = ""
    if health is not None:
        metrics["dcgm_healthy"] = 1.0 if health.healthy else 0.0
        if not health.healthy:
            details = [
                f"GPU {g}: {v} ({'; '.join(m)})" for g, (v, m) in sorted(health.gpus.items())
            ]
            reason = f"DCGM health {health.overall}: " + ", ".join(details)
    return Report(source, True, reason, tuple(gpus), metrics)


class DcgmCollector:
    """DCGM field values and health of this host's GPUs. One caller at a time."""

    name = "dcgm"

    def __init__(
        self, dcgmi: str = "dcgmi", timeout_s: float = 5.0, host: str = DEFAULT_HOST
    ) -> None:
        """`host`: the host engine's address, `IP` (port 5555), `IP:PORT` or `unix://PATH`,
        as the bindings' `DcgmHandle` and `dcgmi --host` take it."""
        self._host = host
        self._timeout = timeout_s
        self._bindings: _Bindings | None = None
        self._reason = ""
        self._xids = XidLedger()
        self._dcgmi = shutil.which(dcgmi)
        try:
            self._bindings = _Bindings(host)
        except ImportError:
            if self._dcgmi is None:
                self._reason = "DCGM is not installed (no pydcgm module, no dcgmi on PATH)"
        except Exception as exc:  # the bindings raise their own DCGMError tree
            if self._dcgmi is None:
                self._reason = f"DCGM host engine unreachable ({type(exc).__name__}: {exc})"

    def collect(self) -> Report:
        if self._bindings is not None:
            try:
                return self._bindings.collect(self.name, self._xids)
            except Exception as exc:  # the bindings raise their own DCGMError tree
                return unavailable(self.name, f"DCGM query failed ({type(exc).__name__}: {exc})")
        if self._dcgmi is not None:
            return self._collect_cli(self._dcgmi)
        return unavailable(self.name, self._reason or "DCGM collector closed")

    def _collect_cli(self, dcgmi: str) -> Report:
        fields = ",".join(str(f) for f in FIELDS)
        try:
            dmon = self._run([dcgmi, "dmon", "--host", self._host, "-e", fields, "-c", "1"])
            health_text = self._run([dcgmi, "health", "--host", self._host, "-c"])
            values = parse_dmon(dmon)
        except (OSError, subprocess.SubprocessError, HealthError) as exc:
            return unavailable(self.name, f"dcgmi failed ({exc})")
        try:
            health: HealthCheck | None = parse_health(health_text)
        except HealthError:
            health = None
        return report_from(self.name, values, health, self._xids)

    def _run(self, argv: list[str]) -> str:
        """dcgmi's stdout; a failure names the command and what dcgmi said (it prints its
        errors, such as an unreachable host engine, on stdout)."""
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=self._timeout, check=False
        )
        if done.returncode != 0:
            said = " ".join((done.stderr.strip() or done.stdout.strip()).split())
            raise HealthError(f"{' '.join(argv)} exited {done.returncode}: {said[-200:]}")
        return done.stdout

    def close(self) -> None:
        if self._bindings is not None:
            self._bindings.close()
            self._bindings = None


class _Bindings:
    """DCGM's own Python API: a default group of all GPUs, a field group, all health watches."""

    def __init__(self, host: str) -> None:
        pydcgm = importlib.import_module("pydcgm")
        structs = importlib.import_module("dcgm_structs")
        self._structs = structs
        self._handle = pydcgm.DcgmHandle(ipAddress=host, opMode=structs.DCGM_OPERATION_MODE_AUTO)
        self._group = pydcgm.DcgmGroup(
            self._handle, groupName="shoal", groupType=structs.DCGM_GROUP_DEFAULT
        )
        self._fields = pydcgm.DcgmFieldGroup(self._handle, name="shoal", fieldIds=list(FIELDS))
        self._group.samples.WatchFields(self._fields, 1_000_000, 60.0, 0)
        self._group.health.Set(structs.DCGM_HEALTH_WATCH_ALL)

    def collect(self, source: str, xids: XidLedger) -> Report:
        latest: Any = self._group.samples.GetLatest(self._fields).values
        values = {
            int(gpu): {f: _latest_value(fields.get(f)) for f in FIELDS}
            for gpu, fields in latest.items()
        }
        resp = self._group.health.Check()
        return report_from(source, values, self._health_of(resp), xids)

    def _health_of(self, resp: Any) -> HealthCheck:
        words = {
            self._structs.DCGM_HEALTH_RESULT_PASS: "Healthy",
            self._structs.DCGM_HEALTH_RESULT_WARN: "Warning",
            self._structs.DCGM_HEALTH_RESULT_FAIL: "Failure",
        }
        gpus: dict[int, tuple[str, tuple[str, ...]]] = {}
        for i in range(resp.incidentCount):
            incident = resp.incidents[i]
            gpu = int(incident.entityInfo.entityId)
            verdict, messages = gpus.get(gpu, (words.get(incident.health, "Unknown"), ()))
            gpus[gpu] = (verdict, (*messages, str(incident.error.msg)))
        return HealthCheck(words.get(resp.overallHealth, "Unknown"), gpus)

    def close(self) -> None:
        self._group.Delete()
        self._fields.Delete()
        self._handle.Shutdown()


def _latest_value(samples: Any) -> float | None:
    if not samples:
        return None
    value = samples[-1].value
    if value is None or isinstance(value, str) or value >= _BLANK:
        return None
    return float(value)
