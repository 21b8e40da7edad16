"""Outbound links through a link relay: the websocket by absolute-form proxying, the frame
stream by a CONNECT tunnel, both through a real relay to a real child process; a relay that
is gone or talks garbage fails the link (or only its stream) with a message saying so."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shoal.chaos.relay import LinkRelay
from shoal.errors import ConfigError
from shoal.ports import free_port
from shoal.runtime import tunnel
from shoal.runtime.errors import LinkClosed
from shoal.runtime.loop import run
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import TransportConfig, attach
from tests.support.processes import worker_process

TOKEN = "relay-token"


@pytest.fixture
def child() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A child process serving a `worker` actor; its group is killed even if the test fails."""
    with worker_process(TOKEN) as found:
        yield found


@pytest.mark.timeout(60)
def test_asks_and_tensors_cross_a_link_through_the_relay(
    child: tuple[subprocess.Popen[str], str],
) -> None:
    proc, address = child

    async def main() -> None:
        async with LinkRelay() as relay, ActorSystem() as system:
            transport = await attach(system, TransportConfig(token=TOKEN, relay=relay.address))
            try:
                worker = system.ref(f"{address}/worker")
                assert await worker.ask.pid() == proc.pid
                weights = torch.randn(256, 1024)
                assert torch.equal(await worker.ask.double(weights), weights * 2)
                replies = await asyncio.gather(
                    *(worker.ask.double(torch.full((4,), float(n))) for n in range(100))
                )
                assert [float(r[0]) for r in replies] == [2.0 * n for n in range(100)]
                link = transport.peer(address).open_link()
                assert link is not None
                assert link.has_stream
                # Both halves of the link went through the relay: the websocket and the stream.
                assert relay.stats.relayed == 2
                assert relay.stats.open == 2
                assert relay.stats.bytes_up > weights.numel() * 4
            finally:
                await transport.close()

    run(main())


def test_the_relay_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tunnel.RELAY_ENV, "127.0.0.1:7400")
    assert TransportConfig(token=TOKEN).relay == "127.0.0.1:7400"
    assert TransportConfig(token=TOKEN, relay=None).relay is None
    monkeypatch.setenv(tunnel.RELAY_ENV, "")
    assert TransportConfig(token=TOKEN).relay is None
    monkeypatch.delenv(tunnel.RELAY_ENV)
    assert TransportConfig(token=TOKEN).relay is None
    monkeypatch.setenv(tunnel.RELAY_ENV, "no-port-here")
    with pytest.raises(ConfigError, match="SHOAL_LINK_RELAY"):
        TransportConfig(token=TOKEN)


@given(st.text(max_size=30))
def test_a_relay_setting_parses_or_is_a_config_error(value: str) -> None:
    with contextlib.suppress(ConfigError):
        host, port = tunnel.parse_relay(value)
        assert host
        assert 0 < port <= 65535
        assert value.endswith(str(port))


def test_relay_settings_examples() -> None:
    assert tunnel.parse_relay("127.0.0.1:7400") == ("127.0.0.1", 7400)
    assert tunnel.parse_relay("[::1]:80") == ("::1", 80)
    for bad in ("", "7400", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:70000", ":80"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            tunnel.parse_relay(bad)
    assert tunnel.reply_status(b"HTTP/1.1 502 Bad Gateway\r\n\r\n", "r") == 502
    with pytest.raises(tunnel.RelayRefused, match="not an HTTP reply"):
        tunnel.reply_status(b"SSH-2.0\r\n\r\n", "r")


@given(st.binary(max_size=60))
def test_any_reply_head_is_a_status_or_relay_refused(head: bytes) -> None:
    with contextlib.suppress(tunnel.RelayRefused):
        status = tunnel.reply_status(head, "127.0.0.1:1")
        assert head.startswith(b"HTTP/1.")
        assert status >= 0


@pytest.mark.timeout(60)
def test_a_dead_relay_fails_the_link_like_a_dead_peer(
    child: tuple[subprocess.Popen[str], str],
) -> None:
    _, address = child
    relay = f"127.0.0.1:{free_port()}"

    async def main() -> None:
        async with ActorSystem() as system:
            config = TransportConfig(token=TOKEN, relay=relay, connect_timeout=0.5)
            transport = await attach(system, config)
            try:
                with pytest.raises(LinkClosed, match=f"through the link relay {relay}"):
                    await system.ref(f"{address}/worker").ask.pid()
            finally:
                await transport.close()

    run(main())


async def _garbage_server(connects: str) -> asyncio.Server:
    """Answers every request with bytes that are no HTTP reply; with connects='relay:PORT' it
    passes non-CONNECT requests on to that relay, so only the frame stream's tunnel fails."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"CONNECT") or not connects:
                writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
                await writer.drain()
                return
            host, port = connects.split(":")
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
            up_writer.write(head)
            await asyncio.gather(_copy(reader, up_writer), _copy(up_reader, writer))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.transport.abort()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def _copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    finally:
        dst.transport.abort()


@pytest.mark.timeout(60)
def test_a_relay_talking_garbage_fails_the_link_with_a_clear_error(
    child: tuple[subprocess.Popen[str], str],
) -> None:
    _, address = child

    async def main() -> None:
        server = await _garbage_server("")
        relay = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            async with ActorSystem() as system:
                config = TransportConfig(token=TOKEN, relay=relay, connect_timeout=0.5)
                transport = await attach(system, config)
                try:
                    with pytest.raises(LinkClosed, match="through the link relay"):
                        await system.ref(f"{address}/worker").ask.pid()
                finally:
                    await transport.close()
                with pytest.raises(tunnel.RelayRefused, match="not an HTTP reply"):
                    await tunnel.open_tunnel(relay, "127.0.0.1", 1, 5.0)
        finally:
            server.close()
            await server.wait_closed()

    run(main())


@pytest.mark.timeout(60)
def test_a_refused_stream_tunnel_falls_back_to_the_websocket(
    child: tuple[subprocess.Popen[str], str],
) -> None:
    proc, address = child

    async def main() -> None:
        async with LinkRelay() as relay:
            server = await _garbage_server(relay.address)
            front = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
            try:
                async with ActorSystem() as system:
                    transport = await attach(system, TransportConfig(token=TOKEN, relay=front))
                    try:
                        worker = system.ref(f"{address}/worker")
                        assert await worker.ask.pid() == proc.pid
                        weights = torch.randn(64, 1024)
                        assert torch.equal(await worker.ask.double(weights), weights * 2)
                        link = transport.peer(address).open_link()
                        assert link is not None
                        assert not link.has_stream
                    finally:
                        await transport.close()
            finally:
                server.close()
                with contextlib.suppress(Exception):
                    await server.wait_closed()

    run(main())
