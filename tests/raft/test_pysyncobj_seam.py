"""raft/pysyncobj_seam.py: the pysyncobj internals it relies on are still where it looks (an
upgrade that moves one fails here, by name), and its pre-authentication guard, as a parser of
a stranger's bytes, never lets more than one bounded frame through."""

from __future__ import annotations

import errno
import inspect
import itertools
import re
import socket
import struct
import threading
import tomllib
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.requirements import Requirement
from pysyncobj import SyncObj, SyncObjConf
from pysyncobj.poller import createPoller
from pysyncobj.tcp_connection import TcpConnection
from pysyncobj.transport import TCPTransport

from shoal.ports import free_port
from shoal.raft import pysyncobj_seam as seam

from .inprocess import SECRET

pytestmark = pytest.mark.timeout(60)

OVERRIDDEN = {
    "_onNewIncomingConnection": ["conn"],
    "_onIncomingMessageReceived": ["conn", "message"],
    "_onOutgoingConnected": ["conn"],
    "_onOutgoingMessageReceived": ["conn", "message"],
    "_onDisconnected": ["conn"],
}


def test_the_installed_pysyncobj_is_in_the_pinned_range() -> None:
    with open(Path(__file__).parents[2] / "pyproject.toml", "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    pin = next(Requirement(d) for d in dependencies if d.startswith("pysyncobj"))
    assert pin.specifier
    assert version("pysyncobj") in pin.specifier


@pytest.mark.parametrize("name", sorted(OVERRIDDEN))
def test_the_transport_hooks_the_guard_overrides_still_exist(name: str) -> None:
    hook = getattr(TCPTransport, name, None)
    assert hook is not None, f"pysyncobj's TCPTransport no longer has {name}"
    assert list(inspect.signature(hook).parameters)[1:] == OVERRIDDEN[name]


def test_a_connection_keeps_its_socket_and_random_keys_where_the_guard_looks() -> None:
    left, right = socket.socketpair()
    try:
        conn = TcpConnection(createPoller("auto"), socket=left)
        assert getattr(conn, seam._SOCKET_ATTR) is left
        assert conn.recvRandKey is None
        assert conn.sendRandKey is None
    finally:
        left.close()
        right.close()


def test_a_frame_is_a_native_int_length_then_that_many_bytes() -> None:
    left, right = socket.socketpair()
    try:
        TcpConnection(createPoller("auto"), socket=left).send("a message")
        data = right.recv(65536)
        assert struct.unpack("i", data[:4])[0] == len(data) - 4
    finally:
        left.close()
        right.close()


@pytest.fixture
def lone_syncobj() -> Iterator[SyncObj]:
    address = f"127.0.0.1:{free_port()}"
    conf = SyncObjConf(
        password=SECRET, bindAddress=address, autoTickPeriod=0.02, appendEntriesUseBatch=False
    )
    sync = SyncObj(address, [], conf, transportClass=seam.GuardedTransport)
    try:
        yield sync
    finally:
        sync.destroy()


def test_the_syncobj_internals_the_bridge_reads_are_there(lone_syncobj: SyncObj) -> None:
    assert isinstance(seam.tick_thread(lone_syncobj), threading.Thread)
    assert callable(seam.pipe_notifier(lone_syncobj).notify)
    assert {seam.RAFT_STATE.FOLLOWER, seam.RAFT_STATE.CANDIDATE, seam.RAFT_STATE.LEADER}
    lone_syncobj.waitReady()
    seam.is_leader(lone_syncobj)
    assert seam.leader_address(lone_syncobj) in (None, lone_syncobj.selfNode.address)


SYNCOBJ_PUBLIC = (
    "otherNodes",
    "selfNode",
    "hasQuorum",
    "raftLastApplied",
    "encryptor",
    "isNodeConnected",
    "getStatus",
    "addOnTickCallback",
    "waitReady",
    "destroy",
)
"""The public SyncObj members raft/bridge.py, coordinator.py and the seam read."""
STATUS_KEYS = ("state", "raft_term", "commit_idx", "last_applied", "has_quorum", "log_len")
"""The `getStatus()` keys raft/bridge.py reports (/v1/cluster, /metrics)."""
PACKAGE_ROOTS = ("raft", "chaos", "shoal", "bench", "learner", "runtime", "scheduler", "envs")
PRIVATE_REACH = re.compile(
    r"_SyncObj__|_TcpConnection__|_RAFT_STATE|\._isLeader\b|\._getLeader\b"
    r"|_unknownConnections|from pysyncobj\.\w+ import"
)
"""A private pysyncobj name, or an import from one of its submodules (its package root exports
the public API): only raft/pysyncobj_seam.py may hold one."""


def test_the_syncobj_members_and_status_keys_the_bridge_reads_are_there(
    lone_syncobj: SyncObj,
) -> None:
    missing = [name for name in SYNCOBJ_PUBLIC if not hasattr(lone_syncobj, name)]
    assert not missing, f"pysyncobj's SyncObj no longer has {missing}"
    status = lone_syncobj.getStatus()
    absent = [key for key in STATUS_KEYS if key not in status]
    assert not absent, f"pysyncobj's getStatus() no longer reports {absent}"
    assert seam.role_name(status["state"]) in ("follower", "candidate", "leader")
    assert {seam.role_name(s) for s in seam.ROLE_NAMES} == {"follower", "candidate", "leader"}


def test_the_transport_keeps_its_unauthenticated_connections_where_the_guard_looks(
    lone_syncobj: SyncObj,
) -> None:
    transport = lone_syncobj._SyncObj__transport
    assert isinstance(transport, seam.GuardedTransport)
    assert isinstance(getattr(transport, "_unknownConnections", None), set), (
        "pysyncobj's TCPTransport no longer keeps _unknownConnections (the guard's eviction)"
    )


def test_no_module_but_the_seam_reaches_into_pysyncobj() -> None:
    root = Path(__file__).parents[2]
    seam_path = Path(inspect.getfile(seam)).resolve()
    offenders = [
        f"{path.relative_to(root)}:{number}: {line.strip()}"
        for top in PACKAGE_ROOTS
        for path in sorted((root / top).rglob("*.py"))
        if path.resolve() != seam_path
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE_REACH.search(line)
    ]
    assert not offenders, "pysyncobj internals outside raft/pysyncobj_seam.py:\n" + "\n".join(
        offenders
    )


def test_the_guarded_transport_refuses_to_run_without_a_password() -> None:
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match="password"):
        SyncObj(address, [], SyncObjConf(bindAddress=address), transportClass=seam.GuardedTransport)


