"""Supervision as in Erlang/OTP: a strategy, a restart intensity, and the guardian that applies them.

Every failure, restart and stop of a system runs in one guardian task, in order. Actors'
consumer tasks only report a failure and end; they never restart or stop themselves. One
writer for the tree means a one_for_all restart, an escalation and a concurrent stop can
never interleave halfway through each other.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shoal.errors import ConfigError
from shoal.runtime.errors import Escalated

if TYPE_CHECKING:
    from shoal.runtime.cell import ActorCell

log = logging.getLogger(__name__)

DEFAULT_FAILURE_RECORDS = 1000


class Strategy(enum.Enum):
    """Which children a supervisor restarts when one of them fails."""

    ONE_FOR_ONE = "one_for_one"
    ONE_FOR_ALL = "one_for_all"


@dataclass(frozen=True)
class SupervisorSpec:
    """How an actor supervises its children (and the system its top-level actors).

    strategy: one_for_one restarts only the failed child; one_for_all restarts every child,
        for children that only make sense together.
    max_restarts: restarts allowed within `within` seconds before the supervisor gives up and
        fails itself (escalates); 0 means escalate on the first failure.
    within: the sliding window, in seconds, that `max_restarts` counts over.
    """

    strategy: Strategy | str = Strategy.ONE_FOR_ONE
    max_restarts: int = 3
    within: float = 5.0

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, Strategy):
            try:
                object.__setattr__(self, "strategy", Strategy(self.strategy))
            except ValueError:
                valid = ", ".join(s.value for s in Strategy)
                raise ConfigError(
                    f"supervisor.strategy={self.strategy!r} is invalid: use one of {valid}"
                ) from None
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int):
            raise ConfigError(
                f"supervisor.max_restarts={self.max_restarts!r} is invalid: use a whole number >= 0"
            )
        if self.max_restarts < 0:
            raise ConfigError(
                f"supervisor.max_restarts={self.max_restarts!r} is invalid: use a whole number >= 0"
            )
        if (
            isinstance(self.within, bool)
            or not isinstance(self.within, int | float)
            or not 0 < self.within < float("inf")
        ):
            raise ConfigError(
                f"supervisor.within={self.within!r} is invalid: use a positive number of seconds"
            )


class RestartIntensity:
    """Sliding-window restart budget: allows at most `max_restarts` within any `within` seconds."""

    __slots__ = ("_max", "_times", "_within")

    def __init__(self, max_restarts: int, within: float) -> None:
        self._max = max_restarts
        self._within = within
        self._times: deque[float] = deque()

    def allow(self, now: float) -> bool:
        """Record a restart at `now` (monotonic seconds) if the budget has room; else False."""
        times = self._times
        while times and times[0] <= now - self._within:
            times.popleft()
        if len(times) >= self._max:
            return False
        times.append(now)
        return True


@dataclass(frozen=True, slots=True)
class FailureRecord:
    """One actor failure and what its supervisor did about it.

    action: "restart" (one_for_one), "restart_all" (one_for_all), "escalate" (the supervisor
    fails in turn) or "stop" (the system gave up on a top-level actor and stopped its subtree).
    """

    path: str
    error: BaseException
    action: str
    at: float


class SupervisorNode:
    """What every supervisor has: a spec, a restart budget and its children in start order."""

    def __init__(self, spec: SupervisorSpec) -> None:
        self.spec = spec
        self.intensity = RestartIntensity(spec.max_restarts, spec.within)
        self.children: dict[str, ActorCell] = {}

    def reset_intensity(self) -> None:
        """A restarted supervisor is a new incarnation and starts with a fresh budget."""
        self.intensity = RestartIntensity(self.spec.max_restarts, self.spec.within)


@dataclass(slots=True)
class _Op:
    kind: str
    cell: ActorCell | None
    error: Exception | None
    incarnation: int
    done: asyncio.Future[None] | None


class Guardian:
    """Applies supervision and stops actors, one operation at a time, in its own task.

    `failed` is called from actors' consumer tasks; `stop` and `close` from any task on the loop.
    """

    def __init__(
        self,
        root: SupervisorNode,
        hook_timeout: float,
        keep_failures: int = DEFAULT_FAILURE_RECORDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self.hook_timeout = hook_timeout
        self.failures: deque[FailureRecord] = deque(maxlen=keep_failures)
        self.consumers: dict[asyncio.Task[None], ActorCell] = {}
        # tasks of stopped actors that ignored cancellation; the system's final sweep ends them
        self.stragglers: set[asyncio.Task[Any]] = set()
        self._clock = clock
        self._ops: asyncio.Queue[_Op] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="shoal-guardian")

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def failed(self, cell: ActorCell, error: Exception) -> None:
        """A handler of `cell` raised; its consumer task has ended and waits for a decision."""
        self._ops.put_nowait(_Op("fail", cell, error, cell.incarnation, None))

    async def stop(self, cell: ActorCell) -> None:
        """Stop `cell` and its subtree; returns when done, or at once when called from inside it."""
        if asyncio.current_task() is self._task or not self.running:
            await self._stop(cell)
            return
        done = asyncio.get_running_loop().create_future()
        self._ops.put_nowait(_Op("stop", cell, None, cell.incarnation, done))
        if not self._called_from_subtree(cell):
            await done

    async def stop_children_here(self, cell: ActorCell) -> None:
        """Stop `cell`'s children in the calling task; for a spawn whose `on_start` failed, whose
        cell nobody else has seen, so waiting for the guardian could wait on the caller itself."""
        await self._stop_children(cell)

    async def close(self) -> None:
        """Stop every actor children-first, then end the guardian task.

        Returns when that is done, or at once when called from an actor or a hook."""
        task = self._task
        if task is None or task.done():
            return
        self._ops.put_nowait(_Op("close", None, None, 0, None))
        if asyncio.current_task() is not task and not self._called_from_subtree(None):
            await asyncio.wait({task})

    def _called_from_subtree(self, cell: ActorCell | None) -> bool:
        """Whether the current task is the consumer of `cell` or of a descendant (None: any)."""
        current = asyncio.current_task()
        node = self.consumers.get(current) if current is not None else None
        if cell is None:
            return node is not None
        while node is not None:
            if node is cell:
                return True
            node = node.parent_cell
        return False

    async def _run(self) -> None:
        try:
            while True:
                op = await self._ops.get()
                try:
                    if op.cell is None:
                        await self._stop_children(self.root)
                        return
                    if op.kind == "stop":
                        await self._stop(op.cell)
                    elif op.incarnation == op.cell.incarnation and op.error is not None:
                        await self._on_failure(op.cell, op.error)
                except Exception:
                    log.exception("guardian: %s of %s failed", op.kind, op.cell)
                finally:
                    if op.done is not None and not op.done.done():
                        op.done.set_result(None)
        finally:
            self._release_waiters()

    def _release_waiters(self) -> None:
        """After close, nothing is left to stop or restart: let anyone still waiting go."""
        while not self._ops.empty():
            op = self._ops.get_nowait()
            if op.done is not None and not op.done.done():
                op.done.set_result(None)

    def _record(self, cell: ActorCell, error: BaseException, action: str) -> None:
        self.failures.append(FailureRecord(cell.path, error, action, time.time()))

    async def _on_failure(self, cell: ActorCell, error: Exception) -> None:
        if cell.dead:
            return
        parent = cell.parent
        supervisor = cell.parent_cell
        if supervisor is not None and supervisor.dead:
            await self._stop(cell)
            return
        if parent.intensity.allow(self._clock()):
            if parent.spec.strategy is Strategy.ONE_FOR_ALL:
                self._record(cell, error, "restart_all")
                targets = [c for c in parent.children.values() if not c.dead]
            else:
                self._record(cell, error, "restart")
                targets = [cell]
            log.warning("actor %s failed (%r); restarting", cell.path, error)
            await self._restart(targets, error)
            return
        spec = parent.spec
        if supervisor is None:
            self._record(cell, error, "stop")
            log.error(
                "actor %s failed (%r) with the system's restart budget (%d within %ss) spent; "
                "stopping it and its children",
                cell.path,
                error,
                spec.max_restarts,
                spec.within,
            )
            await self._stop(cell)
            return
        self._record(cell, error, "escalate")
        escalated = Escalated(
            f"child {cell.path} failed ({error!r}) with the restart budget of "
            f"{supervisor.path} spent ({spec.max_restarts} restarts within {spec.within}s), "
            "so the supervisor fails in turn"
        )
        escalated.__cause__ = error
        await self._on_failure(supervisor, escalated)

    async def _restart(self, targets: list[ActorCell], error: Exception) -> None:
        """OTP order: stop the targets last-started first, then start them in start order."""
        for cell in reversed(targets):
            cell.restarting = True
            await cell.halt(self.hook_timeout)
            await self._stop_children(cell)
            await cell.stop_instance(self.hook_timeout)
        for cell in targets:
            if cell.dead or not cell.restarting:
                continue
            try:
                await cell.reincarnate(error, self.hook_timeout)
            except Exception as again:
                log.warning("actor %s failed to restart (%r)", cell.path, again)
                await self._on_failure(cell, again)
                continue
            cell.start()

    async def _stop_children(self, node: SupervisorNode) -> None:
        for child in reversed(list(node.children.values())):
            await self._stop(child)

    async def _stop(self, cell: ActorCell) -> None:
        if cell.dead:
            return
        cell.dead = True
        await cell.halt(self.hook_timeout)
        await self._stop_children(cell)
        await cell.stop_instance(self.hook_timeout)
        cell.finish()
