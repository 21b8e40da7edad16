"""What one node's health report says against the balancer's thresholds: its effective load,
a GPU fault, a degradation — each with the words the event log shows.

Kept apart from the planning in balancer.py so the judgement of a single report can be read
(and changed) without the migration logic around it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shoal.errors import ConfigError
from shoal.scheduler.model import NodeHealth


@dataclass(frozen=True)
class BalancerConfig:
    """Thresholds of the balancer (the `[balancer]` table of shoal.toml)."""

    high: float = 0.85
    """Load (busiest resource fraction) at or above which a node is a candidate for relief."""
    low: float = 0.65
    """An overloaded node counts as recovered once below this; also the goal of a relief."""
    enter_after: int = 2
    """Consecutive reports at or above `high` before a node counts as overloaded."""
    cooldown_s: float = 120.0
    """A moved task, and its source and target nodes, are not touched again for this long."""
    max_xid_errors: int = 0
    """New XID events tolerated per health batch (all GPUs of the node, every collection the
    batch covers, each counted once) before the node is drained."""
    max_ecc_errors: int = 0
    """New uncorrectable ECC errors tolerated per health batch before the node is drained."""
    max_latency_ms: float = 50.0
    """Above this network latency the node takes no migrated tasks."""
    max_clock_offset_ms: float = 100.0
    """Above this clock offset (either sign) the node takes no migrated tasks."""
    min_steps_ratio: float = 0.5
    """Env steps/s below this fraction of the node's own baseline counts as overload."""

    def __post_init__(self) -> None:
        for key in ("high", "low", "cooldown_s", "max_latency_ms", "max_clock_offset_ms"):
            value = getattr(self, key)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"balancer.{key} = {value!r}: must be a finite number >= 0")
        if not 0 < self.low < self.high:
            raise ConfigError(
                f"balancer.low = {self.low!r}, balancer.high = {self.high!r}: "
                "need 0 < low < high (e.g. low 0.65, high 0.85)"
            )
        for key in ("enter_after",):
            if not isinstance(self.enter_after, int) or self.enter_after < 1:
                raise ConfigError(f"balancer.{key} = {self.enter_after!r}: must be an int >= 1")
        for key in ("max_xid_errors", "max_ecc_errors"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"balancer.{key} = {value!r}: must be an int >= 0")
        if not 0 <= self.min_steps_ratio <= 1:
            raise ConfigError(
                f"balancer.min_steps_ratio = {self.min_steps_ratio!r}: must be between 0 and 1"
            )


def effective_load(h: NodeHealth, cfg: BalancerConfig) -> float:
    """The busiest resource fraction; at least `high` when env steps/s fell below
    `min_steps_ratio` of the node's own baseline (contention the fractions do not show)."""
    value, _ = h.load()
    ratio = h.steps_ratio()
    if ratio is not None and ratio < cfg.min_steps_ratio:
        return max(value, cfg.high)
    return value


def fault(h: NodeHealth, cfg: BalancerConfig) -> str:
    """Why the node must be drained ("" when it need not): new XID or uncorrectable ECC errors.
    Only the new ones count: the running totals say what the node went through, not what its
    GPUs are worth now."""
    parts = []
    if h.xid_errors > cfg.max_xid_errors:
        parts.append(f"{h.xid_errors} new XID error(s)")
    if h.ecc_errors > cfg.max_ecc_errors:
        parts.append(f"{h.ecc_errors} new uncorrectable ECC error(s)")
    return " and ".join(parts)


def degradation(h: NodeHealth, cfg: BalancerConfig) -> str:
    """Why the node should take no migrated tasks ("" when it may): slow network, skewed
    clock, or env steps/s well below its own baseline."""
    parts = []
    if h.latency_ms > cfg.max_latency_ms:
        parts.append(f"network latency {h.latency_ms:g} ms > {cfg.max_latency_ms:g} ms")
    if abs(h.clock_offset_ms) > cfg.max_clock_offset_ms:
        parts.append(
            f"clock offset {h.clock_offset_ms:+g} ms beyond ±{cfg.max_clock_offset_ms:g} ms"
        )
    ratio = h.steps_ratio()
    if ratio is not None and ratio < cfg.min_steps_ratio:
        parts.append(f"env steps/s at {ratio:.0%} of its baseline (< {cfg.min_steps_ratio:.0%})")
    return "; ".join(parts)
