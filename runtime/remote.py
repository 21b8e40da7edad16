"""The caller's side of the transport: a reconnecting `Peer` per remote process, and
`RemoteRef`, the `ActorRef` whose primitives write frames on that peer's link.

A dropped link fails its pending asks with `LinkClosed` at once (the request may or may not
have run), and the peer reconnects in the background with exponential backoff and jitter.
Sends made while it is down wait up to `connect_timeout` for the new link; `tell_nowait`
raises `LinkClosed` instead of waiting. A wrong token stops the retries: waiting cannot fix it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import aiohttp

from shoal.runtime.errors import AuthenticationFailed, LinkClosed, WireError
from shoal.runtime.link import Link
from shoal.runtime.ref import ActorRef
from shoal.runtime.transport import Transport

logger = logging.getLogger(__name__)


class Peer:
    """Keeps one link to `address` open; created by `Transport.peer`, used on its loop."""

    def __init__(self, address: str, transport: Transport) -> None:
        self.address = address
        self._transport = transport
        self._link: Link | None = None
        self._up = asyncio.Event()
        self._last_error: Exception | None = None
        self._refused: AuthenticationFailed | None = None
        self.connects = 0
        self._closed = False
        self._task = asyncio.create_task(self._maintain(), name=f"shoal-peer {address}")

    def __repr__(self) -> str:
        return f"<Peer {self.address} up={self._up.is_set()} connects={self.connects}>"

    async def _maintain(self) -> None:
        config = self._transport.config
        delay = config.reconnect_initial
        while True:
            try:
                link = await self._transport.open_link(self.address)
            except AuthenticationFailed as exc:
                self._refused = exc
                self._up.set()
                return
            except (OSError, aiohttp.ClientError, WireError, TimeoutError) as exc:
                self._last_error = exc
                logger.debug("connecting to %s failed: %s", self.address, exc)
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(delay * 2, config.reconnect_max)
                continue
            delay = config.reconnect_initial
            self.connects += 1
            self._link = link
            self._up.set()
            await link.wait_closed()
            self._up.clear()
            self._link = None
            self._last_error = link.error

    async def link(self) -> Link:
        """The open link, waiting up to `connect_timeout` for one."""
        if not self._closed and self._refused is None and (self._link is None or self._link.closed):
            self._up.clear()  # the closed link may not have been noticed by _maintain yet
            timeout = self._transport.config.connect_timeout
            try:
                await asyncio.wait_for(self._up.wait(), timeout)
            except TimeoutError:
                raise LinkClosed(
                    f"no link to {self.address} within {timeout}s "
                    f"(last error: {self._last_error}); is that process running?"
                ) from None
        return self.link_nowait()

    def open_link(self) -> Link | None:
        """The link when it is open, else None: the senders' fast path, with no coroutine to
        await when nothing needs waiting for."""
        link = self._link
        return None if link is None or link.closed or self._closed else link

    def link_nowait(self) -> Link:
        if self._closed:
            raise LinkClosed(f"the transport was closed; no more sends to {self.address}")
        if self._refused is not None:
            raise AuthenticationFailed(f"{self.address} refused this process: {self._refused}")
        link = self._link
        if link is None or link.closed:
            raise LinkClosed(
                f"the link to {self.address} is down and reconnecting ({self._last_error})"
            )
        return link

    async def close(self) -> None:
        """Stop reconnecting and close the link; waiting and later senders get LinkClosed."""
        self._closed = True
        self._up.set()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        if self._link is not None:
            await self._link.close()


class RemoteRef(ActorRef):
    """A ref to an actor in another process; `path` is 'shoal://host:port/name'."""

    def __init__(self, path: str, peer: Peer, name: str) -> None:
        super().__init__(path)
        self._peer = peer
        self.name = name

    async def _tell(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        link = self._peer.open_link()
        if link is None:
            link = await self._peer.link()
        await link.tell(self.name, method, args, kwargs)

    def _tell_nowait(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._peer.link_nowait().tell_nowait(self.name, method, args, kwargs)

    async def _ask(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float
    ) -> Any:
        link = self._peer.open_link()
        if link is None:
            link = await self._peer.link()
        return await link.ask(self.name, method, args, kwargs, timeout)
