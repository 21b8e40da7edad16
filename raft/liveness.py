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

    def heartbeat(self, node_id: str, now: float, health: dict[str, Any] | None) -> None:
        self._seen[node_id] = now
        if health is not None:
            pending = self._health.get(node_id)
            if pending is not None:
                health = _keep_errors(pending[0], health)
            self._health[node_id] = (health, now)

    def reset(self, now: float) -> None:
        """Forget everything (leadership changed hands): every node starts a fresh grace period."""
        self._seen = {node_id: now for node_id in self._seen}
        self._health.clear()

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
        return out

    def take_health(self) -> list[dict[str, Any]]:
        """Health reports gathered since the last call, ready for one `report_health` command."""
        reports = [
            {"node_id": node_id, "health": health, "last_heartbeat": at}
            for node_id, (health, at) in sorted(self._health.items())
        ]
        self._health.clear()
        return reports


# Error counts a node reports as "new since its last collection". Only the newest report of a
# node reaches the next replicated batch, so a fault seen in an earlier heartbeat of the same
# batch would be overwritten by a clean one; keep the largest count seen in the batch. (A node
# may repeat one collection in several heartbeats, so the counts are not added up.)
_ERROR_COUNTS = ("xid_errors", "ecc_errors")


def _keep_errors(pending: dict[str, Any], health: dict[str, Any]) -> dict[str, Any]:
    kept = {
        key: max(pending[key], health.get(key, 0))
        for key in _ERROR_COUNTS
        if isinstance(pending.get(key), int) and pending[key] > 0
    }
    return {**health, **kept} if kept else health
