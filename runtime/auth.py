"""The link handshake: both ends prove they hold the cluster token without sending it.

Challenge–response with a fresh random nonce from each side: the server proves itself first
with HMAC(token, "server" | client nonce | server nonce), then the client answers with
HMAC(token, "client" | server nonce | client nonce). Each proof covers a nonce the verifier
just chose, so a recorded handshake cannot be replayed, and both ends learn the credit window
the other grants. Messages are ordinary wire frames, one per websocket message.

The server also announces its stream port; the client may then open the link's frame
stream (stream.py) and tie it to this link with HMAC(token, "stream" | server nonce | client
nonce): the server nonce names the link, the proof shows the opener holds the token and took
part in that handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from shoal.runtime import wire
from shoal.runtime.errors import AuthenticationFailed, LinkClosed, MalformedFrame, WireError
from shoal.runtime.stream import FrameStream

PROTOCOL = 1
NONCE_BYTES = 32
MAX_HANDSHAKE_BYTES = 4096

Socket = web.WebSocketResponse | aiohttp.ClientWebSocketResponse


@dataclass(frozen=True)
class Window:
    """The credit one end grants the other: frames and bytes it may send before waiting."""

    frames: int
    nbytes: int


@dataclass(frozen=True)
class Session:
    """What one handshake settled: the window the other end grants, both nonces (which tie a
    frame stream to this link) and the server's stream port (None: it takes no stream)."""

    window: Window
    client_nonce: bytes
    server_nonce: bytes
    stream_port: int | None


