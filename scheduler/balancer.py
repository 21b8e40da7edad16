"""Decide which nodes are overloaded or faulty and plan migrations off them.

Pure: health, placements, the previous `BalancerState` and the time `now` go in; a plan of
make-before-break migrations, the decisions with their reasons and the next state come out.
Nothing here reads a clock.

How a round works:
- A node's load is its busiest resource fraction (CPU, memory, GPU utilisation or GPU memory);
  a node whose env steps/s fell below `min_steps_ratio` of its own baseline counts as at least
  `high`, since a slowdown is contention we cannot see in the fractions.
- Hysteresis: a node becomes overloaded after `enter_after` consecutive reports at or above
  `high`, and stays so until its load falls below `low`.
- A fault (new XID or uncorrectable ECC errors) asks the leader to cordon and drain the node;
  every movable task on a faulty or draining node is planned away. Learner ranks move only
  when their group is at a checkpoint boundary (`checkpoint_groups`).
- The node's load is shared among its tasks by reservation (CPUs + GPUs), so a move is
  projected: the source sheds the task's share, the target gains it scaled by CPU capacity.
  A rollout actor moves off an overloaded node only to a node that stays below `high` and below
  the source's load, so no plan raises the maximum load; moves repeat, largest share first,
  until every overloaded node is projected below `low` or nothing more fits.
- Cooldown: a task that moved, and the two nodes it moved between, are left alone for
  `cooldown_s`, so load that has not yet settled in the next reports does not cause a second
  wave of moves or a move back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from shoal.errors import ConfigError
from shoal.scheduler.errors import SchedulerError
from shoal.scheduler.ledger import Ledger
from shoal.scheduler.model import (
    BalancePlan,
    BalancerState,
    Decision,
    Migration,
    NodeHealth,
    Placement,
)
from shoal.scheduler.topology import Topology


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
    """New XID events tolerated per report before the node is drained."""
    max_ecc_errors: int = 0
    """New uncorrectable ECC errors tolerated per report before the node is drained."""
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


def balance(
    topology: Topology,
    placements: Sequence[Placement],
    health: Sequence[NodeHealth],
    state: BalancerState,
    now: float,
    config: BalancerConfig | None = None,
    checkpoint_groups: frozenset[str] = frozenset(),
) -> BalancePlan:
    """One balancing round at time `now` (seconds, any epoch, from the leader's clock)."""
    if not math.isfinite(now):
        raise SchedulerError(f"balance: now must be a finite time in seconds, got {now!r}")
    round_ = _Round(topology, placements, health, state, now, config or BalancerConfig())
    round_.drain(checkpoint_groups)
    round_.relieve()
    return round_.result()


@dataclass
class _Round:
    """The mutable working state of one `balance` call (never escapes it)."""

    topology: Topology
    placements: Sequence[Placement]
    health_list: Sequence[NodeHealth]
    prev: BalancerState
    now: float
    cfg: BalancerConfig
    ledger: Ledger = field(init=False)
    health: dict[str, NodeHealth] = field(init=False)
    load: dict[str, float] = field(init=False)
    share: dict[str, float] = field(init=False)
    over: set[str] = field(init=False)
    moves: list[Migration] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.topology, self.placements)
        self.health = {}
        for h in self.health_list:
            if h.node not in self.ledger.usage:
                raise SchedulerError(
                    f"health reported for unknown node {h.node!r}; register it first"
                )
            if h.node in self.health:
                raise SchedulerError(f"two health reports for node {h.node!r} in one round")
            self.health[h.node] = h
        self.load = {n: self._effective_load(h) for n, h in self.health.items()}
        self.share = self._task_shares()
        self.streak = {
            n: (dict(self.prev.streak).get(n, 0) + 1 if self.load[n] >= self.cfg.high else 0)
            for n in self.health
        }
        self.faulty = {n for n, h in self.health.items() if self._fault(h)}
        self.degraded = {n for n, h in self.health.items() if self._degradation(h)}
        self.draining = self.faulty | {n.name for n in self.topology.nodes if n.state == "draining"}
        self.measured_over = {
            n
            for n in self.health
            if n not in self.draining
            and (
                (n in self.prev.overloaded and self.load[n] >= self.cfg.low)
                or self.streak[n] >= self.cfg.enter_after
            )
        }
        self.over = set(self.measured_over)
        self.task_cool = {
            t: at for t, at in self.prev.task_moved_at if self.now - at < self.cfg.cooldown_s
        }
        self.node_cool = {
            n: at for n, at in self.prev.node_moved_at if self.now - at < self.cfg.cooldown_s
        }
        self.moved: set[str] = set()
        # Nodes that may receive tasks this round, apart from `over`, which changes as we go.
        self.receivers = [
            n
            for n in self.load
            if self.ledger.usage[n].node.schedulable
            and n not in self.draining
            and n not in self.degraded
            and n not in self.node_cool
        ]

    # --- classification -----------------------------------------------------------------

    def _effective_load(self, h: NodeHealth) -> float:
        value, _ = h.load()
        ratio = h.steps_ratio()
        if ratio is not None and ratio < self.cfg.min_steps_ratio:
            return max(value, self.cfg.high)
        return value

    def _fault(self, h: NodeHealth) -> str:
        parts = []
        if h.xid_errors > self.cfg.max_xid_errors:
            parts.append(f"{h.xid_errors} new XID error(s)")
        if h.ecc_errors > self.cfg.max_ecc_errors:
            parts.append(f"{h.ecc_errors} new uncorrectable ECC error(s)")
        return " and ".join(parts)

    def _degradation(self, h: NodeHealth) -> str:
        parts = []
        if h.latency_ms > self.cfg.max_latency_ms:
            parts.append(f"network latency {h.latency_ms:g} ms > {self.cfg.max_latency_ms:g} ms")
        if abs(h.clock_offset_ms) > self.cfg.max_clock_offset_ms:
            parts.append(
                f"clock offset {h.clock_offset_ms:+g} ms beyond ±{self.cfg.max_clock_offset_ms:g} ms"
            )
        ratio = h.steps_ratio()
        if ratio is not None and ratio < self.cfg.min_steps_ratio:
            parts.append(
                f"env steps/s at {ratio:.0%} of its baseline (< {self.cfg.min_steps_ratio:.0%})"
            )
        return "; ".join(parts)

    def _task_shares(self) -> dict[str, float]:
        """Split each node's measured load among its tasks by reservation (CPUs + GPUs)."""
        out: dict[str, float] = {}
        for name, usage in self.ledger.usage.items():
            if name not in self.load or not usage.tasks:
                continue
            tasks = sorted(usage.tasks)
            weights = [self.ledger.where[t].cpus + len(self.ledger.where[t].gpus) for t in tasks]
            total = sum(weights)
            for task, w in zip(tasks, weights):
                out[task] = self.load[name] * (w / total if total else 1 / len(tasks))
        return out

    # --- targets ------------------------------------------------------------------------

    def _gain(self, task: str, source: str, target: str) -> float:
        """The load `task` adds to `target`: its share, scaled by the nodes' CPU capacities."""
        src = self.ledger.usage[source].node.cpus
        dst = self.ledger.usage[target].node.cpus
        ratio = src / dst if src and dst else 1.0
        return self.share.get(task, 0.0) * ratio

    def _targets(self, source: str) -> list[str]:
        """Nodes that may receive a task, least loaded first (ties by name)."""
        ok = [n for n in self.receivers if n != source and n not in self.over]
        return sorted(ok, key=lambda n: (self.load[n], n))

    def _fits(self, p: Placement, target: str) -> bool:
        usage = self.ledger.usage[target]
        return usage.fits(p.cpus, p.memory_mb) and len(usage.free_gpus()) >= len(p.gpus)

    def _move(self, p: Placement, target: str, gpus: tuple[int, ...], reason: str) -> None:
        gain = self._gain(p.task, p.node, target)
        self.ledger.remove(p.task)
        self.ledger.add(p.moved_to(target, gpus))
        if p.node in self.load:
            self.load[p.node] = max(0.0, self.load[p.node] - self.share.get(p.task, 0.0))
        self.load[target] += gain
        self.moved.add(p.task)
        self.moves.append(Migration(p.task, p.node, target, gpus, reason))

    # --- drains -------------------------------------------------------------------------

    def drain(self, checkpoint_groups: frozenset[str]) -> None:
        for node in sorted(self.faulty):
            if self.topology.node(node).state not in ("draining", "dead"):
                why = self._fault(self.health[node])
                self.decisions.append(
                    Decision(node, "drain", f"{node}: {why}; cordon it and move its tasks away")
                )
        for node in sorted(self.draining):
            why = self._fault(self.health[node]) if node in self.faulty else "node is draining"
            for task in sorted(self.ledger.usage[node].tasks):
                self._drain_task(self.ledger.where[task], why, checkpoint_groups)

    def _drain_task(self, p: Placement, why: str, checkpoint_groups: frozenset[str]) -> None:
        if p.kind == "learner" and p.group not in checkpoint_groups:
            self.decisions.append(
                Decision(
                    p.node,
                    "hold",
                    f"learner rank {p.task} stays on {p.node} ({why}) "
                    f"until group {p.group!r} reaches a checkpoint boundary",
                    p.task,
                )
            )
            return
        if p.kind == "rollout" and not p.movable:
            self.decisions.append(
                Decision(
                    p.node, "hold", f"{p.task} is not movable; it stays on {p.node} ({why})", p.task
                )
            )
            return
        choice = self._drain_target(p)
        if choice is None:
            self.decisions.append(
                Decision(
                    p.node,
                    "stuck",
                    f"no node can take {p.task} off {p.node} ({why}): every "
                    f"ready node is busy, degraded, cooling down or lacks {p.cpus:g} CPUs / "
                    f"{p.memory_mb} MB / {len(p.gpus)} GPUs; retried next round",
                    p.task,
                )
            )
            return
        target, gpus = choice
        self._move(p, target, gpus, f"drain {p.node} ({why}): move {p.task} to {target}")

    def _drain_target(self, p: Placement) -> tuple[str, tuple[int, ...]] | None:
        """Rollout actors: least-loaded node that stays below `high`. Learner ranks: prefer a
        node with free GPUs on the rank's own island, then its RDMA domain, then any."""
        source = self.ledger.usage[p.node].node
        best: tuple[int, float, str] | None = None
        for target in self._targets(p.node):
            if not self._fits(p, target):
                continue
            if p.kind == "rollout":
                if self.load[target] + self._gain(p.task, p.node, target) < self.cfg.high:
                    return target, tuple(self.ledger.usage[target].free_gpus()[: len(p.gpus)])
                continue
            tier = self._learner_tier(p, target)
            key = (tier, self.load[target], target)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        target = best[2]
        island = source.island_of(p.gpus[0]) if p.gpus else None
        free = self.ledger.usage[target].free_gpus(island) if best[0] == 0 else []
        free = free if len(free) >= len(p.gpus) else self.ledger.usage[target].free_gpus()
        return target, tuple(free[: len(p.gpus)])

    def _learner_tier(self, p: Placement, target: str) -> int:
        source = self.ledger.usage[p.node].node
        usage = self.ledger.usage[target]
        if p.gpus and len(usage.free_gpus(source.island_of(p.gpus[0]))) >= len(p.gpus):
            return 0
        return 1 if usage.node.domain == source.domain else 2

    # --- relief of overloaded nodes ------------------------------------------------------

    def relieve(self) -> None:
        while True:
            step = self._next_relief()
            if step is None:
                return
            p, target, before = step
            source = p.node
            self._move(
                p,
                target,
                tuple(self.ledger.usage[target].free_gpus()[: len(p.gpus)]),
                f"relieve {source} (load {before:.2f} ≥ {self.cfg.low:.2f}): move {p.task} to "
                f"{target} (load {self.load[target]:.2f} → "
                f"{self.load[target] + self._gain(p.task, source, target):.2f})",
            )
            if self.load[source] < self.cfg.low:
                self.over.discard(source)

    def _next_relief(self) -> tuple[Placement, str, float] | None:
        sources = [n for n in self.over if self.load[n] >= self.cfg.low and n not in self.node_cool]
        for source in sorted(sources, key=lambda n: (-self.load[n], n)):
            targets = self._targets(source)
            for p in self._candidates(source):
                for target in targets:
                    after = self.load[target] + self._gain(p.task, source, target)
                    if (
                        after < self.cfg.high
                        and after < self.load[source]
                        and self._fits(p, target)
                    ):
                        return p, target, self.load[source]
        return None

    def _candidates(self, source: str) -> list[Placement]:
        """Movable rollout actors on `source` not in cooldown, largest load share first."""
        tasks = [
            self.ledger.where[t]
            for t in self.ledger.usage[source].tasks
            if t not in self.moved and t not in self.task_cool
        ]
        movable = [p for p in tasks if p.kind == "rollout" and p.movable]
        return sorted(movable, key=lambda p: (-self.share.get(p.task, 0.0), p.task))

    # --- result -------------------------------------------------------------------------

    def result(self) -> BalancePlan:
        self._overload_decisions()
        for node in sorted(self.degraded - self.prev.degraded):
            reason = f"{node} degraded: {self._degradation(self.health[node])}; it takes no migrated tasks"
            self.decisions.append(Decision(node, "degraded", reason))
        for m in self.moves:
            self.task_cool[m.task] = self.now
            self.node_cool[m.source] = self.now
            self.node_cool[m.target] = self.now
        state = BalancerState(
            overloaded=frozenset(self.over),
            degraded=frozenset(self.degraded),
            streak=tuple(sorted((n, k) for n, k in self.streak.items() if k)),
            task_moved_at=tuple(sorted(self.task_cool.items())),
            node_moved_at=tuple(sorted(self.node_cool.items())),
        )
        return BalancePlan(tuple(self.moves), tuple(self.decisions), state)

    def _overload_decisions(self) -> None:
        for node in sorted(self.measured_over - self.prev.overloaded):
            h = self.health[node]
            value, what = h.load()
            count = sum(1 for m in self.moves if m.source == node)
            plan = (
                f"moving {count} rollout actor(s) away"
                if count
                else "nothing movable fits elsewhere now"
            )
            self.decisions.append(
                Decision(
                    node,
                    "overloaded",
                    f"{node} overloaded: {what} {value:.2f} (effective load "
                    f"{self._measured(node):.2f}) ≥ {self.cfg.high:.2f} for "
                    f"{self.streak[node]} report(s); {plan}",
                )
            )
        for node in sorted(self.prev.overloaded - self.measured_over - self.draining):
            if node in self.health:
                self.decisions.append(
                    Decision(
                        node,
                        "recovered",
                        f"{node} recovered: load {self._measured(node):.2f} < {self.cfg.low:.2f}",
                    )
                )

    def _measured(self, node: str) -> float:
        return self._effective_load(self.health[node])
