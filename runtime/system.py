"""`ActorSystem`: the registry of named actors, spawning, lookup by name or path, and shutdown.

One system per process, passed explicitly (no global). Actor names are flat and unique in a
system; a path is the bare name until a transport attaches an address, then
`shoal://host:port/name`. Call everything from tasks on the loop the system was started on.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import re
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any

from shoal.errors import ConfigError
from shoal.runtime.actor import DEFAULT_MAILBOX_SIZE, Actor, call_hook
from shoal.runtime.cell import ActorCell
from shoal.runtime.errors import (
    ActorNotFound,
    InvalidActorName,
    InvalidActorPath,
    NameTaken,
    SystemNotRunning,
)
from shoal.runtime.local_ref import LocalActorRef
from shoal.runtime.mailbox import DeadLetters
from shoal.runtime.ref import ActorRef
from shoal.runtime.supervision import FailureRecord, Guardian, SupervisorNode, SupervisorSpec

DEFAULT_HOOK_TIMEOUT = 60.0

_NAME = r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}"
_AUTO_NAME = r"\$[A-Za-z0-9_.\-]{1,199}"
_NAME_RE = re.compile(_NAME)
_HOSTPORT = r"(?:[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}"
_ADDRESS_RE = re.compile(rf"shoal://{_HOSTPORT}")
_PATH_RE = re.compile(rf"(?P<address>shoal://{_HOSTPORT})/(?P<name>{_NAME}|{_AUTO_NAME})")
_BARE_RE = re.compile(rf"{_NAME}|{_AUTO_NAME}")

RemoteResolver = Callable[[str], ActorRef]


def split_path(path: str) -> tuple[str | None, str]:
    """(address or None, name) of a bare name or a `shoal://host:port/name` path."""
    if isinstance(path, str):
        if _BARE_RE.fullmatch(path):
            return None, path
        match = _PATH_RE.fullmatch(path)
        if match:
            return match["address"], match["name"]
    raise InvalidActorPath(
        f"actor path {path!r} is invalid: use a bare name like 'learner' or "
        "'shoal://host:port/learner'"
    )


def check_name(name: str) -> str:
    """A user-chosen actor name: letters, digits, `_.-`, not starting with `$` (auto names)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidActorName(
            f"actor name {name!r} is invalid: use 1-200 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return name


class ActorSystem:
    """Owns every actor and task of this process's actor runtime.

    `async with ActorSystem() as system:` starts it and stops it (children first, every task
    cancelled, left-over messages counted as dead letters). Inspect `dead_letters` and
    `failures` to see what went wrong.
    """

    def __init__(
        self,
        name: str = "shoal",
        *,
        root_supervisor: SupervisorSpec | None = None,
        hook_timeout: float = DEFAULT_HOOK_TIMEOUT,
        dead_letter_records: int = 1000,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"actor system name={name!r} is invalid: use a non-empty string")
        if (
            isinstance(hook_timeout, bool)
            or not isinstance(hook_timeout, int | float)
            or not 0 < hook_timeout < math.inf
        ):
            raise ConfigError(
                f"hook_timeout={hook_timeout!r} is invalid: use a positive number of seconds"
            )
        spec = root_supervisor if root_supervisor is not None else SupervisorSpec()
        if not isinstance(spec, SupervisorSpec):
            raise ConfigError(
                f"root_supervisor={spec!r} is invalid: use a shoal.runtime.SupervisorSpec"
            )
        self.name = name
        self.address: str | None = None
        self.dead_letters = DeadLetters(dead_letter_records)
        self._root = SupervisorNode(spec)
        self._guardian = Guardian(self._root, float(hook_timeout))
        self._names: dict[str, ActorCell] = {}
        self._starting: set[str] = set()
        self._resolver: RemoteResolver | None = None
        self._counter = itertools.count(1)
        self._state = "new"
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"<ActorSystem {self.name} {self._state} actors={len(self._names)}>"

    @property
    def failures(self) -> deque[FailureRecord]:
        """Recent actor failures and what supervision did about each (bounded)."""
        return self._guardian.failures

    @property
    def running(self) -> bool:
        return self._state == "running"

    @property
    def names(self) -> list[str]:
        """Names of the live actors, in spawn order."""
        return list(self._names)

    async def __aenter__(self) -> ActorSystem:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start the guardian task on the running loop; a stopped system cannot start again."""
        if self._state == "running":
            return
        if self._state != "new":
            raise SystemNotRunning(
                f"actor system {self.name} has been stopped; create a new ActorSystem"
            )
        self._guardian.start()
        self._loop = asyncio.get_running_loop()
        self._state = "running"

    async def stop(self) -> None:
        """Stop every actor children-first and end every task the system owns.

        From inside an actor it schedules the stop and returns at once.
        """
        if self._state == "new":
            self._state = "stopped"
            return
        self._state = "stopped"
        await self._guardian.close()
        if not self._guardian.running:
            await self._sweep()

    async def _sweep(self) -> None:
        """Cancel tasks that outlived their actor (code that ignored cancellation)."""
        guardian = self._guardian
        left = [task for task in (*guardian.consumers, *guardian.stragglers) if not task.done()]
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left, timeout=self._guardian.hook_timeout)

    async def spawn(
        self,
        factory: Callable[..., Actor],
        *args: Any,
        name: str | None = None,
        mailbox_size: int = DEFAULT_MAILBOX_SIZE,
        supervisor: SupervisorSpec | None = None,
        **kwargs: Any,
    ) -> ActorRef:
        """Start a top-level actor and return its ref once its `on_start` has run.

        `factory` is an Actor subclass or a function returning an instance; `*args` and
        `**kwargs` go to it (use functools.partial for arguments named like the options
        here). `supervisor` is how the new actor supervises its own children. If `on_start`
        raises, so does `spawn`, and the actor does not exist.
        """
        return await self._spawn(self._root, factory, args, kwargs, name, mailbox_size, supervisor)

    async def _spawn(
        self,
        parent: SupervisorNode,
        factory: Callable[..., Actor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None,
        mailbox_size: int,
        supervisor: SupervisorSpec | None,
    ) -> ActorRef:
        self._check_parent(parent)
        if supervisor is not None and not isinstance(supervisor, SupervisorSpec):
            raise ConfigError(
                f"supervisor={supervisor!r} is invalid: use a shoal.runtime.SupervisorSpec"
            )
        if not callable(factory):
            raise ConfigError(f"spawn factory {factory!r} is invalid: pass an Actor subclass")
        if name is None:
            name = f"${getattr(factory, '__name__', 'actor')}-{next(self._counter)}"
        else:
            check_name(name)
        if name in self._names or name in self._starting:
            raise NameTaken(
                f"an actor named {name!r} already runs in system {self.name}; "
                "pick another name or stop that one first"
            )
        cell = ActorCell(
            self, name, parent, factory, args, kwargs, mailbox_size, supervisor or SupervisorSpec()
        )
        self._starting.add(name)
        try:
            instance = cell.create_instance()
            try:
                await call_hook(instance.on_start)
            except BaseException:
                await self._abort(cell)
                raise
            if cell.dead:
                raise ActorNotFound(f"actor {name!r} was stopped while it was starting")
            if not self._parent_alive(parent):
                await self._abort(cell, run_on_stop=True)
                raise ActorNotFound(f"the parent of {name!r} stopped while it was starting")
            if cell.early_failure is not None:
                await self._abort(cell, run_on_stop=True)
                raise cell.early_failure
        finally:
            self._starting.discard(name)
        self._names[name] = cell
        parent.children[name] = cell
        cell.start()
        return cell.ref

    def _check_parent(self, parent: SupervisorNode) -> None:
        if self._state != "running":
            raise SystemNotRunning(
                f"actor system {self.name} is not running; use `async with ActorSystem()` "
                "or await system.start() before spawning"
            )
        if asyncio.get_running_loop() is not self._loop:
            raise SystemNotRunning(
                f"actor system {self.name} runs on another event loop; spawn from a task on "
                "the loop that started it"
            )
        if not self._parent_alive(parent):
            where = parent.path if isinstance(parent, ActorCell) else "the system"
            raise ActorNotFound(f"cannot spawn under {where}: it is stopping or restarting")

    def _parent_alive(self, parent: SupervisorNode) -> bool:
        if self._state != "running":
            return False
        if isinstance(parent, ActorCell):
            return not parent.dead and not parent.restarting
        return True

    async def _abort(self, cell: ActorCell, run_on_stop: bool = False) -> None:
        """Undo a spawn whose `on_start` failed: stop the children it started, drop its mail."""
        cell.dead = True
        await cell.halt(self._guardian.hook_timeout)
        await self._guardian.stop_children_here(cell)
        if run_on_stop:
            await cell.stop_instance(self._guardian.hook_timeout)
        cell.instance = None
        cell.finish()

    def _forget(self, cell: ActorCell) -> None:
        """Called by a cell as it finishes stopping."""
        if self._names.get(cell.name) is cell:
            del self._names[cell.name]

    def lookup(self, name: str) -> ActorRef:
        """The ref of the live local actor called `name`; raises ActorNotFound."""
        cell = self._names.get(name)
        if cell is None or cell.dead:
            raise ActorNotFound(
                f"no live actor named {name!r} in system {self.name}; "
                f"live actors: {', '.join(self._names) or 'none'}"
            )
        return cell.ref

    def ref(self, path: str) -> ActorRef:
        """A ref from a bare name or `shoal://host:port/name`; remote paths go to the transport."""
        address, name = split_path(path)
        if address is None or address == self.address:
            return self.lookup(name)
        if self._resolver is None:
            raise ActorNotFound(
                f"{path} is in another process, but no transport is attached to actor "
                f"system {self.name}; start the transport before using remote paths"
            )
        return self._resolver(path)

    def attach_remote(self, address: str, resolver: RemoteResolver) -> None:
        """Called by the transport once it listens: this system's address and the remote resolver."""
        if not isinstance(address, str) or not _ADDRESS_RE.fullmatch(address):
            raise InvalidActorPath(
                f"transport address {address!r} is invalid: use 'shoal://host:port'"
            )
        self.address = address
        self._resolver = resolver

    def detach_remote(self) -> None:
        """Called by the transport when it closes: paths become bare names again."""
        self.address = None
        self._resolver = None

    async def stop_actor(self, ref: ActorRef) -> None:
        """Stop a local actor and its children; a no-op for one already stopped."""
        if not isinstance(ref, LocalActorRef) or ref._cell.system is not self:
            raise ActorNotFound(f"{ref!r} is not an actor of system {self.name}")
        if not self._guardian.running:
            return
        await self._guardian.stop(ref._cell)
