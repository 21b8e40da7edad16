"""Clock offset and network delay to the coordinator by a four-timestamp exchange, and
ptp4l's own offset where PTP runs.

The exchange (as in NTP): the client stamps t0 and sends; the server stamps t1 on receipt and
t2 on reply; the client stamps t3 on receipt. Then
    offset θ = ((t1 − t0) + (t2 − t3)) / 2      (server clock minus client clock)
    delay  δ = (t3 − t0) − (t2 − t1)            (round trip, minus the server's own time)
and the true offset lies within θ ± δ/2 when the paths are symmetric or not. Of several
exchanges the one with the smallest δ is kept: it had the least queueing, so the tightest bound.

Chaos hook: a node daemon whose environment sets `SHOAL_CHAOS_CLOCK_FILE=PATH` stamps its side
of the exchange with `OffsetClock(PATH)` (true time plus the seconds written in PATH), so a
chaos run can skew one real node's clock without touching the host's. Unset, nothing changes.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from shoal.scheduler.errors import HealthError
from shoal.scheduler.health.collector import Report, unavailable

_MAGIC = b"SHCK"
_REQUEST = struct.Struct("!4sId")  # magic, sequence, t0
_REPLY = struct.Struct("!4sIddd")  # magic, sequence, t0, t1, t2

Clock = Callable[[], float]

CHAOS_CLOCK_ENV = "SHOAL_CHAOS_CLOCK_FILE"


class OffsetClock:
    """time.time() plus the offset in `path` (0 when missing or unreadable); rereads the file at
    most every `refresh` seconds, so it is cheap enough to stamp every clock exchange."""

    def __init__(self, path: Path, refresh: float = 0.1) -> None:
        self.path, self.refresh = path, refresh
        self._offset, self._read_at = 0.0, -float("inf")

    def offset(self) -> float:
        now = time.monotonic()
        if now - self._read_at >= self.refresh:
            try:
                self._offset = float(self.path.read_text())
            except (OSError, ValueError):
                self._offset = 0.0
            self._read_at = now
        return self._offset

    def __call__(self) -> float:
        return time.time() + self.offset()


def chaos_clock(environ: Mapping[str, str] = os.environ) -> Clock:
    """The clock a node stamps its exchanges with: an `OffsetClock` on the file that
    `SHOAL_CHAOS_CLOCK_FILE` names (a chaos test skews it), else the true time."""
    path = environ.get(CHAOS_CLOCK_ENV, "")
    return OffsetClock(Path(path)) if path else time.time


@dataclass(frozen=True)
class ClockSample:
    """One exchange's result, in seconds."""

    offset_s: float
    delay_s: float

    @property
    def error_s(self) -> float:
        """Half the round trip: the true offset lies within offset ± this."""
        return self.delay_s / 2


def offset_delay(t0: float, t1: float, t2: float, t3: float) -> ClockSample:
    """θ and δ from the four timestamps (t0, t3 on the client's clock; t1, t2 on the server's)."""
    if t3 < t0:
        raise HealthError(f"clock exchange: reply stamped before its request (t0={t0}, t3={t3})")
    if t2 < t1:
        raise HealthError(f"clock exchange: server replied before receiving (t1={t1}, t2={t2})")
    delay = (t3 - t0) - (t2 - t1)
    return ClockSample(offset_s=((t1 - t0) + (t2 - t3)) / 2, delay_s=max(0.0, delay))


def best(samples: Sequence[ClockSample]) -> ClockSample:
    """The sample with the least delay, i.e. the tightest bound on the offset."""
    if not samples:
        raise HealthError("no clock samples to choose from")
    return min(samples, key=lambda s: (s.delay_s, abs(s.offset_s)))


class _Responder(asyncio.DatagramProtocol):
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.transport: asyncio.DatagramTransport | None = None
        self.bad_packets = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        t1 = self.clock()
        if len(data) != _REQUEST.size or not data.startswith(_MAGIC):
            self.bad_packets += 1
            return
        _, seq, t0 = _REQUEST.unpack(data)
        if self.transport is not None:
            self.transport.sendto(_REPLY.pack(_MAGIC, seq, t0, t1, self.clock()), addr)


class ClockServer:
    """The coordinator's side: answers each request with its receive and send stamps.
    Ignores (and counts) malformed datagrams; never raises on them."""

    def __init__(self, transport: asyncio.DatagramTransport, protocol: _Responder) -> None:
        self._transport = transport
        self._protocol = protocol
        self.port: int = transport.get_extra_info("sockname")[1]

    @property
    def bad_packets(self) -> int:
        return self._protocol.bad_packets

    def close(self) -> None:
        self._transport.close()


