"""The two request forms the link relay understands, parsed without sockets (pure).

A link's frame stream asks for a tunnel (`CONNECT 127.0.0.1:PORT HTTP/1.1`); its websocket,
dialled through aiohttp's `proxy=`, arrives as an absolute-form request
(`GET ws://127.0.0.1:PORT/shoal HTTP/1.1` plus the upgrade headers), which the relay rewrites
to origin form before forwarding, after which both are plain byte streams to splice.

The relay forwards to this host's loopback only, unless it is given the networks it may also
reach (the hosts' bridge network of `shoal chaos run --hosts`): anything else is refused, so
the relay never opens a path off the cluster.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from shoal.chaos.errors import ChaosError
from shoal.chaos.sockets import Endpoint

# Headers meant for the proxy, not the origin server.
HOP_HEADERS = (b"proxy-connection", b"proxy-authorization")
Networks = Sequence[ipaddress.IPv4Network]


class RelayRequestError(ChaosError):
    """A request the relay will not forward; `status` is the HTTP reply it gets."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RelayRequest:
    target: Endpoint
    forward: bytes | None
    """The head to send upstream (absolute form rewritten), or None for a CONNECT tunnel,
    which is answered '200' by the relay itself."""


def _target(host: str | None, port: int | None, line: str, networks: Networks) -> Endpoint:
    if not host or port is None:
        raise RelayRequestError(400, f"no HOST:PORT in {line!r}; write CONNECT 127.0.0.1:PORT")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    ours = isinstance(address, ipaddress.IPv4Address) and (
        address.is_loopback or any(address in net for net in networks)
    )
    if not ours:
        also = "".join(f" or on {net}" for net in networks)
        raise RelayRequestError(
            403, f"{host} is not 127.0.0.1{also}: the relay forwards on this host only"
        )
    if not 0 < port <= 65535:
        raise RelayRequestError(400, f"port {port} in {line!r} is not 1..65535")
    return host, port


def _authority(text: str, line: str, networks: Networks) -> Endpoint:
    host, _, port = text.rpartition(":")
    if not port.isdigit():
        raise RelayRequestError(400, f"no HOST:PORT in {line!r}; write CONNECT 127.0.0.1:PORT")
    return _target(host.strip("[]"), int(port), line, networks)


def _absolute(
    method: str, url: str, version: str, rest: list[bytes], line: str, networks: Networks
) -> RelayRequest:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "ws"):
        raise RelayRequestError(
            400,
            f"{line!r} is not an absolute http:// or ws:// request; the relay takes those "
            "or CONNECT HOST:PORT",
        )
    try:
        port = parts.port if parts.port is not None else 80
    except ValueError:
        raise RelayRequestError(400, f"the port in {line!r} is not a number") from None
    target = _target(parts.hostname, port, line, networks)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    kept = [h for h in rest if h.split(b":", 1)[0].strip().lower() not in HOP_HEADERS]
    head = b"\r\n".join([f"{method} {path} {version}".encode("ascii"), *kept]) + b"\r\n\r\n"
    return RelayRequest(target, head)


def parse_request(head: bytes, networks: Networks = ()) -> RelayRequest:
    """A request head (up to and including the blank line) -> where to and what to send;
    the target must be on loopback or in one of `networks`."""
    lines = head.removesuffix(b"\r\n\r\n").split(b"\r\n")
    try:
        line = lines[0].decode("ascii")
    except UnicodeDecodeError:
        raise RelayRequestError(400, f"the request line {lines[0][:80]!r} is not ASCII") from None
    words = line.split(" ")
    if len(words) != 3 or not words[2].startswith("HTTP/1."):
        raise RelayRequestError(400, f"{line[:80]!r} is not an HTTP/1.x request line")
    method, url, version = words
    if method == "CONNECT":
        return RelayRequest(_authority(url, line, networks), None)
    if "://" in url:
        return _absolute(method, url, version, lines[1:], line, networks)
    raise RelayRequestError(
        400, f"{line[:80]!r}: the relay takes CONNECT HOST:PORT or an absolute http:// or ws:// URL"
    )
