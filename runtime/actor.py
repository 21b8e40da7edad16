"""`Actor`, the base class users subclass, and `ActorContext`, its window on the system.

An actor's public methods are its message handlers; `handler_names` decides which those are.
The runtime half that runs an actor is `shoal.runtime.cell.ActorCell`.
"""

from __future__ import annotations

import asyncio
import inspect
import weakref
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from shoal.runtime.errors import ActorError
from shoal.runtime.supervision import SupervisorSpec

if TYPE_CHECKING:
    from shoal.runtime.cell import ActorCell
    from shoal.runtime.ref import ActorRef
    from shoal.runtime.system import ActorSystem

T = TypeVar("T")

DEFAULT_MAILBOX_SIZE = 1024


class ActorContext:
    """An actor's place in its system: its ref, its parent, its children, and how to spawn more.

    Bound to the instance before `on_start`; not available in `__init__`.
    """

    __slots__ = ("_cell",)

    def __init__(self, cell: ActorCell) -> None:
        self._cell = cell

    @property
    def system(self) -> ActorSystem:
        return self._cell.system

    @property
    def name(self) -> str:
        return self._cell.name

    @property
    def ref(self) -> ActorRef:
        return self._cell.ref

    @property
    def parent(self) -> ActorRef | None:
        """The supervising actor, or None for a top-level actor (supervised by the system)."""
        parent = self._cell.parent_cell
        return None if parent is None else parent.ref

    @property
    def children(self) -> list[ActorRef]:
        return [child.ref for child in self._cell.children.values()]

    async def spawn(
        self,
        factory: Callable[..., Actor],
        *args: Any,
        name: str | None = None,
        mailbox_size: int = DEFAULT_MAILBOX_SIZE,
        supervisor: SupervisorSpec | None = None,
        **kwargs: Any,
    ) -> ActorRef:
        """Spawn a child supervised by this actor; see `ActorSystem.spawn`."""
        return await self._cell.system._spawn(
            self._cell, factory, args, kwargs, name, mailbox_size, supervisor
        )

    def create_task(self, coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        """Run `coro` beside the handlers, owned by this actor: cancelled (and awaited) before
        `on_stop` when the actor stops or restarts; if it raises, the actor fails like a
        handler that raised and its supervisor restarts or escalates."""
        return self._cell.create_task(coro, name)

    async def stop(self, ref: ActorRef | None = None) -> None:
        """Stop this actor (no argument) or another local actor, with its children.

        Called from inside the actor being stopped (or one of its descendants) it only
        schedules the stop, since waiting would mean waiting for itself.
        """
        system = self._cell.system
        await system.stop_actor(self._cell.ref if ref is None else ref)


class Actor:
    """Subclass and define public methods (sync or async): each is a message handler.

    Handlers run one at a time. Names starting with `_`, the lifecycle hooks and the
    attributes below are not callable from outside; calling them raises `UnknownMethod`.
    Lifecycle: `on_start` after construction; on a failure the old instance gets `on_stop`
    and a new instance (built by the same factory) gets `on_restart(error)`, which calls
    `on_start` unless overridden; `on_stop` when the actor stops.
    """

    _context: ActorContext | None = None

    @property
    def context(self) -> ActorContext:
        context = self._context
        if context is None:
            raise ActorError(
                f"{type(self).__name__}.context is bound after __init__; use it from on_start on"
            )
        return context

    @property
    def ref(self) -> ActorRef:
        return self.context.ref

    async def spawn(
        self,
        factory: Callable[..., Actor],
        *args: Any,
        name: str | None = None,
        mailbox_size: int = DEFAULT_MAILBOX_SIZE,
        supervisor: SupervisorSpec | None = None,
        **kwargs: Any,
    ) -> ActorRef:
        """Spawn a child this actor supervises (shorthand for `self.context.spawn`)."""
        return await self.context.spawn(
            factory, *args, name=name, mailbox_size=mailbox_size, supervisor=supervisor, **kwargs
        )

    async def on_start(self) -> None:
        """Acquire resources and spawn children; raising here makes `spawn` raise."""

    async def on_stop(self) -> None:
        """Release what `on_start` acquired; children have already stopped."""

    async def on_restart(self, error: Exception) -> None:
        """Called on the fresh instance after a failure; by default the same as `on_start`."""
        await self.on_start()


_RESERVED = frozenset(name for name in dir(Actor) if not name.startswith("_"))


# Per-class cache; weak so classes made at run time (tests, factories) can still be freed.
_HANDLER_NAMES: weakref.WeakKeyDictionary[type[Actor], tuple[frozenset[str], frozenset[str]]] = (
    weakref.WeakKeyDictionary()
)


def handler_names(cls: type[Actor]) -> tuple[frozenset[str], frozenset[str]]:
    """(all handler names, the async ones) of an Actor subclass, computed once per class."""
    cached = _HANDLER_NAMES.get(cls)
    if cached is not None:
        return cached
    found: dict[str, bool] = {}
    base = set(Actor.__mro__)
    for klass in reversed(cls.__mro__):
        if klass in base:
            continue
        for attr, value in vars(klass).items():
            if attr.startswith("_") or attr in _RESERVED:
                continue
            if inspect.isfunction(value):
                found[attr] = inspect.iscoroutinefunction(value)
            else:
                found.pop(attr, None)
    names = frozenset(found), frozenset(n for n, is_async in found.items() if is_async)
    _HANDLER_NAMES[cls] = names
    return names


async def call_hook(hook: Callable[..., Any], *args: Any) -> None:
    """Run a lifecycle hook, sync or async."""
    result = hook(*args)
    if inspect.isawaitable(result):
        await result
