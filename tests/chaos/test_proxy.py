"""The fault proxy between a real client socket and a real echo server: bytes pass intact with
no fault, and each fault has its effect (counted; timings only as generous lower bounds)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from shoal.chaos.errors import ProxyError
from shoal.chaos.proxy import FaultProxy
from shoal.chaos.proxy_control import serve_control
from shoal.chaos.traffic import NetFaults

pytestmark = pytest.mark.timeout(60)


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
    except OSError:
        pass
    finally:
        writer.close()


def with_proxy(
    body: Callable[[FaultProxy], Awaitable[None]],
) -> Callable[[], None]:
    """Run `body` in a fresh event loop beside an echo server and a proxy in front of it;
    everything is closed even when the body fails."""

    async def main() -> None:
        server = await asyncio.start_server(_echo, "127.0.0.1", 0)
        proxy = FaultProxy(("127.0.0.1", server.sockets[0].getsockname()[1]), seed=1)
        try:
            await proxy.start()
            await body(proxy)
        finally:
            await proxy.close()
            server.close()
            await server.wait_closed()

    def test() -> None:
        asyncio.run(main())

    return test


async def _connect(proxy: FaultProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", proxy.port)


async def _round_trip(proxy: FaultProxy, payload: bytes) -> bytes:
    reader, writer = await _connect(proxy)
    try:
        writer.write(payload)
        await writer.drain()
        return await reader.readexactly(len(payload))
    finally:
        writer.close()


@with_proxy
async def test_bytes_pass_intact_without_faults(proxy: FaultProxy) -> None:
    payload = os.urandom(2 * 1024 * 1024)
    assert await _round_trip(proxy, payload) == payload
    assert proxy.stats.bytes_up == proxy.stats.bytes_down == len(payload)


@with_proxy
async def test_eof_is_forwarded(proxy: FaultProxy) -> None:
    reader, writer = await _connect(proxy)
    writer.write(b"last words")
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 10) == b"last words"
    writer.close()


@with_proxy
async def test_refuse_cuts_open_connections_and_resets_new_ones(proxy: FaultProxy) -> None:
    reader, writer = await _connect(proxy)
    writer.write(b"ping")
    assert await reader.readexactly(4) == b"ping"
    proxy.set_faults(NetFaults(partition="refuse"))
    with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
        await asyncio.wait_for(reader.readexactly(1), 10)
    writer.close()
    with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
        await _round_trip(proxy, b"x")
    assert proxy.stats.reset == 1
    assert proxy.stats.refused == 1
    proxy.heal()
    assert await _round_trip(proxy, b"back") == b"back"


@with_proxy
async def test_blackhole_holds_bytes_until_healed(proxy: FaultProxy) -> None:
    reader, writer = await _connect(proxy)
    writer.write(b"a")
    assert await reader.readexactly(1) == b"a"
    proxy.set_faults(NetFaults(partition="blackhole"))
    writer.write(b"held")
    late_reader, late_writer = await _connect(proxy)
    late_writer.write(b"new")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.readexactly(4), 0.3)
    assert proxy.stats.bytes_up == 1
    proxy.heal()
    assert await asyncio.wait_for(reader.readexactly(4), 10) == b"held"
    assert await asyncio.wait_for(late_reader.readexactly(3), 10) == b"new"
    writer.close()
    late_writer.close()


@with_proxy
async def test_delay_applies_each_way(proxy: FaultProxy) -> None:
    proxy.set_faults(NetFaults(delay_s=0.15, jitter_s=0.05))
    start = time.monotonic()
    assert await _round_trip(proxy, b"slow") == b"slow"
    assert time.monotonic() - start >= 2 * 0.1


@with_proxy
async def test_drop_loss_cuts_the_connection(proxy: FaultProxy) -> None:
    proxy.set_faults(NetFaults(loss=1.0, loss_mode="drop"))
    with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
        await _round_trip(proxy, b"lost")
    assert proxy.stats.dropped == 1


@with_proxy
async def test_stall_loss_delays_but_keeps_bytes(proxy: FaultProxy) -> None:
    proxy.set_faults(NetFaults(loss=1.0, loss_mode="stall", stall_s=0.2))
    start = time.monotonic()
    assert await _round_trip(proxy, b"late") == b"late"
    assert time.monotonic() - start >= 0.2
    assert proxy.stats.stalled == 2


@with_proxy
async def test_bandwidth_limit(proxy: FaultProxy) -> None:
    rate = 1_000_000.0
    proxy.set_faults(NetFaults(bandwidth_bps=rate))
    payload = os.urandom(400_000)
    start = time.monotonic()
    assert await _round_trip(proxy, payload) == payload
    burst = rate / 20
    assert time.monotonic() - start >= (len(payload) - burst) / rate


@with_proxy
async def test_reset_sends_rst(proxy: FaultProxy) -> None:
    reader, writer = await _connect(proxy)
    writer.write(b"hi")
    assert await reader.readexactly(2) == b"hi"
    assert proxy.reset_connections() == 1
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(1), 10)
    writer.close()
    assert await _round_trip(proxy, b"fresh") == b"fresh"


def test_unreachable_upstream_is_counted() -> None:
    asyncio.run(_unreachable())


async def _unreachable() -> None:
    async with FaultProxy(("127.0.0.1", 1)) as proxy:
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            await _round_trip(proxy, b"x")
        assert proxy.stats.upstream_failures == 1


@with_proxy
async def test_port_in_use_is_a_clear_error(proxy: FaultProxy) -> None:
    with pytest.raises(ProxyError, match="cannot listen"):
        await FaultProxy(proxy.target, listen_port=proxy.port).start()


@with_proxy
async def test_control_endpoint(proxy: FaultProxy) -> None:
    runner = await serve_control({"p1": proxy})
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.put(f"{base}/proxies/p1/faults", json={"loss": 3}) as resp:
                assert resp.status == 400
                assert "loss=3" in (await resp.json())["message"]
            async with http.put(f"{base}/proxies/p1/faults", data=b"{") as resp:
                assert resp.status == 400
            async with http.put(f"{base}/proxies/nope/faults", json={}) as resp:
                assert resp.status == 404
            async with http.put(
                f"{base}/proxies/p1/faults", json={"partition": "blackhole"}
            ) as resp:
                assert resp.status == 200
            assert proxy.faults.partition == "blackhole"
            async with http.post(f"{base}/proxies/p1/heal") as resp:
                assert (await resp.json())["faults"]["partition"] is None
            async with http.post(f"{base}/proxies/p1/reset") as resp:
                assert (await resp.json()) == {"reset": 0}
            async with http.get(f"{base}/proxies") as resp:
                (listed,) = (await resp.json())["proxies"]
                assert listed["port"] == proxy.port
    finally:
        await runner.cleanup()


@with_proxy
async def test_link_faults_hit_only_the_connections_chosen(proxy: FaultProxy) -> None:
    """One client's connection made lossy, the other's untouched; per-connection faults may
    not partition or limit bandwidth (the proxy does that for everyone)."""
    marked_reader, marked = await _connect(proxy)
    other_reader, other = await _connect(proxy)
    try:
        mark = marked.get_extra_info("sockname")[:2]
        lossy = NetFaults(loss=1.0, loss_mode="drop")
        for writer, reader in ((marked, marked_reader), (other, other_reader)):
            writer.write(b"warm")
            await writer.drain()
            assert await reader.readexactly(4) == b"warm"  # both accepted by the proxy
        chosen = proxy.set_link_faults(lambda client, server: lossy if client == mark else None)
        assert chosen == 1
        marked.write(b"lost")
        await marked.drain()
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            await marked_reader.readexactly(4)
        other.write(b"kept")
        await other.drain()
        assert await other_reader.readexactly(4) == b"kept"
        assert proxy.stats.dropped == 1
        with pytest.raises(ProxyError, match="only delay_s, jitter_s and loss"):
            proxy.set_link_faults(lambda client, server: NetFaults(partition="refuse"))
        assert proxy.set_link_faults(None) == 0
        assert await _round_trip(proxy, b"back") == b"back"
    finally:
        marked.close()
        other.close()
