"""Who opened a connection, read from the kernel's tables: the parser as a property, the lookup
on real sockets of this process and of a child, and a proxy refusing one client among several."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.chaos.proxy import FaultProxy
from shoal.chaos.sockets import Endpoint, opened_by, parse_tcp_table
from shoal.chaos.traffic import NetFaults

pytestmark = pytest.mark.timeout(60)

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"

endpoints = st.tuples(st.ip_addresses(v=4).map(str), st.integers(0, 65535))


def _field(end: Endpoint) -> str:
    """As the kernel writes it: the IPv4 address as a host-order word in hex, then the port."""
    word = struct.unpack("=I", socket.inet_aton(end[0]))[0]
    return f"{word:08X}:{end[1]:04X}"


@given(st.lists(st.tuples(endpoints, endpoints, st.integers(0, 2**31)), max_size=20))
def test_the_table_parses_back_to_the_sockets_written(
    rows: list[tuple[Endpoint, Endpoint, int]],
) -> None:
    lines = [HEADER] + [
        f"{i:4}: {_field(a)} {_field(b)} 01 00000000:00000000 00:00000000 00000000  0  0 {inode} 1 0"
        for i, (a, b, inode) in enumerate(rows)
    ]
    expected = {}
    for a, b, inode in rows:
        if inode:  # a row without an inode (TIME_WAIT) is left out, hiding nothing
            expected[(a, b)] = inode
    assert parse_tcp_table("\n".join(lines)) == expected


def test_a_connection_is_recognised_as_opened_by_its_process() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        mine = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.DEVNULL
        )
        try:
            client, listen = mine.getsockname(), server.getsockname()
            assert opened_by(os.getpid())(client, listen)
            assert not opened_by(child.pid)(client, listen)
            assert not opened_by(os.getpid())(("127.0.0.1", 1), listen)  # no such socket
        finally:
            child.kill()
            child.wait()
            mine.close()
            accepted.close()


async def _cut(reader: asyncio.StreamReader) -> bool:
    """True if the connection ends (EOF or reset) instead of delivering bytes."""
    try:
        return await asyncio.wait_for(reader.read(4), 5) == b""
    except ConnectionResetError:
        return True


async def _roundtrip(port: int) -> bytes:
    """The echo of b"ping" through the proxy, or b"" if the connection was cut."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"ping")
        await writer.drain()
        return b"" if await _cut(reader) else b"ping"
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


def test_a_proxy_refuses_and_cuts_only_the_clients_the_filter_names() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(1024):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        proxy = await FaultProxy(("127.0.0.1", server.sockets[0].getsockname()[1])).start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(b"open")
            await writer.drain()
            assert await reader.readexactly(4) == b"open"
            marked = writer.get_extra_info("sockname")[:2]

            assert proxy.refuse_from(lambda client, server: client == marked) == 1
            assert await _cut(reader)  # the marked connection was cut
            assert await _roundtrip(proxy.port) == b"ping"  # everyone else still passes

            proxy.refuse_from(lambda client, server: True)
            assert await _roundtrip(proxy.port) == b""  # a new connection from it is refused
            assert proxy.stats.refused >= 1
            assert proxy.refuse_from(None) == 0
            assert await _roundtrip(proxy.port) == b"ping"

            proxy.set_faults(NetFaults(partition="refuse"))
            assert await _roundtrip(proxy.port) == b""
            writer.close()
        finally:
            await proxy.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())
