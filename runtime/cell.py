"""`ActorCell`: the runtime half of one actor — mailbox, instance, consumer task, owned tasks.

The consumer calls handlers one message at a time; the mailbox outlives restarts, the
instance does not. Only the guardian and `spawn` change a cell's lifecycle flags. Everything
here runs on the system's loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from shoal.runtime.actor import Actor, ActorContext, call_hook, handler_names
from shoal.runtime.errors import ActorInterrupted, ActorNotFound, NotAnActor, UnknownMethod
from shoal.runtime.local_ref import LocalActorRef
from shoal.runtime.mailbox import Mailbox, MailboxClosed
from shoal.runtime.ref import Reply
from shoal.runtime.supervision import SupervisorNode, SupervisorSpec

if TYPE_CHECKING:
    from shoal.runtime.system import ActorSystem

log = logging.getLogger(__name__)

T = TypeVar("T")

# A consumer with a full mailbox yields to the loop after this many messages, so an actor
# that keeps telling itself cannot starve every other task.
YIELD_EVERY = 256

# (method, args, kwargs, reply future or slot, or None for a tell)
Message = tuple[str, tuple[Any, ...], dict[str, Any], "Reply | None"]


class ActorCell(SupervisorNode):
    """One actor's runtime: mailbox, current instance, consumer task, children and flags.

    `dead` is set once a stop begins (refs then turn messages into dead letters); `restarting`
    while the guardian replaces the instance. Only the guardian and `spawn` change them.
    """

    def __init__(
        self,
        system: ActorSystem,
        name: str,
        parent: SupervisorNode,
        factory: Callable[..., Actor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        mailbox_size: int,
        spec: SupervisorSpec,
    ) -> None:
        super().__init__(spec)
        self.system = system
        self.name = name
        self.parent = parent
        self.mailbox: Mailbox[Message] = Mailbox(mailbox_size)
        self.instance: Actor | None = None
        self.handlers: dict[str, Callable[..., Any]] = {}
        self.sync_handlers: dict[str, Callable[..., Any]] = {}
        self.async_handlers: dict[str, Callable[..., Any]] = {}
        self.dead = False
        self.restarting = False
        self.incarnation = 0
        self.task: asyncio.Task[None] | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        self.started = False
        self.early_failure: Exception | None = None
        self.ref = LocalActorRef(self)
        self._factory = factory
        self._args = args
        self._kwargs = kwargs

    def __repr__(self) -> str:
        return f"<ActorCell {self.name} incarnation={self.incarnation}>"

    @property
    def path(self) -> str:
        address = self.system.address
        return self.name if address is None else f"{address}/{self.name}"

    @property
    def parent_cell(self) -> ActorCell | None:
        parent = self.parent
        return parent if isinstance(parent, ActorCell) else None

    def create_instance(self) -> Actor:
        """Build a fresh instance with the spawn arguments and bind its context and handlers."""
        instance = self._factory(*self._args, **self._kwargs)
        if not isinstance(instance, Actor):
            raise NotAnActor(
                f"spawn({self._factory!r}) built a {type(instance).__name__}, not an Actor; "
                "pass an Actor subclass or a function returning an instance of one"
            )
        names, async_names = handler_names(type(instance))
        instance._context = ActorContext(self)
        self.instance = instance
        self.handlers = {name: getattr(instance, name) for name in names}
        self.sync_handlers = {n: h for n, h in self.handlers.items() if n not in async_names}
        self.async_handlers = {n: h for n, h in self.handlers.items() if n in async_names}
        return instance

    def start(self) -> None:
        """Start the consumer task for the current instance."""
        self.started = True
        task = asyncio.get_running_loop().create_task(self._consume(), name=f"actor:{self.name}")
        self.task = task
        self.system._guardian.consumers[task] = self

    async def halt(self, timeout: float) -> None:
        """Cancel the consumer and the actor's own tasks and wait for them; the message being
        handled is interrupted. Tasks that ignore cancellation past `timeout` are left to the
        system's final sweep."""
        tasks = [task for task in (self.task, *self.tasks) if task is not None and not task.done()]
        self.task = None
        self.tasks.clear()
        if not tasks:
            return
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=timeout)
        stragglers = [task for task in tasks if not task.done()]
        if stragglers:
            log.error(
                "actor %s: %d task(s) ignored cancellation for %ss; abandoning them",
                self.path,
                len(stragglers),
                timeout,
            )
            self.system._guardian.stragglers.update(stragglers)

    def create_task(self, coro: Coroutine[Any, Any, T], name: str | None) -> asyncio.Task[T]:
        """A task owned by the current incarnation: cancelled when the actor stops or restarts,
        and if it raises, the actor fails and its supervisor decides."""
        if self.dead or self.instance is None:
            coro.close()
            raise ActorNotFound(f"actor {self.path} is stopping; it cannot start tasks")
        task = asyncio.get_running_loop().create_task(coro, name=name or f"actor:{self.name}:task")
        self.tasks.add(task)
        task.add_done_callback(functools.partial(self._task_done, self.incarnation))
        return task

    def _task_done(self, incarnation: int, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if not isinstance(error, Exception) or incarnation != self.incarnation or self.dead:
            return
        if self.started:
            self.system._guardian.failed(self, error)
        elif self.early_failure is None:
            self.early_failure = error  # during the first on_start: spawn raises it

    async def stop_instance(self, timeout: float) -> None:
        """Run `on_stop` on the current instance (at most once); errors are logged, not raised."""
        instance = self.instance
        if instance is None:
            return
        self.instance = None
        try:
            async with asyncio.timeout(timeout):
                await call_hook(instance.on_stop)
        except Exception:
            log.exception("actor %s: on_stop raised", self.path)

    async def reincarnate(self, error: Exception, timeout: float) -> None:
        """Replace the instance after a failure and run its `on_restart(error)`."""
        self.incarnation += 1
        self.restarting = False
        self.reset_intensity()
        instance = self.create_instance()
        try:
            async with asyncio.timeout(timeout):
                await call_hook(instance.on_restart, error)
        except BaseException:
            self.instance = None
            raise

    def finish(self) -> None:
        """Close the mailbox, turn what is left into dead letters, and leave the tree."""
        self.dead = True
        dead_letters = self.system.dead_letters
        path = self.path
        for method, _args, _kwargs, reply in self.mailbox.close():
            dead_letters.record(path, method, "left in mailbox at stop")
            if reply is not None and not reply.done():
                reply.set_exception(ActorNotFound(f"actor {path} stopped before handling {method}"))
        if self.parent.children.get(self.name) is self:
            del self.parent.children[self.name]
        self.system._forget(self)
        # Refs outlive their actor; drop what would keep its state and spawn arguments alive.
        self.handlers = {}
        self.sync_handlers = {}
        self.async_handlers = {}
        self._args = ()
        self._kwargs = {}

    def run_now(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], reply: Reply
    ) -> bool:
        """Handle a message at once, in the caller's context, if the actor is idle and the
        handler synchronous; False (nothing done) otherwise. The transport serves remote asks
        through this from its read callback, which saves waking the consumer task (a large
        share of a round trip). Idle means the consumer is parked on an empty mailbox, so
        nothing queued is overtaken and no handler is running: one message at a time still."""
        if self.restarting or self.dead or not self.mailbox.consumer_waiting:
            return False
        handler = self.sync_handlers.get(method)
        if handler is None:
            return False
        try:
            result = handler(*args, **kwargs)
        except asyncio.CancelledError as cancelled:
            self._fail_now(reply, self._inner_cancel(method, cancelled))
            return True
        except Exception as error:
            self._fail_now(reply, error)
            return True
        if not reply.done():
            reply.set_result(result)
        return True

    def _fail_now(self, reply: Reply, error: Exception) -> None:
        """As when a handler fails in the consumer: the consumer takes no more messages (it is
        cancelled while parked, so nothing is interrupted) until the supervisor decides."""
        if self.task is not None:
            self.task.cancel()
        self._fail(reply, error)

    async def _consume(self) -> None:
        mailbox = self.mailbox
        sync_handlers = self.sync_handlers
        async_handlers = self.async_handlers
        guardian = self.system._guardian
        budget = YIELD_EVERY
        task = asyncio.current_task()
        in_flight: Message | None = None
        try:
            while True:
                message = mailbox.get_nowait()
                if message is None:
                    budget = YIELD_EVERY
                    try:
                        await mailbox.wait_nonempty()
                    except MailboxClosed:
                        return  # a handler outlived its actor's stop; nothing is left to do
                    continue
                method, args, kwargs, reply = message
                in_flight = message
                try:
                    handler = sync_handlers.get(method)
                    if handler is not None:
                        result = handler(*args, **kwargs)
                    else:
                        handler = async_handlers.get(method)
                        if handler is None:
                            in_flight = None
                            self._reject(method, reply)
                            continue
                        result = await handler(*args, **kwargs)
                except asyncio.CancelledError as cancelled:
                    if task is not None and task.cancelling():
                        raise
                    in_flight = None
                    self._fail(reply, self._inner_cancel(method, cancelled))
                    return
                except Exception as error:
                    in_flight = None
                    self._fail(reply, error)
                    return
                in_flight = None
                if reply is not None and not reply.done():
                    reply.set_result(result)
                budget -= 1
                if not budget:
                    budget = YIELD_EVERY
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            if in_flight is not None:
                self._interrupted(in_flight)
            raise
        finally:
            if task is not None:
                guardian.consumers.pop(task, None)

    def _reject(self, method: str, reply: Reply | None) -> None:
        """A message queued for a handler the current incarnation's class lacks."""
        self.system.dead_letters.record(self.path, method, "unknown method after restart")
        if reply is not None and not reply.done():
            reply.set_exception(UnknownMethod(f"actor {self.path} has no handler {method!r}"))

    def _inner_cancel(self, method: str, cancelled: asyncio.CancelledError) -> Exception:
        error = ActorInterrupted(
            f"handler {method} of {self.path} was cancelled by something it awaited"
        )
        error.__cause__ = cancelled
        return error

    def _fail(self, reply: Reply | None, error: Exception) -> None:
        if reply is not None and not reply.done():
            reply.set_exception(error)
        self.system._guardian.failed(self, error)

    def _interrupted(self, message: Message) -> None:
        method, _args, _kwargs, reply = message
        self.system.dead_letters.record(self.path, method, "interrupted by stop or restart")
        if reply is not None and not reply.done():
            reply.set_exception(
                ActorInterrupted(
                    f"actor {self.path} was stopped or restarted while handling {method}; "
                    "it may have partly run"
                )
            )
