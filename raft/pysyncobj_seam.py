"""Everything shoal takes from pysyncobj beyond its public API, in one module.

pysyncobj has no hook to bound what an unauthenticated peer may send (it reads a frame of any
announced length, up to 2 GiB, into a buffer it grows by concatenation) nor a public way to ask
for leadership, the tick thread or the poll notifier. The few internals shoal needs are named
here and nowhere else, and tests/raft/test_pysyncobj_seam.py fails, naming the piece, when an
upgrade moves one of them; pyproject.toml pins the versions this was checked against.

The guard: until a peer has proven that it holds the cluster secret (its message carried the
random key this replica sent on that connection), its connection reads one frame at a time, each
announced length is checked against `PREAUTH_FRAME_MAX` before a byte of the body is read, and
at most `PREAUTH_CONNECTIONS_MAX` such connections are kept (a new one evicts the oldest). So an
unauthenticated stranger costs at most a few KiB of memory per connection, whatever it sends.
"""

from __future__ import annotations

import errno
import logging
import struct
import threading
from collections.abc import Callable
from typing import Any

from pysyncobj import SyncObj
from pysyncobj.syncobj import _RAFT_STATE
from pysyncobj.tcp_connection import TcpConnection
from pysyncobj.transport import TCPTransport

log = logging.getLogger(__name__)

RAFT_STATE = _RAFT_STATE
"""pysyncobj's role constants (FOLLOWER, CANDIDATE, LEADER), as `onStateChanged` passes them."""
ROLE_NAMES = {
    _RAFT_STATE.FOLLOWER: "follower",
    _RAFT_STATE.CANDIDATE: "candidate",
    _RAFT_STATE.LEADER: "leader",
}
"""The role `getStatus()["state"]` reports, by name (its value is one of RAFT_STATE's)."""
PREAUTH_FRAME_MAX = 4096
"""Longest frame a peer may announce before it has authenticated. The handshake frames of
pysyncobj 0.3 are Fernet tokens of about 250 bytes (a random key, then the peer's address)."""
PREAUTH_CONNECTIONS_MAX = 16
"""Unauthenticated connections kept at once; a replica has one connection per peer."""
_HEADER = struct.Struct("i")
"""pysyncobj's frame header: the body's length as a native signed 32-bit integer."""
_SOCKET_ATTR = "_TcpConnection__socket"
_PIPE_NOTIFIER_ATTR = "_SyncObj__pipeNotifier"
_THREAD_ATTR = "_SyncObj__thread"


def is_leader(sync: SyncObj) -> bool:
    return bool(sync._isLeader())


def leader_address(sync: SyncObj) -> str | None:
    leader = sync._getLeader()
    return None if leader is None else str(leader.address)


def role_name(state: int) -> str:
    """`getStatus()["state"]` as follower, candidate or leader ("unknown" for anything else)."""
    return ROLE_NAMES.get(state, "unknown")


def pipe_notifier(sync: SyncObj) -> Any:
    """What wakes the tick thread's poll at once (None before pysyncobj made one)."""
    return getattr(sync, _PIPE_NOTIFIER_ATTR, None)


def tick_thread(sync: SyncObj) -> threading.Thread | None:
    """pysyncobj's auto-tick thread, to join after `destroy()` so the journal is flushed."""
    return getattr(sync, _THREAD_ATTR, None)


class PreAuthGuard:
    """Stands in for a connection's socket until the peer authenticates: `recv` hands pysyncobj
    at most one frame, refuses an announced length over the cap, and then reads nothing more
    until `release` (the frame was a handshake step) or until the raw socket is put back."""

    def __init__(self, raw: Any, on_refused: Callable[[str], None]) -> None:
        self.raw = raw
        self._on_refused = on_refused
        self._header = b""
        self._left = 0
        self._held = False

    def recv(self, size: int) -> bytes:
        if self._held:
            raise BlockingIOError(errno.EAGAIN, "waiting for the previous frame to be handled")
        if self._left:
            data: bytes = self.raw.recv(min(size, self._left))
            self._left -= len(data)
            self._held = self._left == 0
            return data
        data = self.raw.recv(_HEADER.size - len(self._header))
        self._header += data
        if len(self._header) == _HEADER.size:
            self._start_frame(_HEADER.unpack(self._header)[0])
        return data

    def _start_frame(self, length: int) -> None:
        self._header = b""
        if not 0 < length <= PREAUTH_FRAME_MAX:
            reason = f"announced a {length}-byte frame before authenticating"
            self._on_refused(reason)
            raise ConnectionResetError(errno.ECONNRESET, reason)
        self._left = length

    def release(self) -> None:
        """The frame handed over was a handshake step, handled: let the next one in."""
        self._held = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


class GuardedTransport(TCPTransport):
    """pysyncobj's TCP transport with every connection guarded until its peer authenticates.
    Pass it as `SyncObj(..., transportClass=GuardedTransport)`; it needs a `password`, as
    authentication is what lifts the guard."""

    def __init__(self, syncObj: SyncObj, selfNode: Any, otherNodes: Any) -> None:
        if syncObj.encryptor is None:
            raise ValueError("GuardedTransport needs SyncObjConf(password=...)")
        self._guards: dict[TcpConnection, PreAuthGuard] = {}
        self.refused = 0
        super().__init__(syncObj, selfNode, otherNodes)

    def _guard(self, conn: TcpConnection) -> None:
        self._guards[conn] = PreAuthGuard(getattr(conn, _SOCKET_ATTR), self._refused)
        setattr(conn, _SOCKET_ATTR, self._guards[conn])

    def _trust(self, conn: TcpConnection) -> None:
        guard = self._guards.pop(conn, None)
        if guard is not None and conn.fileno() is not None:
            setattr(conn, _SOCKET_ATTR, guard.raw)

    def _refused(self, reason: str) -> None:
        """Counted always, logged at 1, 2, 4, 8, ... so a flood cannot fill the log."""
        self.refused += 1
        if self.refused & (self.refused - 1) == 0:
            log.warning(
                "raft: closed an unauthenticated connection that %s (%d so far)",
                reason,
                self.refused,
            )

    def _onNewIncomingConnection(self, conn: TcpConnection) -> None:
        strangers = [c for c in self._guards if c in self._unknownConnections]
        if len(strangers) >= PREAUTH_CONNECTIONS_MAX:
            strangers[0].disconnect()
        self._guard(conn)
        super()._onNewIncomingConnection(conn)

    def _onIncomingMessageReceived(self, conn: TcpConnection, message: Any) -> None:
        # pysyncobj checks a message against the connection's random key only once it sent one:
        # a message that arrives after that came from a peer that holds the secret.
        keyed = conn.recvRandKey is not None
        super()._onIncomingMessageReceived(conn, message)
        if keyed:
            self._trust(conn)
        elif conn in self._guards:
            self._guards[conn].release()

    def _onOutgoingConnected(self, conn: TcpConnection) -> None:
        self._guard(conn)
        super()._onOutgoingConnected(conn)

    def _onOutgoingMessageReceived(self, conn: TcpConnection, message: Any) -> None:
        # The first answer on a connection we opened carries the random key we sent on it.
        super()._onOutgoingMessageReceived(conn, message)
        self._trust(conn)

    def _onDisconnected(self, conn: TcpConnection) -> None:
        self._guards.pop(conn, None)
        super()._onDisconnected(conn)
