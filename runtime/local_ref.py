"""`LocalActorRef`: the ref to an actor in this process, the full implementation of the primitives.

A local ref points at one incarnation-independent cell (the mailbox survives restarts), so a
send is a flag check, a handler-name check and a mailbox append. The transport delivers
remote calls through these same primitives. Used from tasks on the system's loop.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from shoal.runtime.errors import ActorNotFound, AskTimeout, UnknownMethod
from shoal.runtime.mailbox import MailboxClosed
from shoal.runtime.ref import ActorRef, Reply

if TYPE_CHECKING:
    from shoal.runtime.cell import ActorCell


def _expire(reply: asyncio.Future[Any], ref: ActorRef, method: str, timeout: float) -> None:
    if not reply.done():
        reply.set_exception(
            AskTimeout(
                f"ask {ref.path}.{method} got no reply within {timeout}s; the actor is busy or "
                "stuck (it may still handle it); pass a longer ref.ask(timeout=...)"
            )
        )


class LocalActorRef(ActorRef):
    """Equal to another local ref when both point at the same actor (not merely the same name)."""

    def __init__(self, cell: ActorCell) -> None:
        self._cell = cell

    @property
    def path(self) -> str:
        """The bare name, or `shoal://host:port/name` once a transport is attached."""
        return self._cell.path

    @property
    def name(self) -> str:
        return self._cell.name

    @property
    def alive(self) -> bool:
        """False once the actor has begun to stop; it never comes back (a new spawn is a new ref)."""
        return not self._cell.dead

    def __eq__(self, other: object) -> bool:
        # Identity, not path: the path changes when a transport attaches, and a later actor
        # may reuse the name. Never equal to a remote ref, so hashes stay consistent.
        return isinstance(other, LocalActorRef) and other._cell is self._cell

    def __hash__(self) -> int:
        return hash(self._cell.name)

    def _unknown(self, method: str) -> UnknownMethod:
        return UnknownMethod(
            f"actor {self.path} has no handler {method!r}; handlers are the public methods "
            f"its class defines: {', '.join(sorted(self._cell.handlers)) or 'none'}"
        )

    def _dead(self, method: str) -> None:
        self._cell.system.dead_letters.record(self.path, method, "actor stopped")

    def _tell_nowait(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cell = self._cell
        if cell.dead:
            self._dead(method)
            return
        if method not in cell.handlers:
            raise self._unknown(method)
        mailbox = cell.mailbox
        try:
            if not mailbox.offer((method, args, kwargs, None)):
                raise mailbox.full_error()
        except MailboxClosed:
            self._dead(method)

    async def _tell(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cell = self._cell
        if cell.dead:
            self._dead(method)
            return
        if method not in cell.handlers:
            raise self._unknown(method)
        mailbox = cell.mailbox
        try:
            message = (method, args, kwargs, None)
            if not mailbox.offer(message):
                await mailbox.put(message)
        except MailboxClosed:
            self._dead(method)

    def _check_ask(self, method: str) -> ActorCell:
        cell = self._cell
        if cell.dead:
            self._dead(method)
            raise ActorNotFound(f"actor {self.path} has stopped; look it up again or respawn it")
        if method not in cell.handlers:
            raise self._unknown(method)
        return cell

    def _stopped(self, method: str) -> ActorNotFound:
        self._dead(method)
        return ActorNotFound(f"actor {self.path} has stopped; look it up again")

    async def _ask(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float
    ) -> Any:
        cell = self._check_ask(method)
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[Any] = loop.create_future()
        message = (method, args, kwargs, reply)
        mailbox = cell.mailbox
        try:
            if mailbox.offer(message):
                timer = loop.call_later(timeout, _expire, reply, self, method, timeout)
            else:
                deadline = loop.time() + timeout
                await self._put_until(deadline, message, timeout)
                timer = loop.call_at(deadline, _expire, reply, self, method, timeout)
        except MailboxClosed:
            raise self._stopped(method) from None
        try:
            return await reply
        finally:
            timer.cancel()

    def _ask_nowait(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
        reply: Reply,
    ) -> None:
        """Run a synchronous handler at once when the actor is idle, else one mailbox append;
        no task, no future, no timer: `reply`'s owner times it out."""
        cell = self._check_ask(method)
        if cell.run_now(method, args, kwargs, reply):
            return
        mailbox = cell.mailbox
        try:
            if not mailbox.offer((method, args, kwargs, reply)):
                raise mailbox.full_error()
        except MailboxClosed:
            raise self._stopped(method) from None

    async def _ask_queued(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
        reply: Reply,
    ) -> None:
        self._check_ask(method)
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            await self._put_until(deadline, (method, args, kwargs, reply), timeout)
        except MailboxClosed:
            raise self._stopped(method) from None

    async def _put_until(self, deadline: float, message: Any, timeout: float) -> None:
        """Wait for mailbox room, counting the wait against the ask's timeout."""
        try:
            async with asyncio.timeout_at(deadline):
                await self._cell.mailbox.put(message)
        except TimeoutError:
            raise AskTimeout(
                f"ask {self.path} could not even be queued within {timeout}s: the mailbox "
                "stayed full; the actor is overloaded or stuck"
            ) from None
