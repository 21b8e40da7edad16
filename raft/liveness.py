"""Leader-side heartbeat book-keeping: heartbeats live in memory, only changes are replicated.

Pure: the caller passes `now`. A node the table has never heard of (a new leader's first look)
gets a full grace period instead of being declared dead at once.
"""

from __future__ import annotations

from typing import Any

from shoal.raft.config import LivenessConfig


class LivenessTable:
    """Last heartbeat per node and the health waiting to be replicated. Event-loop only."""

    def __init__(self, config: LivenessConfig) -> None:
        self._config = config
        self._seen: dict[str, float] = {}
        self._health: dict[str, tuple[dict[str, Any], float]] = {}
        self._totals: dict[str, dict[str, int]] = {}
        """Per node, the running error totals of its newest heartbeat (kept across batches)."""

    def heartbeat(self, node_id: str, now: float, health: dict[str, Any] | None) -> None:
        self._seen[node_id] = now
        if health is not None:
            pending = self._health.get(node_id)
            health = fold_errors(
                None if pending is None else pending[0],
                health,
                self._totals.setdefault(node_id, {}),
            )
            self._health[node_id] = (health, now)

    def reset(self, now: float) -> None:
        """Forget everything (leadership changed hands): every node starts a fresh grace period."""
        self._seen = {node_id: now for node_id in self._seen}
        self._health.clear()
        self._totals.clear()

    def expected(self, node_id: str, now: float) -> str:
        age = now - self._seen.setdefault(node_id, now)
        if age < self._config.suspect_after:
            return "alive"
        return "suspect" if age < self._config.dead_after else "dead"

    def changes(self, current: dict[str, str], now: float) -> list[dict[str, str]]:
        """The liveness changes to replicate, given each node's replicated liveness."""
        out = []
        for node_id, liveness in sorted(current.items()):
            expected = self.expected(node_id, now)
            if expected != liveness:
                out.append({"node_id": node_id, "liveness": expected})
        for node_id in set(self._seen) - set(current):
            del self._seen[node_id]
            self._totals.pop(node_id, None)
        return out

    def take_health(self) -> list[dict[str, Any]]:
        """Health reports gathered since the last call, ready for one `report_health` command."""
        reports = [
            {"node_id": node_id, "health": health, "last_heartbeat": at}
            for node_id, (health, at) in sorted(self._health.items())
        ]
        self._health.clear()
        return reports


# A node's summary counts errors twice: new since its previous collection (`xid_errors`) and
# in total since it started (`xid_total`). Heartbeats repeat the newest collection until the
# next one, and only one summary per node reaches a replicated batch, so the batch must carry
# the sum of the new errors of every distinct collection it covers — not the newest one alone
# (a clean summary would hide a fault) nor the largest (a burst over two collections would be
# under-counted). A summary whose total equals the previous heartbeat's brings nothing new; one
# whose total differs (up, or down after the daemon restarted) brings its own new count.
_ERROR_COUNTS = (("xid_errors", "xid_total"), ("ecc_errors", "ecc_total"))


def fold_errors(
    pending: dict[str, Any] | None, health: dict[str, Any], last_totals: dict[str, int]
) -> dict[str, Any]:
    """`health` whose summary's new-error counts add what the batch already held (`pending`)
    to what this heartbeat brings; `last_totals` (this node's running totals as of its
    previous heartbeat) is updated in place."""
    summary = health.get("summary")
    if not isinstance(summary, dict):
        return health
    before = pending.get("summary") if pending is not None else None
    folded = dict(summary)
    for new_key, total_key in _ERROR_COUNTS:
        new, total = summary.get(new_key), summary.get(total_key)
        if not isinstance(new, int) or not isinstance(total, int):
            continue
        brought = new if last_totals.get(total_key) != total else 0
        last_totals[total_key] = total
        held = before.get(new_key, 0) if isinstance(before, dict) else 0
        folded[new_key] = (held if isinstance(held, int) else 0) + brought
    return {**health, "summary": folded}
