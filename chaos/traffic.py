"""What the fault proxy does to traffic, as plain data and pure arithmetic (no sockets here).

TCP never loses bytes inside a connection, so "packet loss" has two honest meanings for a
proxy that sits on the byte stream: `loss_mode="drop"` cuts the whole connection (a reset) with
probability `loss` per forwarded chunk, which is what an application sees when loss outlasts the
retransmission timeout; `loss_mode="stall"` holds the chunk and everything behind it for
`stall_s`, which is what a retransmission after a lost segment looks like from above.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from shoal.chaos.errors import ProxyError

PARTITIONS = (None, "refuse", "blackhole")
LOSS_MODES = ("drop", "stall")


@dataclass(frozen=True)
class NetFaults:
    """The faults a proxy applies to every connection, both directions.

    partition: None (pass), "refuse" (new connections are reset at once and existing ones
    are cut with a RST) or "blackhole" (nothing is forwarded and new connections are never
    connected upstream; bytes wait in the kernel's buffers and flow again after healing)."""

    partition: str | None = None
    delay_s: float = 0.0
    """Added one-way latency per chunk, seconds."""
    jitter_s: float = 0.0
    """Each chunk's delay varies uniformly by up to this much either way (order is kept)."""
    loss: float = 0.0
    """Probability per forwarded chunk of a loss event, 0..1."""
    loss_mode: str = "drop"
    stall_s: float = 1.0
    """How long a stall-mode loss holds the stream."""
    bandwidth_bps: float | None = None
    """Bytes per second per direction (token bucket), None for unlimited."""

    def __post_init__(self) -> None:
        if self.partition not in PARTITIONS:
            raise ProxyError(f"partition={self.partition!r} is not one of {PARTITIONS}")
        for name in ("delay_s", "jitter_s", "stall_s"):
            _check_finite(name, getattr(self, name), 0.0, 3600.0)
        _check_finite("loss", self.loss, 0.0, 1.0)
        if self.loss_mode not in LOSS_MODES:
            raise ProxyError(f"loss_mode={self.loss_mode!r} is not one of {LOSS_MODES}")
        if self.bandwidth_bps is not None:
            _check_finite("bandwidth_bps", self.bandwidth_bps, 1.0, 1e12)

    @classmethod
    def from_dict(cls, data: Any) -> NetFaults:
        """Build from JSON (the control endpoint, scenario files); unknown keys are refused."""
        if not isinstance(data, dict):
            raise ProxyError(f"faults must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ProxyError(f"unknown fault keys {unknown}; valid keys: {sorted(known)}")
        for key, value in data.items():
            numeric = key not in ("partition", "loss_mode") and value is not None
            if numeric and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise ProxyError(f"{key}={value!r} must be a number")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_finite(name: str, value: float, low: float, high: float) -> None:
    if not isinstance(value, int | float) or not math.isfinite(value) or not low <= value <= high:
        raise ProxyError(f"{name}={value!r} must be a number in [{low:g}, {high:g}]")


class TokenBucket:
    """A token bucket in virtual time: `reserve(n, now)` says how long to wait before sending
    n bytes. Tokens may go negative (a chunk bigger than the burst waits its full cost), so
    the long-run rate never exceeds `rate` whatever the chunk sizes."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ProxyError(f"token bucket needs rate > 0 and burst > 0, got {rate}, {burst}")
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._at = now

    def reserve(self, size: int, now: float) -> float:
        elapsed = max(0.0, now - self._at)
        self._tokens = min(self.burst, self._tokens + elapsed * self.rate)
        self._at = max(self._at, now)
        self._tokens -= size
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


def due_time(now: float, previous_due: float, delay: float, jitter: float, unit: float) -> float:
    """When a chunk read at `now` may be written: `now + delay ± jitter` (unit in [-1, 1]
    picks the jitter), never before the chunk ahead of it, so a stream is never reordered."""
    return max(previous_due, now + max(0.0, delay + jitter * unit))
