"""`shoal bench runtime`: the actor runtime and its transport beside what the same work costs
on a bare aiohttp websocket and on raw asyncio TCP (the ceiling), all measured in one run.

Cross-process figures talk to a real second process (runtime_peer.py), which hosts a shoal
actor system, a bare websocket server and a raw TCP server side by side, so every figure and
its baseline cross the same loopback between the same two processes; the baselines' clients
are in runtime_baselines.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from shoal.bench.report import Row
from shoal.bench.runtime_baselines import TcpBaseline, WsBaseline, rate
from shoal.bench.runtime_peer import (
    CONSUMER_CREDIT_BYTES,
    CONSUMER_DELAY,
    CONSUMER_MAILBOX,
    TOKEN,
    RssPeak,
    Sink,
    second_process,
)
from shoal.runtime.local_ca import make_local_ca
from shoal.runtime.loop import run as run_loop
from shoal.runtime.ref import ActorRef
from shoal.runtime.system import ActorSystem
from shoal.runtime.tls import TlsFiles
from shoal.runtime.transport import TransportConfig, attach

MB = 1e6


@dataclass(frozen=True)
class Sizes:
    """How much work each figure does; quick mode is for smoke tests, not for reading."""

    tells: int
    asks: int
    pipelined: int
    small_tensors: int
    big_tensors: int
    overrun: int


FULL = Sizes(
    tells=100_000, asks=5_000, pipelined=50_000, small_tensors=4_000, big_tensors=600, overrun=200
)
QUICK = Sizes(tells=2_000, asks=200, pipelined=2_000, small_tensors=100, big_tensors=20, overrun=20)


# -- measurements -------------------------------------------------------------------------


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def interleaved_latencies(
    calls: list[Callable[[], Awaitable[Any]]], n: int
) -> list[list[float]]:
    """Round-trip times in µs of each call, interleaved call by call, so a change in the
    machine's load (other processes share these cores) hits shoal and baselines alike."""
    for _ in range(min(100, n)):
        for call in calls:
            await call()
    samples: list[list[float]] = [[] for _ in calls]
    clock = time.perf_counter
    for _ in range(n):
        for call, out in zip(calls, samples):
            start = clock()
            await call()
            out.append((clock() - start) * 1e6)
    return samples


async def _cpu_cost(stats: ActorRef, work: Callable[[], Awaitable[Any]], units: float) -> float:
    """µs of CPU both processes spent per unit of `work`: unlike rates, this hardly moves when
    other jobs share the machine's cores."""
    before = time.process_time() + await stats.ask.cpu()
    await work()
    after = time.process_time() + await stats.ask.cpu()
    return (after - before) * 1e6 / units


async def _local_tells(n: int) -> tuple[float, float]:
    async with ActorSystem() as system:
        sink = await system.spawn(Sink, name="sink")

        async def tells() -> None:
            for i in range(n):
                await sink.tell.put(i)
            assert await sink.ask.count() == n

        shoal = await rate(tells, n)
    queue: asyncio.Queue[int] = asyncio.Queue(maxsize=1000)
    done = asyncio.Event()

    async def consume() -> None:
        for _ in range(n):
            await queue.get()
        done.set()

    async def puts() -> None:
        consumer = asyncio.create_task(consume())
        for i in range(n):
            await queue.put(i)
        await done.wait()
        await consumer

    return shoal, await rate(puts, n)


async def _remote_tells(sink: ActorRef, n: int, value: Any) -> float:
    before = await sink.ask.count()

    async def tells() -> None:
        for _ in range(n):
            await sink.tell.put(value)
        assert await sink.ask.count() == before + n

    return await rate(tells, n)


