"""Which process opened a TCP connection, from the kernel's own tables (Linux /proc).

A proxy in front of one replica's Raft port carries the links of several peers, all from
127.0.0.1 on ephemeral ports, and (with the cluster secret) encrypted from the first byte, so
neither the address nor the bytes say who connected. The kernel does: /proc/net/tcp maps the
connecting socket (local = the client's end, remote = the proxy) to an inode, and a process owns
that socket if one of its /proc/PID/fd links names the inode.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path

Endpoint = tuple[str, int]
ConnectionFilter = Callable[[Endpoint, Endpoint], bool]
"""(client end, server end) of a connection -> whether it is one of those we look for."""


def _endpoint(field: str) -> Endpoint:
    """'0100007F:1F90' (IPv4 in host byte order, port in hex) -> ('127.0.0.1', 8080)."""
    address, port = field.split(":")
    if len(address) != 8:
        raise ValueError(f"not an IPv4 socket address: {field!r}")
    packed = struct.pack("=I", int(address, 16))
    return socket.inet_ntoa(packed), int(port, 16)


def parse_tcp_table(text: str) -> dict[tuple[Endpoint, Endpoint], int]:
    """The body of /proc/net/tcp -> {(local, remote): inode}; sockets without an inode (in
    TIME_WAIT, say) are left out, as no process holds them."""
    table: dict[tuple[Endpoint, Endpoint], int] = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        inode = int(fields[9])
        if inode:
            table[(_endpoint(fields[1]), _endpoint(fields[2]))] = inode
    return table


def socket_inode(local: Endpoint, remote: Endpoint, proc: Path = Path("/proc")) -> int | None:
    """The inode of this machine's TCP socket from `local` to `remote`, if it exists."""
    try:
        text = (proc / "net" / "tcp").read_text()
    except OSError:
        return None
    return parse_tcp_table(text).get((local, remote))


def holds_socket(pid: int, inode: int, proc: Path = Path("/proc")) -> bool:
    """Whether process `pid` has socket `inode` among its open files."""
    wanted = f"socket:[{inode}]"
    fd_dir = proc / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(fd_dir / name) == wanted:
                return True
        except OSError:
            continue
    return False


def opened_by(pid: int) -> ConnectionFilter:
    """A filter matching the connections process `pid` opened (its end is the client end)."""

    def match(client: Endpoint, server: Endpoint) -> bool:
        inode = socket_inode(client, server)
        return inode is not None and holds_socket(pid, inode)

    return match


def tcp_table(proc: Path = Path("/proc")) -> dict[tuple[Endpoint, Endpoint], int]:
    try:
        return parse_tcp_table((proc / "net" / "tcp").read_text())
    except OSError:
        return {}


def listening_inode(endpoint: Endpoint, table: dict[tuple[Endpoint, Endpoint], int]) -> int | None:
    """The inode of the socket listening on `endpoint` (bound to it or to every address)."""
    unbound = ("0.0.0.0", 0)
    for local in (endpoint, ("0.0.0.0", endpoint[1])):
        inode = table.get((local, unbound))
        if inode is not None:
            return inode
    return None


def link_of(pid: int, client: Endpoint, server: Endpoint, target: Endpoint) -> bool:
    """Whether a relayed connection is one of process `pid`'s links: `pid` dialled it (holds
    the client end of client -> server) or listens on the `target` it is relayed to. The
    sockets are looked up in `pid`'s own network namespace (/proc/PID/net/tcp), so a process
    on a host of its own (`shoal chaos run --hosts`) is found as well as one on this one."""
    proc = Path("/proc")
    table = tcp_table(proc / str(pid))
    for inode in (table.get((client, server)), listening_inode(target, table)):
        if inode is not None and holds_socket(pid, inode, proc):
            return True
    return False