class ScriptedSocket:
    """A raw socket whose peer sent `chunks`, one recv each at most, then nothing yet."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.pending = b"".join(chunks)
        self.sizes = [len(c) for c in chunks]

    def recv(self, size: int) -> bytes:
        if not self.pending:
            raise BlockingIOError(errno.EAGAIN, "no data")
        take = min(size, self.sizes[0] if self.sizes else size)
        data, self.pending = self.pending[:take], self.pending[take:]
        if self.sizes:
            self.sizes[0] -= len(data)
            if not self.sizes[0]:
                self.sizes.pop(0)
        return data


def drain(guard: seam.PreAuthGuard, size: int) -> tuple[bytes, BaseException]:
    """What pysyncobj's read loop gets from the guard before it stops, and why it stopped."""
    got = b""
    while True:
        try:
            got += guard.recv(size)
        except OSError as exc:
            return got, exc


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


@settings(max_examples=300, deadline=None)
@given(
    length=st.one_of(
        st.integers(-(2**31), 2**31 - 1),
        st.integers(0, seam.PREAUTH_FRAME_MAX + 2),
        st.sampled_from([2**31 - 1, -1, 0, 1, seam.PREAUTH_FRAME_MAX, seam.PREAUTH_FRAME_MAX + 1]),
    ),
    tail=st.binary(max_size=3 * seam.PREAUTH_FRAME_MAX),
    cuts=st.lists(st.integers(0, 4 * seam.PREAUTH_FRAME_MAX), max_size=12),
    size=st.sampled_from([1, 7, 4096, 65536]),
)
def test_the_guard_passes_one_bounded_frame_at_most(
    length: int, tail: bytes, cuts: list[int], size: int
) -> None:
    stream = struct.pack("i", length) + tail
    refused: list[str] = []
    guard = seam.PreAuthGuard(ScriptedSocket(chunked(stream, cuts)), refused.append)
    got, stopped = drain(guard, size)
    assert stream.startswith(got)
    assert len(got) <= 4 + seam.PREAUTH_FRAME_MAX
    if not 0 < length <= seam.PREAUTH_FRAME_MAX:
        assert isinstance(stopped, ConnectionResetError)
        assert len(refused) == 1
        assert len(got) < 4
    else:
        assert isinstance(stopped, BlockingIOError)
        assert stopped.errno == errno.EAGAIN
        assert got == stream[: 4 + min(length, len(tail))]
        assert not refused


def test_the_guard_reads_the_next_frame_only_after_release() -> None:
    frames = [struct.pack("i", 3) + b"abc", struct.pack("i", 2) + b"de"]
    guard = seam.PreAuthGuard(ScriptedSocket([b"".join(frames)]), lambda reason: None)
    assert drain(guard, 65536)[0] == frames[0]
    assert drain(guard, 65536)[0] == b""
    guard.release()
    assert drain(guard, 65536)[0] == frames[1]


def test_the_guard_hands_every_other_call_to_the_socket() -> None:
    left, right = socket.socketpair()
    try:
        guard: Any = seam.PreAuthGuard(left, lambda reason: None)
        assert guard.fileno() == left.fileno()
        guard.send(b"x")
        assert right.recv(1) == b"x"
    finally:
        left.close()
        right.close()
