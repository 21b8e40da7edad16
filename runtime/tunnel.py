"""Outbound links through a link relay: an HTTP proxy every link dial of a process goes through
when `TransportConfig.relay` (or `$SHOAL_LINK_RELAY`) names one, so a chaos run can put faults
on the real TCP path between two processes whatever ports they listen on.

The websocket goes through aiohttp's own proxy support (`relay_url`); the frame stream, which is
raw TCP, through an HTTP `CONNECT` tunnel opened here (`open_tunnel`). The reply is read one byte
at a time so not a byte of the tunnelled stream is swallowed with it.
"""

from __future__ import annotations

import asyncio
import socket

from shoal.errors import ConfigError
from shoal.runtime.errors import LinkClosed

RELAY_ENV = "SHOAL_LINK_RELAY"
# A relay's reply head larger than this is not a proxy talking.
MAX_REPLY_BYTES = 8192


class RelayRefused(LinkClosed):
    """The link relay did not open the tunnel: it refused, failed or is not an HTTP proxy."""


def parse_relay(value: str) -> tuple[str, int]:
    """'HOST:PORT' -> (host, port); anything else is a ConfigError saying what to write."""
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ConfigError(
            f"relay={value!r} (or ${RELAY_ENV}) is invalid: write HOST:PORT of a link relay, "
            "e.g. 127.0.0.1:7400, or leave it unset to dial peers directly"
        )
    return host, int(port)


def relay_url(value: str) -> str:
    """The proxy URL aiohttp takes for the websocket half of a link."""
    host, port = parse_relay(value)
    return f"http://{host}:{port}"


def reply_status(head: bytes, relay: str) -> int:
    """The status code of a relay's reply head ('HTTP/1.1 200 ...'); RelayRefused if the
    bytes are not an HTTP reply."""
    line = head.split(b"\r\n", 1)[0]
    parts = line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise RelayRefused(
            f"the link relay {relay} answered {line[:80]!r}, not an HTTP reply; "
            f"is ${RELAY_ENV} pointing at a link relay?"
        )
    return int(parts[1])


async def _read_head(loop: asyncio.AbstractEventLoop, sock: socket.socket, relay: str) -> bytes:
    head = bytearray()
    while not head.endswith(b"\r\n\r\n"):
        byte = await loop.sock_recv(sock, 1)
        if not byte:
            raise RelayRefused(
                f"the link relay {relay} closed the connection before answering the CONNECT"
            )
        head += byte
        if len(head) > MAX_REPLY_BYTES:
            raise RelayRefused(
                f"the link relay {relay} sent over {MAX_REPLY_BYTES} bytes without ending its "
                "reply; is it a link relay?"
            )
    return bytes(head)


async def open_tunnel(relay: str, host: str, port: int, timeout: float) -> socket.socket:
    """A connected socket that reaches host:port through the relay's CONNECT tunnel. Raises
    OSError when the relay is unreachable, RelayRefused when it will not open the tunnel,
    TimeoutError after `timeout` seconds."""
    relay_host, relay_port = parse_relay(relay)
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(relay_host, relay_port, type=socket.SOCK_STREAM)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, address)
            target = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
            request = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n"
            await loop.sock_sendall(sock, request.encode("ascii"))
            head = await _read_head(loop, sock, relay)
        status = reply_status(head, relay)
        if status != 200:
            reason = head.split(b"\r\n", 1)[0].decode("latin-1")
            raise RelayRefused(f"the link relay {relay} would not reach {target}: {reason}")
    except BaseException:
        sock.close()
        raise
    return sock