async def serve_clock(
    host: str = "127.0.0.1", port: int = 0, clock: Clock = time.time
) -> ClockServer:
    """Start the UDP responder on `host:port` (port 0: any free port, see `.port`)."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_datagram_endpoint(
        lambda: _Responder(clock), local_addr=(host, port)
    )
    return ClockServer(transport, protocol)


def measure(
    host: str, port: int, samples: int = 8, timeout_s: float = 0.5, clock: Clock = time.time
) -> ClockSample:
    """Blocking: `samples` exchanges with a `serve_clock` responder; the best one."""
    if samples < 1:
        raise HealthError(f"clock measure: samples must be >= 1, got {samples}")
    got: list[ClockSample] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect((host, port))
        for seq in range(samples):
            t0 = clock()
            sock.send(_REQUEST.pack(_MAGIC, seq, t0))
            reply = _await_reply(sock, seq, timeout_s)
            if reply is not None:
                got.append(offset_delay(reply[0], reply[1], reply[2], clock()))
    if not got:
        raise HealthError(
            f"no clock reply from {host}:{port} in {samples} tries; "
            "is the coordinator's clock responder running?"
        )
    return best(got)


def _await_reply(
    sock: socket.socket, seq: int, timeout_s: float
) -> tuple[float, float, float] | None:
    """The reply to `seq`, skipping late replies to earlier requests; None on timeout."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(64)
        except (TimeoutError, ConnectionRefusedError):
            return None
        if len(data) == _REPLY.size and data.startswith(_MAGIC):
            _, got_seq, t0, t1, t2 = _REPLY.unpack(data)
            if got_seq == seq:
                return t0, t1, t2
    return None


class ClockCollector:
    """Offset and delay of this host's clock against the coordinator's responder."""

    name = "clock"

    def __init__(
        self,
        host: str,
        port: int,
        samples: int = 8,
        timeout_s: float = 0.5,
        clock: Clock = time.time,
    ) -> None:
        self._host, self._port = host, port
        self._samples, self._timeout = samples, timeout_s
        self._clock = clock

    def collect(self) -> Report:
        try:
            s = measure(self._host, self._port, self._samples, self._timeout, self._clock)
        except (HealthError, OSError) as exc:
            return unavailable(self.name, str(exc))
        metrics = {
            "offset_ms": s.offset_s * 1e3,
            "delay_ms": s.delay_s * 1e3,
            "error_ms": s.error_s * 1e3,
            "latency_ms": s.error_s * 1e3,
        }
        return Report(self.name, True, "", (), metrics)

    def close(self) -> None:
        return None


# --- PTP -----------------------------------------------------------------------------------

_OFFSET = re.compile(r"^\s*master_offset\s+(-?\d+)\s*$", re.MULTILINE)
_GM_PRESENT = re.compile(r"^\s*gmPresent\s+(true|false)\s*$", re.MULTILINE)


def parse_pmc_time_status(text: str) -> tuple[float, bool]:
    """(offset from the grandmaster in ns, grandmaster present) from
    `pmc -u -b 0 'GET TIME_STATUS_NP'`."""
    if "RESPONSE MANAGEMENT TIME_STATUS_NP" not in text:
        raise HealthError("pmc got no TIME_STATUS_NP response; is ptp4l running?")
    offset = _OFFSET.search(text)
    present = _GM_PRESENT.search(text)
    if offset is None or present is None:
        raise HealthError("pmc's TIME_STATUS_NP response lacks master_offset or gmPresent")
    return float(offset.group(1)), present.group(1) == "true"


def ptp_devices(dev: Path = Path("/dev")) -> list[str]:
    """This host's PTP hardware clocks (`/dev/ptp0`, ...): what ptp4l disciplines with hardware
    timestamps. None does not rule PTP out (ptp4l also runs on software timestamps)."""
    try:
        return sorted(str(p) for p in dev.glob("ptp[0-9]*"))
    except OSError:
        return []


class PtpCollector:
    """ptp4l's offset to its grandmaster, read with `pmc` (linuxptp) over ptp4l's Unix socket:
    its default one, or `uds` (ptp4l's `uds_address`) when ptp4l was configured elsewhere."""

    name = "ptp"

    def __init__(self, pmc: str = "pmc", timeout_s: float = 2.0, uds: str | None = None) -> None:
        self._pmc = shutil.which(pmc)
        self._timeout = timeout_s
        self._server = ["-s", uds] if uds else []

    def collect(self) -> Report:
        if self._pmc is None:
            return unavailable(self.name, "ptp4l is not running here (no pmc on PATH)")
        try:
            done = subprocess.run(
                [self._pmc, "-u", "-b", "0", *self._server, "GET TIME_STATUS_NP"],
                capture_output=True,
                text=True,
                timeout=self._timeout,
                check=False,
            )
            offset_ns, present = parse_pmc_time_status(done.stdout)
        except (OSError, subprocess.TimeoutExpired, HealthError) as exc:
            return unavailable(self.name, f"pmc failed ({exc})")
        metrics = {"ptp_offset_ms": offset_ns / 1e6, "ptp_gm_present": 1.0 if present else 0.0}
        return Report(self.name, True, "", (), metrics)

    def close(self) -> None:
        return None
