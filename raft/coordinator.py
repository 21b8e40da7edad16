"""One coordinator replica as a process: pysyncobj on its own thread, the admin API and the
leader's duties on the event loop, journal and dump files in the data directory.

`Coordinator.serve` runs until `stop` is set (SIGTERM/SIGINT in `main`), then closes the API,
stops Raft and lets pysyncobj flush its journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import aiohttp
from aiohttp import web
from pysyncobj import SyncObj, SyncObjConf

from shoal.errors import ConfigError
from shoal.files import lock_directory
from shoal.raft.api import build_app
from shoal.raft.bridge import RaftBridge
from shoal.raft.config import CoordinatorConfig, RaftTimings, parse_address
from shoal.raft.context import ApiContext
from shoal.raft.leader import LeaderDuties
from shoal.raft.liveness import LivenessTable
from shoal.raft.pysyncobj_seam import GuardedTransport, tick_thread
from shoal.raft.state import ClusterState
from shoal.runtime.tls import check_cleartext, cleartext_allowed

log = logging.getLogger(__name__)
FORWARD_TIMEOUT = 5.0


def syncobj_conf(config: CoordinatorConfig, bridge: RaftBridge) -> SyncObjConf:
    t: RaftTimings = config.timings
    return SyncObjConf(
        password=config.secret,
        journalFile=str(config.data_dir / "raft.journal"),
        fullDumpFile=str(config.data_dir / "raft.dump"),
        appendEntriesUseBatch=t.batch_appends,
        appendEntriesPeriod=t.append_period,
        raftMinTimeout=t.min_timeout,
        raftMaxTimeout=t.max_timeout,
        connectionTimeout=t.connection_timeout,
        connectionRetryTime=t.reconnect_period,
        leaderFallbackTimeout=t.leader_fallback,
        autoTickPeriod=t.tick_period,
        onStateChanged=bridge.on_state_changed,
        commandsWaitLeader=True,
        # Without it pysyncobj listens on 0.0.0.0 (or ::) at the --raft port.
        bindAddress=config.raft_listen,
    )


def start_syncobj(config: CoordinatorConfig, bridge: RaftBridge, state: ClusterState) -> SyncObj:
    """pysyncobj listening on exactly `config.raft_listen`, encrypted with the cluster secret,
    each connection held to small frames until its peer has proven it holds that secret."""
    return SyncObj(
        config.raft,
        list(config.peers),
        syncobj_conf(config, bridge),
        consumers=[state],
        transportClass=GuardedTransport,
    )


class Coordinator:
    """A replica: build it, then `await serve(stop)` on the main thread's event loop."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config

    async def serve(self, stop: asyncio.Event) -> None:
        config = self.config
        config.data_dir.mkdir(parents=True, exist_ok=True)
        with _claim(config.data_dir):
            await self._serve(stop)

    async def _serve(self, stop: asyncio.Event) -> None:
        config = self.config
        # pysyncobj retries a failed bind forever in silence: find out now, with a clear error.
        _check_bindable("--raft" if config.raft_bind is None else "--raft-bind", config.raft_listen)
        _check_bindable("--api", config.api)
        check_cleartext(
            "--api", parse_address("--api", config.api)[0], config.tls, cleartext_allowed()
        )
        state = ClusterState()
        bridge = RaftBridge(state, asyncio.get_running_loop())
        # SyncObj's tick thread watches the thread that built it: build it on this (main) thread.
        sync = start_syncobj(config, bridge, state)
        bridge.attach(sync)
        ctx = ApiContext(config, state, bridge, LivenessTable(config.liveness))
        duties = LeaderDuties(ctx)
        bridge.add_listener(duties.on_leadership)
        runner = web.AppRunner(build_app(ctx), access_log=None)
        try:
            tls = config.tls
            ctx.session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT),
                connector=aiohttp.TCPConnector(ssl=tls.client_context() if tls else True),
            )
            await runner.setup()
            host, port = parse_address("--api", config.api)
            server_tls = tls.server_context(mutual=False) if tls else None
            await web.TCPSite(runner, host, port, ssl_context=server_tls).start()
            log.info(
                "replica %s: raft %s (bound to %s), api %s, peers %s",
                config.replica_id,
                config.raft,
                config.raft_listen,
                config.api_url,
                config.peers,
            )
            await stop.wait()
        finally:
            await duties.stop()
            await runner.cleanup()
            if ctx.session is not None:
                await ctx.session.close()
            sync.destroy()
            await asyncio.get_running_loop().run_in_executor(None, _join_tick_thread, sync)
            log.info("replica %s stopped", config.replica_id)


@contextlib.contextmanager
def _claim(data_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on the data directory: two replicas on one journal corrupt it."""
    in_use = f"--data-dir={data_dir} is in use by another coordinator; give each replica its own"
    with lock_directory(data_dir, in_use):
        yield


def _check_bindable(key: str, address: str) -> None:
    host, port = parse_address(key, address)
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(
                f"{key}={address} cannot be bound ({exc.strerror}); pick a free address"
            ) from None


def _join_tick_thread(sync: SyncObj) -> None:
    thread = tick_thread(sync)
    if thread is not None:
        thread.join(timeout=5.0)


async def serve_until_signalled(config: CoordinatorConfig) -> None:
    """Run one replica until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await Coordinator(config).serve(stop)