def proof(token: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    """The HMAC a `role` ("server" or "client") sends over the two nonces, in its order."""
    return hmac.new(token, role + b"|" + first + b"|" + second, hashlib.sha256).digest()


def verify(token: bytes, role: bytes, first: bytes, second: bytes, claimed: Any) -> None:
    """Raise `AuthenticationFailed` unless `claimed` is the proof; constant-time compare."""
    if not isinstance(claimed, bytes):
        raise AuthenticationFailed(
            f"the {role.decode()} sent no token proof; start every process with the cluster token"
        )
    if not hmac.compare_digest(proof(token, role, first, second), claimed):
        raise AuthenticationFailed(
            f"the {role.decode()} holds a different cluster token; give every process the same token"
        )


async def send(ws: Socket, value: Any) -> None:
    await ws.send_bytes(b"".join(bytes(part) for part in wire.encode(value).parts))


async def receive(ws: Socket, timeout: float) -> dict[str, Any]:
    """One handshake message; a close, a timeout or garbage becomes a WireError."""
    try:
        msg = await ws.receive(timeout=timeout)
    except TimeoutError as exc:
        # Not AuthenticationFailed: a slow peer may succeed on the next try.
        raise LinkClosed(f"the peer did not complete the handshake within {timeout}s") from exc
    if msg.type != aiohttp.WSMsgType.BINARY:
        raise LinkClosed(f"the peer closed the link during the handshake ({msg.type.name})")
    if len(msg.data) > MAX_HANDSHAKE_BYTES:
        raise MalformedFrame(f"a handshake message of {len(msg.data)} bytes is too long")
    value = wire.decode(msg.data, MAX_HANDSHAKE_BYTES)
    if not isinstance(value, dict):
        raise MalformedFrame("a handshake message must be a map")
    if "error" in value:
        raise _named_error(value)
    return value


def _named_error(value: dict[str, Any]) -> WireError:
    kind = AuthenticationFailed if value.get("error") == "AuthenticationFailed" else LinkClosed
    return kind(f"the peer refused the link: {value.get('message')}")


def _window(value: dict[str, Any]) -> Window:
    window = value.get("window")
    if (
        not isinstance(window, list)
        or len(window) != 2
        or not all(type(n) is int and n > 0 for n in window)
    ):
        raise MalformedFrame(f"handshake window {window!r} is not [frames, bytes] > 0")
    return Window(window[0], window[1])


async def client_handshake(ws: Socket, token: bytes, window: Window, timeout: float) -> Session:
    """Authenticate to a server; returns the window it grants this client, and its stream port."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    await send(ws, {"shoal": PROTOCOL, "nonce": nonce})
    reply = await receive(ws, timeout)
    server_nonce = reply.get("nonce")
    if not isinstance(server_nonce, bytes) or len(server_nonce) != NONCE_BYTES:
        raise MalformedFrame("the server's handshake carries no valid nonce")
    verify(token, b"server", nonce, server_nonce, reply.get("proof"))
    granted = _window(reply)
    stream_port = reply.get("stream")
    if stream_port is not None and not (type(stream_port) is int and 0 < stream_port < 65536):
        raise MalformedFrame(f"the server's stream port {stream_port!r} is not a port number")
    answer = proof(token, b"client", server_nonce, nonce)
    await send(ws, {"proof": answer, "window": [window.frames, window.nbytes]})
    await receive(ws, timeout)
    return Session(granted, nonce, server_nonce, stream_port)


async def server_handshake(
    ws: Socket, token: bytes, window: Window, timeout: float, stream_port: int | None = None
) -> Session:
    """Authenticate a connecting client; on failure tell it why before the caller closes."""
    try:
        hello = await receive(ws, timeout)
        client_nonce = hello.get("nonce")
        if hello.get("shoal") != PROTOCOL:
            raise MalformedFrame(
                f"the client speaks protocol {hello.get('shoal')!r}, not {PROTOCOL}"
            )
        if not isinstance(client_nonce, bytes) or len(client_nonce) != NONCE_BYTES:
            raise MalformedFrame("the client's hello carries no valid nonce")
        nonce = secrets.token_bytes(NONCE_BYTES)
        offer: dict[str, Any] = {
            "nonce": nonce,
            "proof": proof(token, b"server", client_nonce, nonce),
            "window": [window.frames, window.nbytes],
        }
        if stream_port is not None:
            offer["stream"] = stream_port
        await send(ws, offer)
        answer = await receive(ws, timeout)
        verify(token, b"client", nonce, client_nonce, answer.get("proof"))
        granted = _window(answer)
        await send(ws, {"ok": True})
        return Session(granted, client_nonce, nonce, stream_port)
    except WireError as exc:
        if not ws.closed:
            await send(ws, {"error": type(exc).__name__, "message": str(exc)})
        raise


# -- the frame stream's handshake --------------------------------------------------------


def _frame_bytes(value: Any) -> list[wire.Buffer]:
    return wire.encode(value).parts


async def _stream_message(stream: FrameStream, timeout: float) -> dict[str, Any]:
    try:
        frame = await asyncio.wait_for(stream.next_frame(timeout), timeout)
    except TimeoutError as exc:
        raise LinkClosed(
            f"the peer did not complete the stream handshake within {timeout}s"
        ) from exc
    value = wire.decode(frame, MAX_HANDSHAKE_BYTES)
    if not isinstance(value, dict):
        raise MalformedFrame("a stream handshake message must be a map")
    if "error" in value:
        raise _named_error(value)
    return value


async def stream_client_handshake(
    stream: FrameStream, token: bytes, session: Session, timeout: float
) -> None:
    """Tie a freshly connected frame stream to the link `session` describes."""
    proof_ = proof(token, b"stream", session.server_nonce, session.client_nonce)
    stream.write(_frame_bytes({"stream": session.server_nonce, "proof": proof_}))
    await _stream_message(stream, timeout)


Claim = Callable[[bytes], "Session | None"]


async def stream_server_handshake(
    stream: FrameStream, token: bytes, claim: Claim, timeout: float
) -> bytes:
    """Check a frame stream's hello; returns the server nonce of the link it belongs to.
    `claim` finds the session of a link still waiting for its stream. On failure the
    opener is told why; the caller closes the stream (the link itself is untouched, so
    someone who saw the nonces but lacks the token cannot disturb it)."""
    try:
        hello = await _stream_message(stream, timeout)
        nonce = hello.get("stream")
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            raise MalformedFrame("the stream hello names no link (a 32-byte server nonce)")
        session = claim(nonce)
        if session is None:
            raise AuthenticationFailed(
                "the stream hello names no link waiting for a frame stream; open the "
                "websocket link first and use its nonces"
            )
        verify(token, b"stream", nonce, session.client_nonce, hello.get("proof"))
        stream.write(_frame_bytes({"ok": True}))
        return nonce
    except WireError as exc:
        with contextlib.suppress(LinkClosed):
            stream.write(_frame_bytes({"error": type(exc).__name__, "message": str(exc)}))
        raise
