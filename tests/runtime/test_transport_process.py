"""Two real OS processes: asks and tensors cross, and a killed peer fails pending asks."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Iterator

import aiohttp
import pytest
import torch

from shoal.runtime import auth, wire
from shoal.runtime.errors import LinkClosed
from shoal.runtime.loop import run
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import ROUTE, TransportConfig, attach
from tests.runtime.hostile_frames import HOSTILE_HEADERS, header_only_frame
from tests.support.processes import worker_process

TOKEN = "two-process-token"


@pytest.fixture
def child() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A child process serving a `worker` actor; its group is killed even if the test fails."""
    with worker_process(TOKEN) as found:
        yield found


@pytest.mark.timeout(60)
def test_asks_and_tensors_between_two_processes(
    child: tuple[subprocess.Popen[str], str],
) -> None:
    proc, address = child

    async def main() -> None:
        async with ActorSystem() as system:
            transport = await attach(system, TransportConfig(token=TOKEN))
            try:
                worker = system.ref(f"{address}/worker")
                assert await worker.ask.pid() == proc.pid != os.getpid()
                weights = torch.randn(512, 1024)
                assert torch.equal(await worker.ask.double(weights), weights * 2)
                replies = await asyncio.gather(
                    *(worker.ask.double(torch.full((4,), float(n))) for n in range(200))
                )
                assert [float(r[0]) for r in replies] == [2.0 * n for n in range(200)]
            finally:
                await transport.close()

    run(main())


@pytest.mark.timeout(60)
def test_killing_the_peer_fails_pending_asks_with_link_closed(
    child: tuple[subprocess.Popen[str], str],
) -> None:
    proc, address = child

    async def main() -> None:
        async with ActorSystem() as system:
            transport = await attach(system, TransportConfig(token=TOKEN, connect_timeout=0.5))
            try:
                worker = system.ref(f"{address}/worker")
                assert await worker.ask.pid() == proc.pid
                pending = asyncio.create_task(worker.ask.nap(30.0))
                await asyncio.sleep(0.2)
                os.kill(proc.pid, signal.SIGKILL)
                with pytest.raises(LinkClosed):
                    await asyncio.wait_for(pending, 10)
                with pytest.raises(LinkClosed, match="is that process running"):
                    await worker.ask.pid()
            finally:
                await transport.close()

    run(main())


@pytest.mark.timeout(60)
def test_a_stopped_peer_is_noticed_by_the_heartbeat(
    child: tuple[subprocess.Popen[str], str],
) -> None:
    """SIGSTOP keeps the socket open but silent, like a partition: the missing pong closes
    the link long before the ask's own timeout."""
    proc, address = child

    async def main() -> None:
        async with ActorSystem() as system:
            config = TransportConfig(token=TOKEN, heartbeat=0.5, connect_timeout=0.5)
            transport = await attach(system, config)
            try:
                worker = system.ref(f"{address}/worker")
                assert await worker.ask.pid() == proc.pid
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    with pytest.raises(LinkClosed, match="PONG"):
                        await worker.ask(timeout=30).pid()
                finally:
                    os.kill(proc.pid, signal.SIGCONT)
            finally:
                await transport.close()

    run(main())


async def _until_closed(ws: aiohttp.ClientWebSocketResponse) -> None:
    while not ws.closed:
        msg = await ws.receive(timeout=30)
        if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
            return


async def _send_on_every_path(address: str, data: bytes) -> None:
    """`data` as the first websocket message, as a frame after the handshake, as a stream
    hello and as a frame on an authenticated stream; each connection is closed by the peer."""
    token = TOKEN.encode()
    window = auth.Window(8, 1 << 20)
    url = "ws://" + address.removeprefix("shoal://") + ROUTE
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(url) as ws:
            await ws.send_bytes(data)
            await _until_closed(ws)
        async with session.ws_connect(url) as ws:
            await auth.client_handshake(ws, token, window, 30)
            await ws.send_bytes(data)
            await _until_closed(ws)
        for authenticated in (False, True):
            async with session.ws_connect(url) as ws:
                link = await auth.client_handshake(ws, token, window, 30)
                assert link.stream_port is not None
                reader, writer = await asyncio.open_connection("127.0.0.1", link.stream_port)
                if authenticated:
                    proof = auth.proof(token, b"stream", link.server_nonce, link.client_nonce)
                    hello = wire.encode({"stream": link.server_nonce, "proof": proof})
                    writer.write(b"".join(bytes(part) for part in hello.parts))
                writer.write(data)
                await asyncio.wait_for(reader.read(), 30)  # the peer closes the stream
                writer.close()


@pytest.mark.timeout(120)
def test_hostile_headers_on_every_path_leave_the_process_serving(
    child: tuple[subprocess.Popen[str], str],
) -> None:
    """Issue 14: ~700 bytes of nested extensions killed any process with a transport port,
    before authentication. Every hostile shape, on every path, to a real process."""
    proc, address = child

    async def main() -> None:
        for header, _ in HOSTILE_HEADERS.values():
            await _send_on_every_path(address, header_only_frame(header))
        async with ActorSystem() as system:
            transport = await attach(system, TransportConfig(token=TOKEN))
            try:
                assert await system.ref(f"{address}/worker").ask.pid() == proc.pid
            finally:
                await transport.close()

    run(main())
    assert proc.poll() is None
