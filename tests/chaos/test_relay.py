"""The link relay's request parsing as properties, and its answers to bad requests, unreachable
destinations and the two good forms on real sockets; a bad client never stops the relay."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.chaos.errors import ProxyError
from shoal.chaos.relay import LinkRelay
from shoal.chaos.relay_http import RelayRequestError, parse_request
from shoal.chaos.traffic import NetFaults

pytestmark = pytest.mark.timeout(60)

ports = st.integers(1, 65535)
header_names = st.sampled_from(["X-A", "Upgrade", "Connection", "Sec-WebSocket-Key", "Accept"])
headers = st.lists(st.tuples(header_names, st.text("abcXYZ019-=", max_size=12)), max_size=5)


@given(ports, st.sampled_from(["127.0.0.1", "localhost", "127.3.2.1"]))
def test_a_connect_names_its_loopback_target(port: int, host: str) -> None:
    request = parse_request(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert request.forward is None
    assert request.target == ("127.0.0.1" if host == "localhost" else host, port)


@given(ports, st.sampled_from(["ws", "http"]), st.text("abc/-_", max_size=10), headers)
def test_an_absolute_request_is_rewritten_to_origin_form(
    port: int, scheme: str, path: str, extra: list[tuple[str, str]]
) -> None:
    lines = [f"{name}: {value}" for name, value in extra]
    head = "\r\n".join(
        [f"GET {scheme}://127.0.0.1:{port}/{path} HTTP/1.1", *lines, "Proxy-Connection: keep-alive"]
    )
    request = parse_request((head + "\r\n\r\n").encode())
    assert request.target == ("127.0.0.1", port)
    expected = "\r\n".join([f"GET /{path} HTTP/1.1", *lines]) + "\r\n\r\n"
    assert request.forward == expected.encode()


@given(st.binary(max_size=200))
def test_any_bytes_parse_or_get_an_http_error_status(head: bytes) -> None:
    with contextlib.suppress(RelayRequestError):
        request = parse_request(head)
        assert request.target[0].startswith("127.")


@pytest.mark.parametrize(
    ("head", "status", "says"),
    [
        (b"CONNECT 10.0.0.1:80 HTTP/1.1", 403, "127.0.0.1"),
        (b"CONNECT example.com:80 HTTP/1.1", 403, "this host only"),
        (b"CONNECT 127.0.0.1 HTTP/1.1", 400, "HOST:PORT"),
        (b"CONNECT 127.0.0.1:0 HTTP/1.1", 400, "1..65535"),
        (b"GET /shoal HTTP/1.1", 400, "CONNECT HOST:PORT"),
        (b"GET https://127.0.0.1:1/ HTTP/1.1", 400, "ws://"),
        (b"hello", 400, "HTTP/1.x request line"),
        (b"\xff\xfe HTTP/1.1", 400, "not ASCII"),
    ],
)
def test_bad_requests_name_what_is_wrong(head: bytes, status: int, says: str) -> None:
    with pytest.raises(RelayRequestError, match=says) as caught:
        parse_request(head + b"\r\n\r\n")
    assert caught.value.status == status


async def _exchange(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        writer.write_eof()
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 15)
    finally:
        writer.close()


async def _echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_bad_requests_and_dead_targets_get_http_errors_and_the_relay_goes_on() -> None:
    async def main() -> None:
        async with LinkRelay() as relay:
            reply = await _exchange(relay.port, b"nonsense\r\n\r\n")
            assert reply.startswith(b"HTTP/1.1 400 Bad Request\r\n")
            assert b"not an HTTP/1.x request line" in reply
            reply = await _exchange(relay.port, b"CONNECT 192.168.1.1:80 HTTP/1.1\r\n\r\n")
            assert reply.startswith(b"HTTP/1.1 403 ")
            dead = _free_port()
            reply = await _exchange(
                relay.port, f"CONNECT 127.0.0.1:{dead} HTTP/1.1\r\n\r\n".encode()
            )
            assert reply.startswith(b"HTTP/1.1 502 Bad Gateway\r\n")
            assert f"cannot reach 127.0.0.1:{dead}".encode() in reply
            reply = await _exchange(relay.port, b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 20000)
            assert reply.startswith(b"HTTP/1.1 431 ")
            # A client that hangs up mid-head costs nothing either.
            _, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            writer.write(b"CONNECT 127.0")
            writer.close()
            assert relay.stats.bad_requests == 3
            assert relay.stats.upstream_failures == 1
            server = await _echo_server()
            try:
                port = server.sockets[0].getsockname()[1]
                reply = await _exchange(
                    relay.port, f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\nping".encode()
                )
                assert reply == b"HTTP/1.1 200 Connection established\r\n\r\nping"
                reply = await _exchange(
                    relay.port,
                    f"GET http://127.0.0.1:{port}/x HTTP/1.1\r\nProxy-Connection: close\r\n\r\n".encode(),
                )
                assert reply == b"GET /x HTTP/1.1\r\n\r\n"
            finally:
                server.close()
                await server.wait_closed()
            assert relay.stats.relayed == 2

    asyncio.run(main())


def test_a_partition_on_every_link_refuses_new_ones_until_healed() -> None:
    async def main() -> None:
        server = await _echo_server()
        port = server.sockets[0].getsockname()[1]
        connect = f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\nping".encode()
        try:
            async with LinkRelay() as relay:
                relay.inject("cut", NetFaults(partition="refuse"))
                with pytest.raises(ConnectionResetError):
                    await _exchange(relay.port, connect)
                assert relay.stats.refused == 1
                assert relay.heal("cut") == 1
                assert (await _exchange(relay.port, connect)).endswith(b"ping")
                with pytest.raises(ProxyError, match="no link fault named 'cut'"):
                    relay.heal("cut")
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())


addresses = st.tuples(*[st.integers(0, 255)] * 4).map(lambda t: ".".join(map(str, t)))


@given(addresses, ports)
def test_a_relay_for_hosts_forwards_to_their_network_and_loopback_only(
    address: str, port: int
) -> None:
    """The hosts of `shoal chaos run --hosts` are on one /24; nothing off it is reachable."""
    network = ipaddress.IPv4Network("10.7.3.0/24")
    head = f"CONNECT {address}:{port} HTTP/1.1\r\n\r\n".encode()
    if ipaddress.IPv4Address(address) in network or address.startswith("127."):
        assert parse_request(head, [network]).target == (address, port)
    else:
        with pytest.raises(RelayRequestError, match=r"or on 10\.7\.3\.0/24") as caught:
            parse_request(head, [network])
        assert caught.value.status == 403
    with pytest.raises(RelayRequestError, match=r"is not 127\.0\.0\.1: the relay forwards"):
        parse_request(b"CONNECT 10.7.3.2:80 HTTP/1.1\r\n\r\n")


async def _ping(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(b"ping")
    await writer.drain()
    return await reader.readexactly(4)


async def _tunnel(relay: LinkRelay, host: str, port: int) -> tuple[Any, Any]:
    reader, writer = await asyncio.open_connection(relay.listen_host, relay.port)
    writer.write(f"CONNECT {host}:{port} HTTP/1.1\r\n\r\n".encode())
    await writer.drain()
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
    return reader, writer


def test_a_fault_on_a_host_address_hits_its_links_only_until_healed() -> None:
    """A cut host: every link with an end at its address is blackholed (those open and those
    dialled later), the others flow; healed, the held bytes arrive."""

    async def main() -> None:
        servers = [await _echo_server_on(host) for host in ("127.0.0.1", "127.0.0.2")]
        ports = [s.sockets[0].getsockname()[1] for s in servers]
        try:
            async with LinkRelay(listen_host="127.0.0.3") as relay:
                assert relay.address == f"127.0.0.3:{relay.port}"
                near = await _tunnel(relay, "127.0.0.1", ports[0])
                far = await _tunnel(relay, "127.0.0.2", ports[1])
                hole = NetFaults(partition="blackhole")
                assert relay.inject("cut", hole, addresses=["127.0.0.2"]) == 1
                held = asyncio.ensure_future(_ping(*far))
                assert await _ping(*near) == b"ping"
                later = asyncio.ensure_future(_tunnel(relay, "127.0.0.2", ports[1]))
                done, _ = await asyncio.wait([held, later], timeout=1.0)
                assert not done
                assert relay.heal("cut") == 2  # far, open at injection, and later, dialled since
                assert await held == b"ping"
                assert await _ping(*await later) == b"ping"
                for _, writer in (near, far, await later):
                    writer.close()
        finally:
            for server in servers:
                server.close()
                await server.wait_closed()

    asyncio.run(main())


async def _echo_server_on(host: str) -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, host, 0)
