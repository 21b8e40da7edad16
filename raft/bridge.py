"""The seam between pysyncobj's tick thread and the asyncio event loop, and group commit.

pysyncobj calls back on its own thread; each callback only hands its result to the loop with
`loop.call_soon_threadsafe`, so the loop never blocks on Raft (no `sync=True` anywhere) and
pysyncobj's thread never touches an asyncio object directly.

Group commit: while one proposal is in flight, commands that arrive wait in a queue, and when
it completes they go together as ONE `batch` log entry (each member keeps its own operation id
and gets its own result). A lone writer never waits; many concurrent writers pay one Raft round
trip, one journal record, one encrypted append per follower and one thread hop for a whole
group instead of one each (docs/raft-writes.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pysyncobj import FAIL_REASON, SyncObj

from shoal.raft.errors import Busy, NoQuorum, NotLeader, RaftError, RaftTimeout
from shoal.raft.machine import Result
from shoal.raft.pysyncobj_seam import (
    RAFT_STATE,
    is_leader,
    leader_address,
    pipe_notifier,
    role_name,
)
from shoal.raft.state import ClusterState

LeadershipListener = Callable[[bool], None]
MAX_GROUP = 1000
"""Most commands in one group-commit entry (the batch schema allows 10,000)."""
MAX_GROUP_BYTES = 1 << 20
"""A group stops growing at this much JSON (one command may be this big alone)."""


@dataclass
class _Waiting:
    """A command queued behind the proposal in flight, and the future its writer awaits."""

    command: dict[str, Any]
    future: asyncio.Future[Result]
    timeout: float


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
        self._queue: deque[_Waiting] = deque()
        self._in_flight = 0
        self._group_ids = (f"group-{uuid.uuid4().hex[:16]}-{n}" for n in itertools.count())
        self.proposed = 0
        self.failed = 0
        self.entries = 0
        """Log entries proposed: fewer than `proposed` commands when groups formed."""
        self._answered = 0
        """Proposals answered (called back, or given up on at their timeout), under `_count`."""
        self._count = threading.Lock()
        self._notifier: Any = None
        self._applied = 0
        """The newest log index this bridge saw applied (pysyncobj's thread writes it)."""

    def attach(self, sync: SyncObj) -> None:
        self._sync = sync
        notifier = pipe_notifier(sync)
        if not sync.otherNodes and notifier is not None:
            self._notifier = notifier
            sync.addOnTickCallback(self._wake_alone)

    def _wake_alone(self) -> None:
        """pysyncobj thread, end of each tick of a replica without peers. A leader commits an
        entry on the tick AFTER the one that appended it, and with no follower to answer,
        nothing wakes that tick: it came only when the poll timed out (`tick_period`, 50 ms a
        write). Poke the poll awake while proposals are unanswered."""
        if self.entries > self._answered and is_leader(self.sync):
            self._notifier.notify()

    @property
    def sync(self) -> SyncObj:
        if self._sync is None:
            raise RuntimeError("RaftBridge.attach was not called")
        return self._sync

    def add_listener(self, listener: LeadershipListener) -> None:
        self._listeners.append(listener)

    def on_state_changed(self, old: int, new: int) -> None:
        """pysyncobj thread: forward a leadership change to the loop."""
        if (old == RAFT_STATE.LEADER) != (new == RAFT_STATE.LEADER):
            self._call_in_loop(self._notify, new == RAFT_STATE.LEADER)

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
        self.proposed += 1
        waiting = _Waiting(command, future, timeout)
        if self._in_flight and command["op"] != "batch":
            self._queue.append(waiting)
        else:  # nothing in flight (no one to wait for), or already a batch (they do not nest)
            self._submit([waiting])
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

    def _submit(self, group: list[_Waiting]) -> None:
        """Propose `group` as one log entry; its completion (or its timeout) lets the next
        queued group go."""
        self._in_flight += 1
        self.entries += 1
        if len(group) == 1:
            entry = group[0].command
        else:
            members = [w.command for w in group]
            entry = {
                "op": "batch",
                "op_id": next(self._group_ids),
                "at": time.time(),
                "args": {"commands": members},
            }
        finished = False
        answered = [False]

        def answer() -> None:  # either thread; counts each proposal once
            with self._count:
                if not answered[0]:
                    answered[0] = True
                    self._answered += 1

        def finish(result: Any, reason: int | None) -> None:
            nonlocal finished
            if finished:
                return
            finished = True
            answer()
            expiry.cancel()
            self._in_flight -= 1
            if reason is not None:
                _settle(group, result, reason)
            self._flush()

        # pysyncobj may never call back (a leader that lost its entry and never applies that
        # index again): past the writers' timeout the slot is freed so later groups still go.
        expiry = self._loop.call_later(max(w.timeout for w in group), finish, None, None)

        def callback(result: Any, reason: int) -> None:
            answer()
            if reason == FAIL_REASON.SUCCESS:
                # pysyncobj calls back BEFORE it counts the entry as applied: remember it, so
                # a read answered after this write never reports an older last-applied index.
                self._applied = max(self._applied, self.sync.raftLastApplied + 1)
            self._call_in_loop(finish, result, reason)

        self.state.propose(entry, callback)

    def _flush(self) -> None:
        """Send what queued up behind the finished proposal, as one group."""
        group: list[_Waiting] = []
        size = 0
        while self._queue and len(group) < MAX_GROUP:
            waiting = self._queue[0]
            if waiting.future.done():  # its writer gave up; a retry carries the same op id
                self._queue.popleft()
                continue
            cost = len(json.dumps(waiting.command, separators=(",", ":")))
            if group and size + cost > MAX_GROUP_BYTES:
                break
            group.append(self._queue.popleft())
            size += cost
        if group:
            self._submit(group)

    def is_leader(self) -> bool:
        return is_leader(self.sync)

    def leader_address(self) -> str | None:
        return leader_address(self.sync)

    def _raw_status(self) -> dict[str, Any]:
        # getStatus iterates pysyncobj's dicts, which its thread may resize mid-read: retry.
        for _ in range(10):
            with contextlib.suppress(RuntimeError):
                return dict(self.sync.getStatus())
        return dict(self.sync.getStatus())

    def last_applied(self) -> int:
        return max(int(self.sync.raftLastApplied), self._applied)

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
            "state": role_name(raw["state"]),
            "leader": self.leader_address(),
            "term": int(raw["raft_term"]),
            "commit_index": commit,
            "last_applied": int(raw["last_applied"]),
            "has_quorum": bool(raw["has_quorum"]),
            "log_length": int(raw["log_len"]),
            "replicas": replicas,
        }


def _settle(group: list[_Waiting], result: Any, reason: int) -> None:
    """Hand each writer its own result (a group's are in member order) or the shared failure."""
    if reason != FAIL_REASON.SUCCESS:
        error = _failure(reason)
        for waiting in group:
            if not waiting.future.done():
                waiting.future.set_exception(error)
        return
    results = [result] if len(group) == 1 else result["results"]
    for waiting, own in zip(group, results):
        if not waiting.future.done():
            waiting.future.set_result(own)
