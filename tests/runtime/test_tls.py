"""Mutual TLS on links: both connections of a link encrypted, a stranger's certificate or a
cleartext peer refused, and the server serving the right peers afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shoal.errors import ConfigError
from shoal.runtime.actor import Actor
from shoal.runtime.errors import LinkClosed
from shoal.runtime.local_ca import make_local_ca
from shoal.runtime.loop import run
from shoal.runtime.system import ActorSystem
from shoal.runtime.tls import (
    ALLOW_CLEARTEXT_ENV,
    TLS_DIR_ENV,
    TlsFiles,
    check_cleartext,
    cleartext_allowed,
    tls_from_env,
)
from shoal.runtime.transport import Transport, TransportConfig, attach

pytestmark = pytest.mark.usefixtures("no_asyncio_errors")

TOKEN = "tls-token"
MARKER = b"plaintext-marker-" * 64


class Echo(Actor):
    def __init__(self) -> None:
        self.received = 0

    def echo(self, value: Any) -> Any:
        return value

    def put(self, value: Any) -> None:
        self.received += 1

    def count(self) -> int:
        return self.received


class Recorder:
    """A minimal HTTP proxy (CONNECT for streams, absolute-form GET for websockets) that keeps
    every byte it forwards, so a test can look for what an eavesdropper would see."""

    def __init__(self) -> None:
        self.seen = bytearray()
        self.server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        method, target, rest = head.split(b" ", 2)
        if method == b"CONNECT":
            host, _, port = target.decode().rpartition(":")
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            authority, _, path = target.decode().partition("://")[2].partition("/")
            host, _, port = authority.rpartition(":")
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
            up_writer.write(method + b" /" + path.encode() + b" " + rest)
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await src.read(65536):
                self.seen += data
                dst.write(data)
                await dst.drain()
        dst.close()


@pytest.fixture(scope="module")
def cluster_tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_local_ca(tmp_path_factory.mktemp("tls"))


@contextlib.asynccontextmanager
async def server(tls: TlsFiles | None) -> AsyncIterator[Transport]:
    async with ActorSystem() as system:
        await system.spawn(Echo, name="echo")
        transport = await attach(system, TransportConfig(token=TOKEN, tls=tls))
        try:
            yield transport
        finally:
            await transport.close()


async def echo_marker(address: str, tls: TlsFiles | None, relay: str | None = None) -> None:
    async with ActorSystem() as system:
        config = TransportConfig(token=TOKEN, tls=tls, relay=relay, connect_timeout=2.0)
        transport = await attach(system, config)
        try:
            ref = system.ref(f"{address}/echo")
            array = np.frombuffer(MARKER, dtype=np.uint8)
            assert bytes(await ref.ask.echo(array)) == MARKER
            assert await ref.ask.echo(MARKER) == MARKER
        finally:
            await transport.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("encrypted", [False, True], ids=["cleartext", "tls"])
def test_an_eavesdropper_sees_the_frames_only_without_tls(
    cluster_tls: TlsFiles, encrypted: bool
) -> None:
    tls = cluster_tls if encrypted else None

    async def main() -> None:
        recorder = Recorder()
        relay = await recorder.start()
        try:
            async with server(tls) as transport:
                await echo_marker(transport.address, tls, relay)
        finally:
            await recorder.close()
        assert len(recorder.seen) > 2 * len(MARKER)
        assert (MARKER[:64] in recorder.seen) is not encrypted

    run(main())


@pytest.mark.timeout(120)
def test_tells_of_every_size_flow_over_tls(cluster_tls: TlsFiles) -> None:
    """Each `await tell` waits for the stream to drain: over TLS a zero high-water mark once
    paused writing on an empty buffer and never resumed."""

    async def main() -> None:
        async with server(cluster_tls) as transport, ActorSystem() as system:
            client = await attach(system, TransportConfig(token=TOKEN, tls=cluster_tls))
            try:
                echo = system.ref(f"{transport.address}/echo")
                for size in (16, 4096, 256 * 1024, 4 * 1024 * 1024):
                    array = np.ones(size, dtype=np.uint8)
                    for _ in range(20):
                        await echo.tell.put(array)
                assert await echo.ask.count() == 80
            finally:
                await client.close()

    run(main())


@pytest.mark.timeout(120)
def test_a_certificate_from_another_ca_is_refused(cluster_tls: TlsFiles, tmp_path: Path) -> None:
    stranger = make_local_ca(tmp_path / "stranger")

    async def main() -> None:
        async with server(cluster_tls) as transport:
            with pytest.raises((LinkClosed, OSError)):
                await echo_marker(transport.address, stranger)
            await echo_marker(transport.address, cluster_tls)

    run(main())


@pytest.mark.timeout(120)
def test_a_cleartext_peer_cannot_talk_to_a_tls_server(cluster_tls: TlsFiles) -> None:
    async def main() -> None:
        async with server(cluster_tls) as transport:
            with pytest.raises((LinkClosed, OSError)):
                await echo_marker(transport.address, None)
            await echo_marker(transport.address, cluster_tls)

    run(main())


def test_the_local_ca_keeps_its_key_private(cluster_tls: TlsFiles) -> None:
    key = cluster_tls.directory / "key.pem"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert not any("CA" in p.name and "key" in p.name for p in cluster_tls.directory.iterdir())


def test_the_tls_directory_comes_from_the_environment(
    cluster_tls: TlsFiles, tmp_path: Path
) -> None:
    assert tls_from_env({}) is None
    assert tls_from_env({TLS_DIR_ENV: str(cluster_tls.directory)}) == cluster_tls
    with pytest.raises(ConfigError, match=r"has no ca\.pem"):
        tls_from_env({TLS_DIR_ENV: str(tmp_path)})


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True),
     ("localhost", True), ("0.0.0.0", False), ("10.0.0.1", False), ("gpu01", False)],
)  # fmt: skip
def test_cleartext_is_refused_off_loopback_unless_allowed(
    cluster_tls: TlsFiles, host: str, loopback: bool
) -> None:
    check_cleartext("the host", host, cluster_tls, allowed=False)
    check_cleartext("the host", host, None, allowed=True)
    if loopback:
        check_cleartext("the host", host, None, allowed=False)
    else:
        with pytest.raises(ConfigError, match=r"off loopback and would serve cleartext"):
            check_cleartext("the host", host, None, allowed=False)


def test_the_operator_allows_cleartext_through_the_environment() -> None:
    assert cleartext_allowed({ALLOW_CLEARTEXT_ENV: "1"})
    assert not cleartext_allowed({})
    with pytest.raises(ConfigError, match=ALLOW_CLEARTEXT_ENV):
        TransportConfig(token=TOKEN, host="10.0.0.1", tls=None, allow_cleartext=False)
