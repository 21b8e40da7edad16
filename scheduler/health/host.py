"""Host health from /proc and statvfs: CPU busy fraction, memory, disk, load average.

CPU use is the change of /proc/stat's counters between two collects (the first collect
compares against boot, i.e. the average since boot). Parsing is apart from reading, so the
parsers are tested on text written by hand in the kernel's format.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from shoal.scheduler.errors import HealthError
from shoal.scheduler.health.collector import Report, unavailable


@dataclass(frozen=True)
class CpuTimes:
    """Aggregate jiffies from the `cpu` line of /proc/stat."""

    busy: int
    total: int


def parse_proc_stat(text: str) -> CpuTimes:
    """The first `cpu ` line: user nice system idle iowait irq softirq steal [guest...].
    Idle time is idle + iowait; guest time is already inside user, so it is not added."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            fields = [int(x) for x in line.split()[1:9]]
            if len(fields) < 4:
                break
            fields += [0] * (8 - len(fields))
            idle = fields[3] + fields[4]
            total = sum(fields)
            return CpuTimes(busy=total - idle, total=total)
    raise HealthError("/proc/stat has no aggregate 'cpu' line with at least 4 counters")


def parse_meminfo(text: str) -> tuple[int, int]:
    """(total, available) in kB from /proc/meminfo."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key.strip()] = int(parts[0])
    if "MemTotal" not in values or "MemAvailable" not in values:
        raise HealthError("/proc/meminfo lacks MemTotal or MemAvailable (kernel older than 3.14?)")
    return values["MemTotal"], values["MemAvailable"]


def cpu_fraction(before: CpuTimes, after: CpuTimes) -> float:
    """Busy share of the interval between two readings (0 when no time passed)."""
    total = after.total - before.total
    if total <= 0:
        return 0.0
    return min(1.0, max(0.0, (after.busy - before.busy) / total))


class HostCollector:
    """CPU, memory, disk and load of this host. Not thread-safe: one caller at a time."""

    name = "host"

    def __init__(self, disk_path: str | Path = "/", proc: str | Path = "/proc") -> None:
        self._disk = str(disk_path)
        self._proc = Path(proc)
        self._last = CpuTimes(0, 0)

    def collect(self) -> Report:
        try:
            now = parse_proc_stat((self._proc / "stat").read_text())
            total_kb, avail_kb = parse_meminfo((self._proc / "meminfo").read_text())
            disk = os.statvfs(self._disk)
        except (OSError, HealthError) as exc:
            return unavailable(self.name, f"cannot read host counters ({exc})")
        cpu = cpu_fraction(self._last, now)
        self._last = now
        disk_total = disk.f_blocks * disk.f_frsize
        disk_free = disk.f_bavail * disk.f_frsize
        load1, load5, _ = os.getloadavg()
        metrics = {
            "cpu_fraction": cpu,
            "cpus": float(os.cpu_count() or 1),
            "memory_total_mb": total_kb / 1024,
            "memory_available_mb": avail_kb / 1024,
            "memory_fraction": 1 - avail_kb / total_kb if total_kb else 0.0,
            "disk_total_gb": disk_total / 1e9,
            "disk_free_gb": disk_free / 1e9,
            "disk_fraction": 1 - disk_free / disk_total if disk_total else 0.0,
            "load1": load1,
            "load5": load5,
        }
        return Report(self.name, True, "", (), metrics)

    def close(self) -> None:
        return None
