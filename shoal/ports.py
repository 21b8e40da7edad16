"""Ports chosen now for a process that binds them later (a coordinator's Raft and API, a
chaos proxy, a torch.distributed rendezvous).

Binding port 0 and closing the socket hands out an ephemeral port, and between that close and
the child's bind two things can take it: the kernel, for any outgoing connection on the machine
(CI saw a replica fail with "Address already in use" this way), and a second caller doing the
same. So ports come from below the kernel's ephemeral range (/proc/sys/net/ipv4/
ip_local_port_range), which connect() never uses, and each is reserved for RESERVE_S in a
per-user directory under a file lock, which every caller on the machine honours. A replica
restarted on its old port by chaos finds it still free for the same reason.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shoal.errors import ShoalError

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
RANGE_FILE_MAX_BYTES = 64
LOWEST = 15000
"""Below this sit the ports services commonly claim (databases, caches, web servers)."""
MIN_SPAN = 1000
"""A span outside the ephemeral range narrower than this is not used on its own."""
RESERVE_S = 300.0
"""How long a handed-out port stays reserved: long enough for a loaded machine to start the
process that binds it (interpreter and torch imports included)."""
ATTEMPTS = 200


class PortError(ShoalError):
    """No free port could be found or reserved; the message says why."""


def unclaimed_ranges(range_text: str) -> list[range]:
    """The port ranges connect() never picks from, given ip_local_port_range's text ("low
    high"); the whole unprivileged range when that text is malformed or leaves too little."""
    fields = range_text.split()
    if len(fields) == 2 and all(f.isdigit() and len(f) <= 5 for f in fields):
        low, high = sorted(int(f) for f in fields)
        spans = [range(LOWEST, min(low, 65536)), range(max(high + 1, LOWEST), 65536)]
        wide = [s for s in spans if len(s) >= MIN_SPAN]
        if wide:
            return wide
    return [range(1024, 65536)]


def free_port(host: str = "127.0.0.1", udp: bool = False) -> int:
    """A port on `host` that is free now and that no other caller of this function on the
    machine gets for RESERVE_S. Raises PortError when none is found in ATTEMPTS tries."""
    ranges = unclaimed_ranges(_read_range())
    with _reservations() as folder:
        taken = _live_reservations(folder)
        for _ in range(ATTEMPTS):
            span = random.choices(ranges, weights=[len(r) for r in ranges])[0]
            port = random.randrange(span.start, span.stop)
            if port not in taken and _bindable(host, port, udp):
                (folder / str(port)).touch()
                return port
    raise PortError(
        f"no free {'UDP' if udp else 'TCP'} port on {host} in {ATTEMPTS} tries outside the "
        f"ephemeral range {ranges}; free some ports or shorten {RANGE_FILE}'s range"
    )


def _read_range() -> str:
    try:
        with RANGE_FILE.open("rb") as f:
            return f.read(RANGE_FILE_MAX_BYTES).decode("ascii", "replace")
    except OSError:
        return ""


def _bindable(host: str, port: int, udp: bool) -> bool:
    """Whether `port` binds now, without SO_REUSEADDR, so a port in TIME_WAIT counts as taken."""
    kind = socket.SOCK_DGRAM if udp else socket.SOCK_STREAM
    with socket.socket(socket.AF_INET, kind) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@contextmanager
def _reservations() -> Iterator[Path]:
    """The reservation folder, held under an exclusive lock for the caller's block."""
    folder = Path(tempfile.gettempdir()) / f"shoal-ports-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = folder.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise PortError(f"{folder} is not a directory of yours; remove it and retry")
        fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise PortError(f"cannot use the port reservations in {folder}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield folder
    finally:
        os.close(fd)


def _live_reservations(folder: Path) -> set[int]:
    """Ports reserved less than RESERVE_S ago; older reservations are removed."""
    now, live = time.time(), set()
    for entry in folder.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if now - entry.stat().st_mtime < RESERVE_S:
                live.add(int(entry.name))
            else:
                entry.unlink()
        except FileNotFoundError:
            continue
    return live
