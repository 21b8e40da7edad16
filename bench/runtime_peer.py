"""The second process of `shoal bench runtime` (and of `shoal bench chaos`): a shoal actor system,
a bare aiohttp websocket server and a raw asyncio TCP server side by side, so every figure and
its baseline cross the same loopback between the same two processes.

Apart from the measurements (runtime.py) because it is a program of its own: `second_process`
starts it as `python -c "from shoal.bench.runtime_peer import serve; serve()"`, and it
prints its addresses as one JSON line and serves until its stdin closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from shoal.errors import ShoalError
from shoal.runtime.actor import Actor
from shoal.runtime.loop import run as run_loop
from shoal.runtime.system import ActorSystem
from shoal.runtime.tls import TLS_DIR_ENV, TlsFiles
from shoal.runtime.transport import Transport, TransportConfig, attach

TOKEN = "bench-runtime-token"
CONSUMER_DELAY = 0.010
CONSUMER_MAILBOX = 4
CONSUMER_CREDIT_BYTES = 16 * 1024 * 1024
LEN = struct.Struct("<Q")


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssPeak:
    """Samples this process's resident memory every few ms and keeps the peak since `reset`."""

    def __init__(self) -> None:
        self.start = self.peak = rss_bytes()
        self._task = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, rss_bytes())
            await asyncio.sleep(0.002)

    def reset(self) -> None:
        self.start = self.peak = rss_bytes()

    @property
    def growth(self) -> int:
        return self.peak - self.start

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


class Sink(Actor):
    """Counts what arrives; `delay` makes it a slow consumer."""

    def __init__(self, delay: float = 0.0) -> None:
        self.received = 0
        self.delay = delay

    async def put(self, value: Any) -> None:
        self.received += 1
        if self.delay:
            await asyncio.sleep(self.delay)

    def count(self) -> int:
        return self.received

    def echo(self, value: Any) -> Any:
        return value


class Stats(Actor):
    def __init__(self, rss: RssPeak) -> None:
        self.rss = rss

    def reset(self) -> None:
        self.rss.reset()

    def growth(self) -> int:
        return self.rss.growth

    def cpu(self) -> float:
        return time.process_time()


async def _ws_handler(request: web.Request) -> web.WebSocketResponse:
    """Bare websocket baseline: echo binary messages on /echo, count bytes on /sink."""
    ws = web.WebSocketResponse(compress=False, max_msg_size=64 * 1024 * 1024)
    await ws.prepare(request)
    received = 0
    async for msg in ws:
        if request.path == "/echo":
            await ws.send_bytes(msg.data)
        elif msg.type == aiohttp.WSMsgType.BINARY:
            received += len(msg.data)
        else:
            await ws.send_str(str(received))
            received = 0
    return ws


async def _tcp_handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Raw TCP baseline: length-prefixed messages; an empty one asks for the byte count."""
    received = 0
    try:
        while True:
            (length,) = LEN.unpack(await reader.readexactly(LEN.size))
            if length == 0:
                writer.write(LEN.pack(received))
                received = 0
                continue
            data = await reader.readexactly(length)
            if data[:1] == b"E":
                writer.write(LEN.pack(length) + data)
            else:
                received += length
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def _serve() -> None:
    import torch  # noqa: F401 - before listening: a first tensor must not wait for the import

    rss = RssPeak()
    async with ActorSystem() as system:
        await system.spawn(Sink, name="sink")
        await system.spawn(Sink, CONSUMER_DELAY, name="slow", mailbox_size=CONSUMER_MAILBOX)
        await system.spawn(Stats, rss, name="stats")
        config = TransportConfig(token=TOKEN, credit_bytes=CONSUMER_CREDIT_BYTES, tls=None)
        transport = await attach(system, config)
        # The same actors behind mutual TLS, for the rows that price encryption.
        tls_dir = os.environ.get(TLS_DIR_ENV)
        tls = Transport(
            TransportConfig(token=TOKEN, tls=TlsFiles(Path(tls_dir)) if tls_dir else None),
            system.lookup,
        )
        await tls.start()
        app = web.Application()
        app.router.add_get("/echo", _ws_handler)
        app.router.add_get("/sink", _ws_handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        tcp = await asyncio.start_server(_tcp_handler, "127.0.0.1", 0)
        ports = {
            "shoal": transport.address,
            "ws": f"http://127.0.0.1:{runner.addresses[0][1]}",
            "tcp": tcp.sockets[0].getsockname()[1],
            "shoal_tls": tls.address,
        }
        print(json.dumps(ports), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        tcp.close()
        await runner.cleanup()
        await tls.close()
        await transport.close()
    await rss.stop()


def serve() -> None:
    """Entry point of the second process; runs until its stdin closes."""
    run_loop(_serve())


@contextlib.contextmanager
def second_process(tls: TlsFiles | None = None) -> Any:
    """The benchmark's peer process; with `tls`, its `shoal_tls` address serves the same
    actors over mutual TLS (cleartext otherwise)."""
    env = dict(os.environ)
    env.pop(TLS_DIR_ENV, None)
    if tls is not None:
        env[TLS_DIR_ENV] = str(tls.directory)
    proc = subprocess.Popen(
        [sys.executable, "-c", "from shoal.bench.runtime_peer import serve; serve()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise ShoalError(
                "the benchmark's second process exited before listening; run "
                "`python -c 'from shoal.bench.runtime_peer import serve; serve()'` to see why"
            )
        yield json.loads(line)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
