"""Faults on real processes and resources. Each fault is injected and later healed; both
return a line of what was done, and the runner stamps the times.

- `KillProcess`: SIGKILL a local-cluster process (found by its pid file, checked against its
  command line), heal = start it again from the same spec (it reloads its Raft journal).
- `PauseProcess`: SIGSTOP, heal = SIGCONT. To its peers a paused replica is a partitioned one
  whose in-flight messages arrive late: the nastiest case for a stale leader.
- `GpuXid`: an XID event through the simulated GPU backend's shared state file, which a node
  daemon started with `--sim-gpus` watches with the real NVML collector code.
- `ClockSkew`: writes an offset (seconds) into a file that `OffsetClock` adds to time.time();
  a process whose clock collector/responder uses an `OffsetClock` on that file is skewed. A
  node daemon started with `SHOAL_CHAOS_CLOCK_FILE=FILE` in its environment is such a process.
- `DiskFull`: a real full filesystem: as root, a tmpfs of `size` bytes mounted on the
  directory and filled to ENOSPC; without root, the writer's RLIMIT_FSIZE (set by pid with
  prlimit): a write crossing the limit is cut short and the next one fails with EFBIG
  (CPython ignores SIGXFSZ; a C writer that does not is killed by it).

All methods block (signals, mounts, file I/O); the runner calls them in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import signal
import subprocess
from pathlib import Path
from typing import Protocol

from shoal.chaos.cluster import Cluster
from shoal.chaos.errors import FaultError
from shoal.errors import ShoalError
from shoal.files import write_atomically
from shoal.scheduler.errors import HealthError
from shoal.scheduler.health.clock import OffsetClock as OffsetClock
from shoal.scheduler.health.simgpu import SimGpuBackend


class Fault(Protocol):
    kind: str
    target: str

    def inject(self) -> str: ...

    def heal(self) -> str: ...


class KillProcess:
    kind = "kill"

    def __init__(self, cluster: Cluster, target: str, restart: bool = True) -> None:
        self.cluster, self.target, self.restart = cluster, target, restart

    def inject(self) -> str:
        pid = _pid(self.cluster, self.target)
        try:
            self.cluster.kill(self.target)
        except ShoalError as exc:
            raise FaultError(f"kill {self.target}: {exc}") from exc
        return f"SIGKILL {self.target} (pid {pid})"

    def heal(self) -> str:
        if not self.restart:
            return f"{self.target} left down"
        if self.cluster.pid(self.target) is not None:
            return f"{self.target} already running"
        return f"restarted {self.target} (pid {self.cluster.start(self.target)})"


class PauseProcess:
    kind = "pause"

    def __init__(self, cluster: Cluster, target: str) -> None:
        self.cluster, self.target = cluster, target
        self._pid: int | None = None

    def inject(self) -> str:
        self._pid = _pid(self.cluster, self.target)
        os.kill(self._pid, signal.SIGSTOP)
        return f"SIGSTOP {self.target} (pid {self._pid})"

    def heal(self) -> str:
        if self._pid is None:
            return f"{self.target} was not paused"
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._pid, signal.SIGCONT)
        return f"SIGCONT {self.target} (pid {self._pid})"


def _pid(cluster: Cluster, name: str) -> int:
    try:
        cluster.spec(name)
        pid = cluster.pid(name)
    except ShoalError as exc:
        raise FaultError(str(exc)) from exc
    if pid is None:
        raise FaultError(f"{name} is not running in {cluster.run_dir}; nothing to fault")
    return pid


class GpuXid:
    kind = "gpu-xid"

    def __init__(self, state_file: Path, gpu: int, xid: int = 79, target: str = "") -> None:
        self.state_file, self.gpu, self.xid = state_file, gpu, xid
        self.target = target or f"{state_file}#gpu{gpu}"

    def inject(self) -> str:
        try:
            SimGpuBackend.attach(self.state_file).raise_xid(self.gpu, self.xid)
        except HealthError as exc:
            raise FaultError(f"GPU fault on {self.target}: {exc}") from exc
        return f"XID {self.xid} on GPU {self.gpu} of {self.state_file}"

    def heal(self) -> str:
        return "XID events are one-shot; the scheduler decides what the GPU is worth now"


class XidStorm:
    """A GPU that keeps raising XIDs: one every `period` seconds until stopped. A node reports
    XIDs per collection window, so a storm is what the coordinator's health surely sees.
    Coroutine methods, for the event loop."""

    def __init__(self, fault: GpuXid, period: float = 0.5) -> None:
        self.fault, self.period = fault, period
        self.raised = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        first = await asyncio.to_thread(self.fault.inject)
        self.raised = 1
        self._task = asyncio.create_task(self._repeat())
        return f"{first}, again every {self.period:g} s"

    async def _repeat(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            write = asyncio.ensure_future(asyncio.to_thread(self.fault.inject))
            try:
                await asyncio.shield(write)
            finally:
                # Stopped mid-write, the write still lands in its thread: wait for it, so
                # `raised` counts every XID the GPU's state file holds. A write that is done
                # is counted without awaiting: a stop arriving at that await would skip the
                # count of an XID already written.
                if not write.done():
                    await asyncio.wait([write])
                if write.exception() is None:
                    self.raised += 1

    async def stop(self) -> str:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        return f"{self.raised} XIDs raised on {self.fault.target}"


class ClockSkew:
    kind = "clock-skew"

    def __init__(self, offset_file: Path, seconds: float, target: str = "") -> None:
        self.offset_file, self.seconds = offset_file, seconds
        self.target = target or str(offset_file)

    def inject(self) -> str:
        write_atomically(self.offset_file, repr(self.seconds), durable=False)
        return f"clock of {self.target} skewed by {self.seconds:+g} s"

    def heal(self) -> str:
        write_atomically(self.offset_file, "0.0", durable=False)
        return f"clock of {self.target} back to true time"


class DiskFull:
    """Fill the filesystem under `directory` (root: a tmpfs of `size` bytes mounted there)."""

    kind = "disk-full"
    FILLER = ".chaos-disk-full"

    def __init__(self, directory: Path, size: int = 1 << 20, target: str = "") -> None:
        self.directory, self.size = directory, size
        self.target = target or str(directory)
        self.mounted = False

    def inject(self) -> str:
        if os.geteuid() != 0:
            raise FaultError(
                "disk-full needs root to mount a tmpfs; use WriterFileLimit on the writer's pid"
            )
        self.mount()
        filled = _fill(self.directory / self.FILLER, self.size)
        return f"tmpfs of {self.size} B on {self.directory} filled ({filled} B)"

    def mount(self) -> None:
        """Mount the (empty) tmpfs now. For a writer that is already running, call this before
        it starts: mounted later, the tmpfs hides what the writer wrote before, and `close()`
        takes away what it wrote after."""
        if os.geteuid() != 0:
            raise FaultError("disk-full needs root to mount a tmpfs; use WriterFileLimit instead")
        if not self.mounted:
            self.directory.mkdir(parents=True, exist_ok=True)
            _run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.directory)])
            self.mounted = True

    def heal(self) -> str:
        with contextlib.suppress(FileNotFoundError):
            (self.directory / self.FILLER).unlink()
        return f"space freed on {self.directory}"

    def close(self) -> None:
        """Unmount (whatever the writer left inside the tmpfs goes with it)."""
        if self.mounted:
            _run(["umount", "-l", str(self.directory)])
            self.mounted = False


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise FaultError(f"{' '.join(argv)} failed: {done.stderr.strip() or done.returncode}")


def _fill(path: Path, cap: int) -> int:
    """Write until ENOSPC; returns the bytes written. More than `cap` means the mount is not
    the small filesystem we made, so stop rather than fill a real disk."""
    written = 0
    block = b"\0" * (64 * 1024)
    with open(path, "wb", buffering=0) as f:
        while written <= cap:
            try:
                written += f.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise FaultError(f"filling {path}: {exc}") from exc
                return written
    path.unlink()
    raise FaultError(f"{path.parent} took {cap} B without filling up; is the tmpfs mounted?")


class WriterFileLimit:
    """The unprivileged stand-in for a full disk: RLIMIT_FSIZE on the writer process, by pid."""

    kind = "disk-full"

    def __init__(self, pid: int, limit: int, target: str = "") -> None:
        self.pid, self.limit = pid, limit
        self.target = target or f"pid {pid}"
        self._old: tuple[int, int] | None = None

    def inject(self) -> str:
        if not _survives_sigxfsz(self.pid):
            raise FaultError(
                f"pid {self.pid} neither ignores nor handles SIGXFSZ: RLIMIT_FSIZE would kill it "
                "instead of failing its writes; ignore the signal in the writer first"
            )
        try:
            self._old = resource.prlimit(self.pid, resource.RLIMIT_FSIZE)
            resource.prlimit(self.pid, resource.RLIMIT_FSIZE, (self.limit, self._old[1]))
        except (ProcessLookupError, PermissionError) as exc:
            raise FaultError(f"cannot limit file size of pid {self.pid}: {exc}") from exc
        return f"RLIMIT_FSIZE of pid {self.pid} set to {self.limit} B"

    def heal(self) -> str:
        if self._old is None:
            return f"pid {self.pid} was not limited"
        with contextlib.suppress(ProcessLookupError):
            resource.prlimit(self.pid, resource.RLIMIT_FSIZE, self._old)
        return f"RLIMIT_FSIZE of pid {self.pid} restored"


def _survives_sigxfsz(pid: int) -> bool:
    """Whether `pid` ignores or catches SIGXFSZ (from /proc/PID/status); a gone pid counts as
    surviving, so prlimit reports it gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    masks = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    bit = 1 << (signal.SIGXFSZ - 1)
    return any(int(masks.get(key, "0").strip(), 16) & bit for key in ("SigIgn", "SigCgt"))
