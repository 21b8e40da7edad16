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
  when their group is at a checkpoint boundary (`checkpoint_groups`), and only as their whole
  group: the group is gang-placed again by placement's own rule (one NVLink island when one
  has room, else one RDMA domain) on the nodes that may receive tasks, or it stays where it
  is with a `stuck` decision; a group is never split by a move.
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

import bisect
import math
from collections.abc import Sequence

from shoal.scheduler.errors import PlacementRefused, SchedulerError
from shoal.scheduler.model import (
    BalancePlan,
    BalancerState,
    Decision,
    LearnerGroup,
    Migration,
    Node,
    NodeHealth,
    Placement,
)
from shoal.scheduler.placement import GangPlacer
from shoal.scheduler.reservations import Reservations
from shoal.scheduler.signals import BalancerConfig, degradation, effective_load, fault
from shoal.scheduler.topology import Topology

__all__ = ["BalancerConfig", "balance"]


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


class _Round:
    """The mutable working state of one `balance` call (never escapes it)."""

    def __init__(
        self,
        topology: Topology,
        placements: Sequence[Placement],
        health: Sequence[NodeHealth],
        prev: BalancerState,
        now: float,
        cfg: BalancerConfig,
    ) -> None:
        self.topology, self.prev, self.now, self.cfg = topology, prev, now, cfg
        self.moves: list[Migration] = []
        self.decisions: list[Decision] = []
        self.reservations = Reservations(topology, placements)
        self.health: dict[str, NodeHealth] = {}
        for h in health:
            if h.node not in self.reservations.usage:
                raise SchedulerError(
                    f"health reported for unknown node {h.node!r}; register it first"
                )
            if h.node in self.health:
                raise SchedulerError(f"two health reports for node {h.node!r} in one round")
            self.health[h.node] = h
        self.load = {n: effective_load(h, self.cfg) for n, h in self.health.items()}
        self.share = self._task_shares()
        self.streak = {
            n: (dict(self.prev.streak).get(n, 0) + 1 if self.load[n] >= self.cfg.high else 0)
            for n in self.health
        }
        self.faulty = {n for n, h in self.health.items() if fault(h, self.cfg)}
        self.degraded = {n for n, h in self.health.items() if degradation(h, self.cfg)}
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
        self.groups_done: set[str] = set()  # learner groups moved or found stuck this round
        # The receivers, reservations that show only them as ready, and a gang placer on it:
        # built at the first learner group a drain moves, then kept in step by `_move_all`.
        self._gang: tuple[frozenset[str], Reservations, GangPlacer] | None = None
        # Nodes that may receive tasks this round if not overloaded, and those that currently
        # may, sorted by (load, name); `_rerank` keeps the list current as loads and `over` change.
        self.receiving = {
            n
            for n in self.load
            if self.reservations.usage[n].node.schedulable
            and n not in self.draining
            and n not in self.degraded
            and n not in self.node_cool
        }
        self.ranked = sorted((self.load[n], n) for n in self.receiving if n not in self.over)

    def _task_shares(self) -> dict[str, float]:
        """Split each node's measured load among its tasks by reservation (CPUs + GPUs)."""
        out: dict[str, float] = {}
        for name, usage in self.reservations.usage.items():
            if name not in self.load or not usage.tasks:
                continue
            tasks = sorted(usage.tasks)
            weights = [
                self.reservations.where[t].cpus + len(self.reservations.where[t].gpus)
                for t in tasks
            ]
            total = sum(weights)
            for task, w in zip(tasks, weights):
                out[task] = self.load[name] * (w / total if total else 1 / len(tasks))
        return out

    # --- targets ------------------------------------------------------------------------

    def _gain(self, task: str, source: str, target: str) -> float:
        """The load `task` adds to `target`: its share, scaled by the nodes' CPU capacities."""
        src = self.reservations.usage[source].node.cpus
        dst = self.reservations.usage[target].node.cpus
        ratio = src / dst if src and dst else 1.0
        return self.share.get(task, 0.0) * ratio

    def _rerank(self, node: str, old: float) -> None:
        """Keep `ranked` sorted after `node`'s load changed from `old`, and in step with `over`."""
        entry = (old, node)
        at = bisect.bisect_left(self.ranked, entry)
        if at < len(self.ranked) and self.ranked[at] == entry:
            del self.ranked[at]
        if node in self.receiving and node not in self.over:
            bisect.insort(self.ranked, (self.load[node], node))

    def _fits(self, p: Placement, target: str) -> bool:
        usage = self.reservations.usage[target]
        return usage.fits(p.cpus, p.memory_mb) and usage.free_gpu_count >= len(p.gpus)

    def _move(self, p: Placement, target: str, gpus: tuple[int, ...], reason: str) -> None:
        self._move_all([(p, target, gpus, reason)])

    def _move_all(self, moves: list[tuple[Placement, str, tuple[int, ...], str]]) -> None:
        """Move tasks together: every source is vacated before any target is taken, so a rank
        of a group may land on GPUs another rank of the same group leaves."""
        gains = [self._gain(p.task, p.node, target) for p, target, _, _ in moves]
        copies = [self.reservations] if self._gang is None else [self.reservations, self._gang[1]]
        for p, _, _, _ in moves:
            for reservations in copies:
                reservations.remove(p.task)
            if p.node in self.load:
                old = self.load[p.node]
                self.load[p.node] = max(0.0, old - self.share.get(p.task, 0.0))
                if self.load[p.node] < self.cfg.low:
                    self.over.discard(p.node)
                self._rerank(p.node, old)
        for (p, target, gpus, reason), gain in zip(moves, gains):
            for reservations in copies:
                reservations.add(p.moved_to(target, gpus))
            old = self.load[target]
            self.load[target] += gain
            self._rerank(target, old)
            self.moved.add(p.task)
            self.moves.append(Migration(p.task, p.node, target, gpus, reason))

    # --- drains -------------------------------------------------------------------------

    def drain(self, checkpoint_groups: frozenset[str]) -> None:
        for node in sorted(self.faulty):
            if self.topology.node(node).state not in ("draining", "dead"):
                why = fault(self.health[node], self.cfg)
                self.decisions.append(
                    Decision(node, "drain", f"{node}: {why}; cordon it and move its tasks away")
                )
        for node in sorted(self.draining):
            why = fault(self.health[node], self.cfg) if node in self.faulty else "node is draining"
            for task in sorted(self.reservations.usage[node].tasks):
                self._drain_task(self.reservations.where[task], why, checkpoint_groups)

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
        if p.kind == "learner":
            self._drain_group(p, why)
            return
        if not p.movable:
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
        """The least-loaded receiver that fits the rollout actor and stays below `high`."""
        for _, target in self.ranked:  # never holds p.node: it is draining
            if self.load[target] >= self.cfg.high:
                return None  # sorted by load: no later target stays below `high` either
            if self._fits(p, target) and (
                self.load[target] + self._gain(p.task, p.node, target) < self.cfg.high
            ):
                return target, tuple(self.reservations.usage[target].free_gpus()[: len(p.gpus)])
        return None

    # --- learner groups -----------------------------------------------------------------

    def _drain_group(self, p: Placement, why: str) -> None:
        """Move every rank of `p`'s group as one gang, placed by placement's own rule on the
        receivers, or none of them (`stuck`, saying what the group needs)."""
        name = p.group or p.task
        if name in self.groups_done:
            return  # moved, or found stuck, when an earlier rank of it was drained
        self.groups_done.add(name)
        ranks = sorted(
            (
                q
                for q in self.reservations.where.values()
                if q.kind == "learner" and (q.group or q.task) == name
            ),
            key=lambda q: q.task,
        )
        reservations, placer = self._gang_placer()
        for q in ranks:
            reservations.remove(q.task)  # the group's own GPUs count as free for its new place
        try:
            slots = placer.place(_as_group(name, ranks))
        except PlacementRefused as exc:
            self.decisions.append(
                Decision(
                    p.node,
                    "stuck",
                    f"learner group {name!r} cannot leave {p.node} ({why}) as one unit: {exc} "
                    f"(counting only nodes that may take tasks now: ready and not draining, "
                    f"degraded, overloaded or cooling down); no rank moves, retried next round",
                    name,
                )
            )
            return
        finally:
            for q in ranks:
                reservations.add(q)
        where = self._describe(slots)
        self._move_all(
            [
                (
                    q,
                    node,
                    gpus,
                    f"drain {p.node} ({why}): learner group {name!r} moves as one to {where}: "
                    f"{q.task} to {node}",
                )
                for q, (node, gpus) in _match(ranks, slots)
                if (node, gpus) != (q.node, q.gpus)
            ]
        )

    def _gang_placer(self) -> tuple[Reservations, GangPlacer]:
        """Reservations of the current placements on the topology with every ready node that may
        not receive tasks now shown cordoned, so placement's gang rule sees only the
        receivers; and a gang placer on it (rebuilt only if the receivers changed)."""
        allowed = frozenset(n for _, n in self.ranked)
        if self._gang is None or self._gang[0] != allowed:
            topology = Topology(
                tuple(
                    Node(n.name, n.cpus, n.memory_mb, n.gpus, n.domain, "cordoned")
                    if n.schedulable and n.name not in allowed
                    else n
                    for n in self.topology.nodes
                )
            )
            reservations = Reservations(topology, self.reservations.where.values())
            self._gang = (allowed, reservations, GangPlacer(topology, reservations))
        return self._gang[1], self._gang[2]

    def _describe(self, slots: tuple[Placement, ...]) -> str:
        nodes = self.reservations.usage
        islands = {nodes[s.node].node.island_of(g) for s in slots for g in s.gpus}
        if len(islands) == 1:
            return f"NVLink island {islands.pop()}"
        return f"RDMA domain {nodes[slots[0].node].node.domain}"

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
                tuple(self.reservations.usage[target].free_gpus()[: len(p.gpus)]),
                f"relieve {source} (load {before:.2f} ≥ {self.cfg.low:.2f}): move {p.task} to "
                f"{target} (load {self.load[target]:.2f} → "
                f"{self.load[target] + self._gain(p.task, source, target):.2f})",
            )

    def _next_relief(self) -> tuple[Placement, str, float] | None:
        sources = [n for n in self.over if self.load[n] >= self.cfg.low and n not in self.node_cool]
        for source in sorted(sources, key=lambda n: (-self.load[n], n)):
            ceiling = min(self.cfg.high, self.load[source])
            for p in self._candidates(source):
                for _, target in self.ranked:  # never holds `source`: it is overloaded
                    if self.load[target] >= ceiling:
                        break  # sorted by load, and a move only adds: no later target can do
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
            self.reservations.where[t]
            for t in self.reservations.usage[source].tasks
            if t not in self.moved and t not in self.task_cool
        ]
        movable = [p for p in tasks if p.kind == "rollout" and p.movable]
        return sorted(movable, key=lambda p: (-self.share.get(p.task, 0.0), p.task))

    # --- result -------------------------------------------------------------------------

    def result(self) -> BalancePlan:
        self._overload_decisions()
        for node in sorted(self.degraded - self.prev.degraded):
            reason = f"{node} degraded: {degradation(self.health[node], self.cfg)}; it takes no migrated tasks"
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
        # A node that took part in a migration within the cooldown may still report the load
        # it had before: it was announced then, so it is not announced again.
        for node in sorted(self.measured_over - self.prev.overloaded - self.node_cool.keys()):
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
                    f"{effective_load(self.health[node], self.cfg):.2f}) ≥ {self.cfg.high:.2f} for "
                    f"{self.streak[node]} report(s); {plan}",
                )
            )
        for node in sorted(self.prev.overloaded - self.measured_over - self.draining):
            if node in self.health:
                self.decisions.append(
                    Decision(
                        node,
                        "recovered",
                        f"{node} recovered: load {effective_load(self.health[node], self.cfg):.2f} < {self.cfg.low:.2f}",
                    )
                )


def _as_group(name: str, ranks: list[Placement]) -> LearnerGroup:
    """The ranks of one group as a gang request, each rank sized like the largest."""
    return LearnerGroup(
        name,
        len(ranks),
        max(len(q.gpus) for q in ranks),
        max(q.cpus for q in ranks),
        max(q.memory_mb for q in ranks),
    )


def _match(
    ranks: list[Placement], slots: tuple[Placement, ...]
) -> list[tuple[Placement, tuple[str, tuple[int, ...]]]]:
    """Give each rank a slot, keeping a rank whose exact GPUs (then whose node) the new gang
    placement reuses where it is, so as few ranks as possible change place."""
    free = [(s.node, s.gpus) for s in slots]
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for same in (lambda q, s: s == (q.node, q.gpus), lambda q, s: s[0] == q.node):
        for q in ranks:
            hit = next((s for s in free if q.task not in out and same(q, s)), None)
            if hit is not None:
                out[q.task] = hit
                free.remove(hit)
    for q in ranks:
        if q.task not in out:
            out[q.task] = free.pop(0)
    return [(q, out[q.task]) for q in ranks]
