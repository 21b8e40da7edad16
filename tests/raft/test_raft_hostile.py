"""A stranger on the Raft network, against three real coordinator processes: it can reach the
Raft port only at the address it was given, a pickled payload runs nothing, a 2 GiB length
prefix or a flood of idle connections is cut off with the replica's memory bounded, and each
attacked replica still answers, takes a write and sees it committed."""

from __future__ import annotations

import asyncio
import os
import pickle
import shlex
import socket
import struct
import zlib
from functools import partial
from pathlib import Path

import pytest

from shoal.chaos.sockets import Endpoint, holds_socket, tcp_table
from shoal.local import LocalCluster
from shoal.raft.client import CoordinatorClient
from shoal.raft.config import parse_address
from shoal.raft.pysyncobj_seam import PREAUTH_CONNECTIONS_MAX
from tests.support.waiting import eventually

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

RSS_HEADROOM = 32 << 20
"""How much a replica's resident memory may grow while a stranger streams 256 MiB at it; without
the guard pysyncobj buffers all of it."""


@pytest.fixture
def follower(cluster: LocalCluster) -> str:
    """The name of a replica that is not the leader (what the issue's attack hit)."""
    leader_url = cluster.wait_ready()
    return next(s.name for s in cluster.specs() if s.api_url != leader_url)


def raft_endpoint(cluster: LocalCluster, name: str) -> tuple[str, int]:
    raft = cluster.spec(name).raft
    assert raft is not None
    return parse_address("--raft", raft)


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def wait_closed(sock: socket.socket) -> None:
    """Block until the replica closes its end (EOF or reset): it has handled what we sent."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass


def stream_until_cut_off(sock: socket.socket, limit: int) -> int:
    """Send junk until the replica resets the connection; how much the kernel took by then."""
    chunk, sent = os.urandom(1 << 20), 0
    try:
        while sent < limit:
            sock.sendall(chunk)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        return sent
    raise AssertionError(f"the replica took {sent} bytes of an unauthenticated frame")


def still_serving(cluster: LocalCluster, name: str, message: str) -> None:
    """`name` is alive, takes a write through its API and has applied it itself."""
    spec = cluster.spec(name)
    assert cluster.pid(name) is not None, cluster.tail(name)
    assert spec.api_url is not None

    async def write_and_read() -> list[str]:
        async with CoordinatorClient([spec.api_url], cluster.token) as client:
            await client.add_event("hostile", message, op_id=f"op-{message}")
            await client.cluster(consistent=True)
            seen, since = [], 0
            while page := (await client.events(since=since))["events"]:
                seen += [e["message"] for e in page]
                since = page[-1]["seq"]
            return seen

    assert message in asyncio.run(write_and_read())


def test_raft_listens_only_on_the_address_it_was_given(cluster: LocalCluster) -> None:
    for spec in cluster.specs():
        host, port = raft_endpoint(cluster, spec.name)
        pid = cluster.pid(spec.name)
        assert pid is not None
        listening = {
            local
            for (local, remote), inode in tcp_table().items()
            if remote == ("0.0.0.0", 0) and local[1] == port and holds_socket(pid, inode)
        }
        assert listening == {(host, port)}
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port)).close()
        assert f"raft {host}:{port} (bound to {host}:{port})" in cluster.tail(spec.name, 200)


def test_a_pickled_payload_runs_nothing(
    cluster: LocalCluster, follower: str, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return os.system, (f"touch {shlex.quote(str(marker))}",)

    body = zlib.compress(pickle.dumps(Exploit()), 3)
    with socket.create_connection(raft_endpoint(cluster, follower)) as sock:
        sock.sendall(struct.pack("i", len(body)) + body)
        wait_closed(sock)
    assert not marker.exists()
    still_serving(cluster, follower, "after-pickle")


@pytest.mark.parametrize("length", [2**31 - 1, 1 << 20, -1])
def test_a_huge_length_prefix_is_cut_off_and_memory_stays_bounded(
    cluster: LocalCluster, follower: str, length: int
) -> None:
    pid = cluster.pid(follower)
    assert pid is not None
    before = rss(pid)
    with socket.create_connection(raft_endpoint(cluster, follower)) as sock:
        sock.sendall(struct.pack("i", length))
        sent = stream_until_cut_off(sock, 256 << 20)
    assert sent < 64 << 20, "the replica kept reading an unauthenticated frame"
    assert rss(pid) - before < RSS_HEADROOM
    still_serving(cluster, follower, f"after-prefix-{length}")


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_a_flood_of_strangers_keeps_only_the_newest_few(
    cluster: LocalCluster, follower: str
) -> None:
    pid = cluster.pid(follower)
    assert pid is not None

    def held_by_replica(socks: list[socket.socket]) -> set[Endpoint]:
        ours = {sock.getsockname() for sock in socks}
        return {
            remote
            for (_, remote), inode in tcp_table().items()
            if remote in ours and holds_socket(pid, inode)
        }

    def settled(sock: socket.socket) -> bool:
        return bool(held_by_replica([sock])) or closed_by_peer(sock)

    socks: list[socket.socket] = []
    try:
        for _ in range(2 * PREAUTH_CONNECTIONS_MAX):
            socks.append(socket.create_connection(raft_endpoint(cluster, follower)))
            socks[-1].sendall(b"\x10\x00")  # half a frame header, then silence
            eventually(partial(settled, socks[-1]), "the replica accepted the connection")
        newest = {sock.getsockname() for sock in socks[-PREAUTH_CONNECTIONS_MAX:]}
        assert held_by_replica(socks) == newest
        assert all(closed_by_peer(sock) for sock in socks[:-PREAUTH_CONNECTIONS_MAX])
        still_serving(cluster, follower, "after-flood")
    finally:
        for sock in socks:
            sock.close()