async def _pipelined_asks(echo: ActorRef, n: int, window: int = 256) -> float:
    async def asks() -> None:
        for _ in range(n // window):
            await asyncio.gather(*(echo.ask.echo(i) for i in range(window)))

    return await rate(asks, n // window * window)


@contextlib.asynccontextmanager
async def _clients(
    ports: dict[str, Any],
) -> AsyncIterator[tuple[ActorSystem, WsBaseline, TcpBaseline]]:
    async with ActorSystem() as system, aiohttp.ClientSession() as session:
        transport = await attach(system, TransportConfig(token=TOKEN, tls=None))
        reader, writer = await asyncio.open_connection("127.0.0.1", ports["tcp"])
        try:
            yield system, WsBaseline(session, ports["ws"]), TcpBaseline(reader, writer)
        finally:
            writer.close()
            await transport.close()


async def _overrun(system: ActorSystem, address: str, n: int) -> tuple[int, int]:
    """A producer offering 1 MiB tensors 10x faster than the consumer takes them: how much do
    the producer and the consumer grow? (bytes, bytes)"""
    import torch

    slow, stats = system.ref(f"{address}/slow"), system.ref(f"{address}/stats")
    await stats.ask.reset()
    rss = RssPeak()
    for _ in range(n):
        await slow.tell.put(torch.ones(256 * 1024))
        await asyncio.sleep(CONSUMER_DELAY / 10)
    await slow.ask(timeout=120).count()
    await rss.stop()
    return rss.growth, await stats.ask.growth()


async def _measure(quick: bool) -> list[Row]:
    import torch

    sizes = QUICK if quick else FULL
    rows: list[Row] = []
    local, queue = await _local_tells(sizes.tells)
    rows.append(Row("local tell", "msgs/s", local, queue, "asyncio.Queue put/get", True))
    with (
        tempfile.TemporaryDirectory() as scratch,
        second_process(make_local_ca(Path(scratch))) as ports,
    ):
        async with _clients(ports) as (system, ws, tcp):
            address = ports["shoal"]
            sink = system.ref(f"{address}/sink")
            await sink.ask.echo(
                torch.ones(1)
            )  # the second process imports torch now, not mid-figure
            small = b"x" * 16
            tells = await _remote_tells(sink, sizes.tells, 7)
            rows.append(
                Row(
                    "cross-process tell (small)",
                    "msgs/s",
                    tells,
                    await ws.stream(sizes.tells, small),
                    "bare websocket one-way",
                    True,
                )
            )
            rows.append(
                Row(
                    "cross-process tell (small)",
                    "msgs/s",
                    tells,
                    await tcp.stream(sizes.tells, small),
                    "raw asyncio TCP one-way",
                    True,
                )
            )
            rows.append(
                Row(
                    "cross-process pipelined ask",
                    "calls/s",
                    await _pipelined_asks(sink, sizes.pipelined),
                    await ws.echorate(sizes.pipelined, small),
                    "bare websocket echo",
                    True,
                )
            )
            async with ws.echo(small) as ws_echo:
                shoal_rtt, ws_rtt, tcp_rtt = await interleaved_latencies(
                    [lambda: sink.ask.echo(7), ws_echo, tcp.echo(b"E" + small)], sizes.asks
                )
            for q, label in ((0.5, "p50"), (0.99, "p99")):
                rows.append(
                    Row(
                        f"cross-process ask {label}",
                        "us",
                        _percentile(shoal_rtt, q),
                        _percentile(ws_rtt, q),
                        "bare websocket echo",
                        False,
                    )
                )
            rows.append(
                Row(
                    "cross-process ask p50",
                    "us",
                    _percentile(shoal_rtt, 0.5),
                    _percentile(tcp_rtt, 0.5),
                    "raw asyncio TCP echo",
                    False,
                )
            )
            ray = _ray_ask_p50(sizes.asks)
            ray_name = "Ray actor echo" if ray is not None else "Ray actors (not installed)"
            rows.append(
                Row(
                    "cross-process ask p50", "us", _percentile(shoal_rtt, 0.5), ray, ray_name, False
                )
            )
            for label, elements, count in (
                ("64 KiB", 16 * 1024, sizes.small_tensors),
                ("1 MiB", 256 * 1024, sizes.big_tensors),
            ):
                tensor = torch.ones(elements)
                nbytes = elements * 4
                shoal = await _remote_tells(sink, count, tensor) * nbytes / MB
                payload = tensor.numpy().tobytes()
                rows.append(
                    Row(
                        f"stream {label} float32 tensors",
                        "MB/s",
                        shoal,
                        await ws.stream(count, payload) * nbytes / MB,
                        "bare websocket, one message each",
                        True,
                    )
                )
                rows.append(
                    Row(
                        f"stream {label} float32 tensors",
                        "MB/s",
                        shoal,
                        await tcp.stream(count, payload) * nbytes / MB,
                        "raw asyncio TCP",
                        True,
                    )
                )
            rows += await _tls_rows(sink, ports["shoal_tls"], TlsFiles(Path(scratch)), sizes)
            rows += await _cpu_rows(system.ref(f"{address}/stats"), sink, ws, tcp, sizes)
            producer, consumer = await _overrun(system, address, sizes.overrun)
            bound = (CONSUMER_CREDIT_BYTES + (CONSUMER_MAILBOX + 2) * 4 * 256 * 1024) / MB
            rows.append(
                Row(
                    "overrun 10x: producer RSS growth",
                    "MB",
                    producer / MB,
                    bound,
                    "credit window + mailbox (bound)",
                    False,
                )
            )
            rows.append(
                Row(
                    "overrun 10x: consumer RSS growth",
                    "MB",
                    consumer / MB,
                    bound,
                    "credit window + mailbox (bound)",
                    False,
                )
            )
    return rows


async def _tls_rows(clear: ActorRef, address: str, tls: TlsFiles, sizes: Sizes) -> list[Row]:
    """What mutual TLS costs a link: the same actors asked and streamed to over a TLS link
    and the cleartext one, interleaved / back to back in this run."""
    import torch

    async with ActorSystem() as system:
        transport = await attach(system, TransportConfig(token=TOKEN, tls=tls))
        try:
            sink = system.ref(f"{address}/sink")
            await sink.ask.echo(7)
            tls_rtt, clear_rtt = await interleaved_latencies(
                [lambda: sink.ask.echo(7), lambda: clear.ask.echo(7)], sizes.asks
            )
            tensor = torch.ones(256 * 1024)
            per_tell = 256 * 1024 * 4 / MB
            tls_rate = await _remote_tells(sink, sizes.big_tensors, tensor) * per_tell
            clear_rate = await _remote_tells(clear, sizes.big_tensors, tensor) * per_tell
        finally:
            await transport.close()
    baseline = "the same link in cleartext"
    return [
        Row(
            "cross-process ask p50 (TLS)",
            "us",
            _percentile(tls_rtt, 0.5),
            _percentile(clear_rtt, 0.5),
            baseline,
            False,
        ),
        Row("stream 1 MiB float32 tensors (TLS)", "MB/s", tls_rate, clear_rate, baseline, True),
    ]


async def _cpu_rows(
    stats: ActorRef, sink: ActorRef, ws: WsBaseline, tcp: TcpBaseline, sizes: Sizes
) -> list[Row]:
    import torch

    async def asks() -> None:
        for _ in range(sizes.asks):
            await sink.ask.echo(7)

    async with ws.echo(b"x" * 16) as echo:

        async def echoes() -> None:
            for _ in range(sizes.asks):
                await echo()

        ask_cpu = await _cpu_cost(stats, asks, sizes.asks)
        echo_cpu = await _cpu_cost(stats, echoes, sizes.asks)
    small = b"x" * 16

    async def pipelined() -> None:
        await _pipelined_asks(sink, sizes.pipelined)

    async def pipelined_echoes() -> None:
        await ws.echorate(sizes.pipelined, small)

    async def tells() -> None:
        await _remote_tells(sink, sizes.tells, 7)

    async def ws_stream() -> None:
        await ws.stream(sizes.tells, small)

    pipelined_cpu = await _cpu_cost(stats, pipelined, sizes.pipelined)
    pipelined_echo_cpu = await _cpu_cost(stats, pipelined_echoes, sizes.pipelined)
    tell_cpu = await _cpu_cost(stats, tells, sizes.tells)
    ws_tell_cpu = await _cpu_cost(stats, ws_stream, sizes.tells)
    tensor = torch.ones(256 * 1024)
    payload = tensor.numpy().tobytes()
    megabytes = sizes.big_tensors * len(payload) / MB

    async def shoal_stream() -> None:
        await _remote_tells(sink, sizes.big_tensors, tensor)

    async def tcp_stream() -> None:
        await tcp.stream(sizes.big_tensors, payload)

    stream_cpu = await _cpu_cost(stats, shoal_stream, megabytes)
    tcp_cpu = await _cpu_cost(stats, tcp_stream, megabytes)
    return [
        Row(
            "CPU per small tell (both ends)",
            "us",
            tell_cpu,
            ws_tell_cpu,
            "bare websocket one-way",
            False,
        ),
        Row(
            "CPU per pipelined ask (both ends)",
            "us",
            pipelined_cpu,
            pipelined_echo_cpu,
            "bare websocket echo",
            False,
        ),
        Row(
            "CPU per cross-process ask (both ends)",
            "us",
            ask_cpu,
            echo_cpu,
            "bare websocket echo",
            False,
        ),
        Row(
            "CPU per MB streamed, 1 MiB tensors (both ends)",
            "us/MB",
            stream_cpu,
            tcp_cpu,
            "raw asyncio TCP",
            False,
        ),
    ]


def _ray_ask_p50(n: int) -> float | None:
    """Ray's actor round trip when Ray is installed (it is an optional extra)."""
    try:
        import ray
    except ImportError:
        return None
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:

        class Echo:
            def echo(self, value: Any) -> Any:
                return value

        echo: Any = ray.remote(Echo).remote()
        ray.get(echo.echo.remote(1))
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            ray.get(echo.echo.remote(7))
            samples.append((time.perf_counter() - start) * 1e6)
        return _percentile(samples, 0.5)
    finally:
        ray.shutdown()


def run(quick: bool) -> list[Row]:
    """All figures of the suite; quick mode runs each a little, for smoke tests."""
    return run_loop(_measure(quick))
