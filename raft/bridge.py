"""The seam between pysyncobj's tick thread and the asyncio event loop.

pysyncobj calls back on its own thread; each callback only hands its result to the loop with
`loop.call_soon_threadsafe`, so the loop never blocks on Raft (no `sync=True` anywhere) and
pysyncobj's thread never touches an asyncio object directly.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from pysyncobj import FAIL_REASON, SyncObj
from pysyncobj.syncobj import _RAFT_STATE

from shoal.raft.errors import Busy, NoQuorum, NotLeader, RaftError, RaftTimeout
from shoal.raft.machine import Result
from shoal.raft.state import ClusterState

LeadershipListener = Callable[[bool], None]


def _failure(reason: int) -> RaftError:
    if reason == FAIL_REASON.QUEUE_FULL:
        return Busy("the replica's command queue is full; retry with the same operation id")
    if reason == FAIL_REASON.MISSING_LEADER:
        return NoQuorum("no leader is elected; a majority of replicas must be up")
    return NotLeader(
        f"leadership changed before the write committed (pysyncobj reason {reason}); "
        "retry with the same operation id"
    )


class RaftBridge:
    """Proposes commands from the loop and tells the loop when this replica gains or loses lead.

    Built before the SyncObj (its `on_state_changed` goes into the SyncObj's config), then
    `attach`ed. `propose`, `status` and `add_listener` are for the event loop's thread;
    `on_state_changed` is called by pysyncobj's thread.
    """

    def __init__(self, state: ClusterState, loop: asyncio.AbstractEventLoop) -> None:
        self.state = state
        self._loop = loop
        self._sync: SyncObj | None = None
        self._listeners: list[LeadershipListener] = []
        self.proposed = 0
        self.failed = 0

    def attach(self, sync: SyncObj) -> None:
        self._sync = sync

    @property
    def sync(self) -> SyncObj:
        if self._sync is None:
            raise RuntimeError("RaftBridge.attach was not called")
        return self._sync

    def add_listener(self, listener: LeadershipListener) -> None:
        self._listeners.append(listener)

    def on_state_changed(self, old: int, new: int) -> None:
        """pysyncobj thread: forward a leadership change to the loop."""
        if (old == _RAFT_STATE.LEADER) != (new == _RAFT_STATE.LEADER):
            self._call_in_loop(self._notify, new == _RAFT_STATE.LEADER)

    def _notify(self, leading: bool) -> None:
        for listener in self._listeners:
            listener(leading)

    def _call_in_loop(self, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed while Raft was finishing
            self._loop.call_soon_threadsafe(fn, *args)

    async def propose(self, command: dict[str, Any], timeout: float) -> Result:
        """Commit a validated command and return its result; raises NoQuorum, RaftTimeout, ..."""
        sync = self.sync
        if not sync.hasQuorum:
            raise NoQuorum(
                "this replica reaches no majority of replicas, so nothing can commit; "
                "bring replicas back up or ask another replica"
            )
        future: asyncio.Future[Result] = self._loop.create_future()

        def settle(result: Any, reason: int) -> None:
            if not future.done():
                if reason == FAIL_REASON.SUCCESS:
                    future.set_result(result)
                else:
                    future.set_exception(_failure(reason))

        def callback(result: Any, reason: int) -> None:
            self._call_in_loop(settle, result, reason)

        self.proposed += 1
        self.state.propose(command, callback)
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            self.failed += 1
            if not sync.hasQuorum:
                raise NoQuorum(
                    "lost the majority of replicas while the write was in flight"
                ) from None
            raise RaftTimeout(
                f"the write did not commit within {timeout:g} s; retry with the same operation id"
            ) from None
        except RaftError:
            self.failed += 1
            raise

    def is_leader(self) -> bool:
        return bool(self.sync._isLeader())

    def leader_address(self) -> str | None:
        leader = self.sync._getLeader()
        return None if leader is None else str(leader.address)

    def _raw_status(self) -> dict[str, Any]:
        # getStatus iterates pysyncobj's dicts, which its thread may resize mid-read: retry.
        for _ in range(10):
            with contextlib.suppress(RuntimeError):
                return dict(self.sync.getStatus())
        return dict(self.sync.getStatus())

    def last_applied(self) -> int:
        return int(self.sync.raftLastApplied)

    def status(self) -> dict[str, Any]:
        """A consistent-enough view of Raft for /v1/cluster and /metrics (read on the loop)."""
        raw = self._raw_status()
        commit = int(raw["commit_idx"])
        replicas = []
        for node in sorted(self.sync.otherNodes, key=lambda n: n.address):
            match = raw.get(f"match_idx_server_{node.id}")
            replicas.append(
                {
                    "raft": node.address,
                    "connected": bool(self.sync.isNodeConnected(node)),
                    "match_index": match,
                    "lag": None if match is None else max(0, commit - int(match)),
                }
            )
        return {
            "state": {0: "follower", 1: "candidate", 2: "leader"}.get(raw["state"], "unknown"),
            "leader": self.leader_address(),
            "term": int(raw["raft_term"]),
            "commit_index": commit,
            "last_applied": int(raw["last_applied"]),
            "has_quorum": bool(raw["has_quorum"]),
            "log_length": int(raw["log_len"]),
            "replicas": replicas,
        }
