"""The node agent: registers the node, heartbeats with its health, runs what the coordinator
assigns, reports task states, and drains on request.

The heartbeat reply lists every task placed on this node with its generation (for a task
migrating here make-before-break, its incoming copy's generation), so the agent's watch IS
the heartbeat: each reply is reconciled against what runs here (`plan`, pure), so an
assignment starts within one heartbeat interval. Reports carry the generation the task was
started under; the coordinator refuses a stale one (the task moved), which is then dropped.
Coordinators that do not answer are retried with growing pauses and one log line per try;
the tasks keep running meanwhile, unless the node fences (`fence_after_s`): after that long
without an accepted heartbeat it stops its tasks itself, before the leader declares it dead and
starts them elsewhere, and lets the next accepted reply decide what runs again. Event-loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from shoal.errors import ConfigError
from shoal.node_faults import NodeFaults
from shoal.raft.client import RETRYABLE, CoordinatorClient
from shoal.raft.errors import (
    Conflict,
    Forbidden,
    NotFound,
    RaftError,
    Unauthorized,
    ValidationError,
)
from shoal.raft.metrics import Metrics
from shoal.raft.model import LEARNER_KIND, PROCESS_KINDS
from shoal.runtime.system import ActorSystem
from shoal.task_exchange import NodeExchange, PublishedStateError, host_of, parse_published
from shoal.tasks import ActorTask, ProcessTask, TaskError, TaskSpec, actor_name

log = logging.getLogger("shoal.node")

RunningTask = ActorTask | ProcessTask
T = TypeVar("T")


@dataclass(frozen=True)
class Plan:
    """What to change locally: tasks to start (in the coordinator's order) and ids to stop."""

    start: tuple[TaskSpec, ...] = ()
    stop: tuple[str, ...] = ()


def plan(
    assigned: Sequence[TaskSpec],
    local: Mapping[str, int],
    done: Set[tuple[str, int]],
    accepting: bool = True,
) -> Plan:
    """Reconcile the coordinator's view with this node's.

    `local` maps each task running here to the generation it was started under; `done` holds
    the (task, generation) pairs that already ended here, which are never started again (their
    end may not be reported yet, and the coordinator may still say "running"). A local task
    stops when the coordinator no longer places it here, moved it (newer generation) or no
    longer wants it active. A task starts when it is wanted, not done and not already running at
    its generation; a draining node (`accepting=False`) starts nothing.
    """
    wanted = {t.id: t for t in assigned if t.active}
    stop = tuple(
        task_id
        for task_id, generation in local.items()
        if task_id not in wanted or wanted[task_id].generation != generation
    )
    start = tuple(
        t
        for t in wanted.values()
        if accepting and t.key not in done and local.get(t.id) != t.generation
    )
    return Plan(start, stop)


@dataclass(frozen=True)
class Registration:
    """What this node tells the coordinator about itself (see `register_node`)."""

    node_id: str
    address: str
    cpus: float
    memory: int
    gpus: list[dict[str, Any]] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class AgentConfig:
    heartbeat_s: float = 1.0
    """Heartbeat period; also how long an assignment may wait before it starts."""
    backoff_max_s: float = 5.0
    """Longest pause between tries while no coordinator answers."""
    stop_timeout_s: float = 20.0
    """How long a task may take to stop (a learner rank checkpoints) before SIGKILL."""
    fence_after_s: float | None = None
    """Stop every task here once no heartbeat was accepted for this long; None never does.
    Below the coordinators' dead-after minus a heartbeat, the node's copies are stopped before
    the leader places them elsewhere, so no task runs twice through a partition."""

    def __post_init__(self) -> None:
        for key in ("heartbeat_s", "backoff_max_s", "stop_timeout_s"):
            if not _seconds(getattr(self, key)):
                raise ConfigError(
                    f"{key}={getattr(self, key)!r} is invalid: use a number of seconds > 0"
                )
        if self.fence_after_s is not None and not _seconds(self.fence_after_s):
            raise ConfigError(
                f"fence_after_s={self.fence_after_s!r} is invalid: use a number of seconds > 0 "
                "(below the coordinators' dead-after minus a heartbeat), or leave it unset "
                "to never fence"
            )


def _seconds(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and 0 < value < math.inf


class FenceClock:
    """When a node cut off from the coordinators fences, as a pure function of the times it
    is given (monotonic seconds): once per silence of `after` seconds since the last contact,
    and lifted by the next contact. The agent's clock starts at registration."""

    def __init__(self, after: float, now: float) -> None:
        self.after = after
        self.last = now
        self.fenced = False

    def contact(self, now: float) -> bool:
        """A coordinator accepted a heartbeat at `now`; True when that lifts a fence."""
        self.last = max(self.last, now)
        lifted, self.fenced = self.fenced, False
        return lifted

    def check(self, now: float) -> bool:
        """True exactly when the node must fence now: silent for `after` and not yet fenced."""
        if self.fenced or now < self.last + self.after:
            return False
        self.fenced = True
        return True

    def wait(self, now: float) -> float:
        """How long to sleep before checking again: until the silence would reach `after`; a
        whole `after` while fenced (only a contact, which moves `last`, changes anything)."""
        return self.after if self.fenced else max(0.0, self.last + self.after - now)


class Backoff:
    """Doubling pauses from `first` up to `most`; `reset` after a success."""

    def __init__(self, first: float, most: float) -> None:
        self.first, self.most = first, most
        self.next = first

    def take(self) -> float:
        pause, self.next = self.next, min(self.most, self.next * 2)
        return pause

    def reset(self) -> None:
        self.next = self.first


STOP_FIRST = LEARNER_KIND
FENCED_HELP = "times this node stopped its tasks after --fence-after without an accepted heartbeat"
FIRST_REGISTRATION_PERIOD_S = 0.1
REGISTER_WARN_EVERY_S = 5.0
PUBLISH_POLL_S = 0.1
"""How often the agent looks for a new published.json of its process tasks."""


def registration_backoff(first: bool, most: float) -> Backoff:
    """The pauses between registration tries. The node's first registration is what a
    starting cluster (an embedded `shoal train`) waits on, and its coordinator is usually a
    moment from ready: retry at a steady short period. Later ones (the coordinator forgot us)
    back off, doubling, as the heartbeat does."""
    if first:
        return Backoff(FIRST_REGISTRATION_PERIOD_S, FIRST_REGISTRATION_PERIOD_S)
    return Backoff(FIRST_REGISTRATION_PERIOD_S, most)


def heartbeat_backoff(config: AgentConfig) -> Backoff:
    """The pauses between failed heartbeats: doubling from the period to `backoff_max_s`, or,
    on a fencing node, the period itself (as often as a healthy node sends them): doubling
    pauses could by themselves outlast `fence_after_s` after a leader election and fence a
    node that no coordinator lost."""
    most = config.backoff_max_s if config.fence_after_s is None else config.heartbeat_s
    return Backoff(config.heartbeat_s, most)


def stop_waves(tasks: Sequence[T], kind: Callable[[T], str]) -> list[list[T]]:
    """The order tasks stopped together stop in: learner ranks first, then the rest once
    they are gone. A rank told to stop may be inside an all-reduce that needs one more batch
    from a rollout worker; stopping the workers with it can leave it stuck until SIGKILL,
    without its final checkpoint and ledger. Empty waves are left out."""
    first = [t for t in tasks if kind(t) == STOP_FIRST]
    rest = [t for t in tasks if kind(t) != STOP_FIRST]
    return [wave for wave in (first, rest) if wave]


class NodeAgent:
    """One node's agent. `await run(stop)` registers, then heartbeats and runs tasks until
    `stop` is set, then drains (see `drain`) and returns."""

    def __init__(
        self,
        client: CoordinatorClient,
        registration: Registration,
        system: ActorSystem,
        log_dir: Path,
        config: AgentConfig,
        health: Callable[[], dict[str, Any]] = dict,
        faults: NodeFaults | None = None,
    ) -> None:
        self.client = client
        self.registration = registration
        self.node_id = registration.node_id
        self.system = system
        self.log_dir = log_dir
        self.config = config
        self._health = health
        self.faults = faults
        """Executes the chaos faults the heartbeat replies address to this node."""
        self.running: dict[str, RunningTask] = {}
        self.done: set[tuple[str, int]] = set()
        self.accepting = True
        self._pending: dict[str, tuple[int, str, str]] = {}
        self._report_wake = asyncio.Event()
        self._reports_idle = asyncio.Event()
        self._reports_idle.set()
        self._lock = asyncio.Lock()
        self._assigned: list[TaskSpec] = []
        self._assigned_fresh = asyncio.Event()
        self._watchers: set[asyncio.Task[None]] = set()
        self._registered_once = False
        self._fence: FenceClock | None = None
        self.metrics = Metrics()
        """Heartbeat and task counters for the node's `/metrics` (shoal/node_metrics.py)."""
        self.exchange = NodeExchange(log_dir.parent / "jobs", host_of(registration.address))
        """The files through which process tasks publish state and see their job's peers."""

    @property
    def assigned(self) -> list[TaskSpec]:
        """The tasks the coordinator placed here, as its last heartbeat reply listed them."""
        return list(self._assigned)

    @property
    def fenced(self) -> bool:
        """True while the node has stopped its tasks for want of an accepted heartbeat."""
        return self._fence is not None and self._fence.fenced

    def __repr__(self) -> str:
        state = "accepting" if self.accepting else "draining"
        fenced = " fenced" if self.fenced else ""
        return f"<NodeAgent {self.node_id} {state}{fenced} tasks={len(self.running)}>"

    # -- the loops ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Raises the coordinator's error if it refuses the node for good (wrong token, invalid
        registration); returns at once if `stop` is set before any coordinator answered."""
        registered = asyncio.ensure_future(self.register())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([registered, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not registered.done():
            registered.cancel()
            await asyncio.gather(registered, return_exceptions=True)
            return
        registered.result()
        if self.config.fence_after_s is not None:
            self._fence = FenceClock(self.config.fence_after_s, time.monotonic())
            self.metrics.inc("shoal_node_fenced_total", FENCED_HELP, 0.0)
        loops = [
            asyncio.create_task(self._heartbeat_loop(), name="shoal-heartbeat"),
            asyncio.create_task(self._reconcile_loop(stop), name="shoal-reconcile"),
            asyncio.create_task(self._report_loop(), name="shoal-reports"),
            asyncio.create_task(self._publish_loop(), name="shoal-publish"),
        ]
        if self._fence is not None:
            loops.append(asyncio.create_task(self._fence_loop(self._fence), name="shoal-fence"))
        try:
            await stop.wait()
            await self.drain()
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            if self.faults is not None:
                await self.faults.close()
            await self._stop_all("node agent closed")

    async def register(self) -> None:
        """Register, retrying while no coordinator answers; end a drain left by our last exit.
        A refusal that retrying cannot cure (401, 403, 422) is raised."""
        reg = self.registration
        backoff = registration_backoff(not self._registered_once, self.config.backoff_max_s)
        warned = -math.inf
        while True:
            try:
                node = await self.client.register_node(
                    reg.node_id, reg.address, reg.cpus, reg.memory, reg.gpus, reg.labels
                )
                if node.get("draining"):
                    await self.client.uncordon(reg.node_id)
                log.info("registered node %s at %s", reg.node_id, reg.address)
                self._registered_once = True
                return
            except (Unauthorized, Forbidden, ValidationError) as exc:
                log.error("the coordinators refused node %s for good: %s", reg.node_id, exc)
                raise
            except RaftError as exc:
                pause = backoff.take()
                now = time.monotonic()
                # Steady 0.1 s tries would flood the log while the coordinators are down.
                level = logging.WARNING if now - warned >= REGISTER_WARN_EVERY_S else logging.DEBUG
                warned = now if level == logging.WARNING else warned
                log.log(
                    level,
                    "cannot register node %s: coordinators %s did not accept (%s); retrying in %.1f s",
                    reg.node_id,
                    self.client.urls,
                    exc,
                    pause,
                )
                await asyncio.sleep(pause)

    async def _heartbeat_loop(self) -> None:
        """Heartbeat on time whatever the tasks do: starting and stopping them happens in
        `_reconcile_loop`, so a slow `on_start` never makes the node look suspect."""
        backoff = heartbeat_backoff(self.config)
        while True:
            try:
                reply = await self._timed_heartbeat()
            except NotFound:
                log.warning("the coordinator forgot node %s; registering again", self.node_id)
                await self.register()
                continue
            except RaftError as exc:
                pause = backoff.take()
                log.warning(
                    "heartbeat of %s failed: coordinators %s unreachable (%s); retrying in %.1f s",
                    self.node_id,
                    self.client.urls,
                    exc,
                    pause,
                )
                await asyncio.sleep(pause)
                continue
            backoff.reset()
            if self._fence is not None and self._fence.contact(time.monotonic()):
                log.warning(
                    "node %s unfenced: a heartbeat was accepted; its reply decides what runs here",
                    self.node_id,
                )
            try:
                self._assigned = [
                    spec
                    for record in reply["tasks"]
                    for spec in TaskSpec.copies_for(record, self.node_id)
                ]
                self._assigned_fresh.set()
            except (KeyError, TypeError, ValueError) as exc:
                log.error("a heartbeat reply without a valid task list (%r): %s", exc, reply)
            peers = reply.get("peers")
            if isinstance(peers, dict):
                self.exchange.show_peers(peers, self._task_dirs())
            if self.faults is not None and reply.get("faults"):
                self.faults.offer(reply["faults"], self.running)
            await asyncio.sleep(self.config.heartbeat_s)

    async def _timed_heartbeat(self) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            reply = await self.client.heartbeat(self.node_id, self._health())
        except RaftError as exc:
            self.metrics.inc(
                "shoal_node_heartbeats_failed_total",
                "heartbeats no coordinator accepted, by error",
                error=type(exc).__name__,
            )
            raise
        self.metrics.inc("shoal_node_heartbeats_sent_total", "heartbeats a coordinator accepted")
        self.metrics.observe(
            "shoal_node_heartbeat_seconds",
            "time from sending a heartbeat to its accepted reply",
            time.perf_counter() - started,
        )
        return reply

    async def _reconcile_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._assigned_fresh.wait()
            self._assigned_fresh.clear()
            try:
                await self.reconcile(self._assigned)
            except Exception:  # a bug here must not stop the node from following assignments
                log.exception("reconciling the tasks of %s failed; retrying", self.node_id)

    async def reconcile(self, assigned: Sequence[TaskSpec]) -> None:
        """Bring what runs here in line with `assigned` (the tasks placed on this node). A
        fenced node does nothing: its last list is stale, and the leader may already have
        placed those tasks elsewhere."""
        async with self._lock:
            if self.fenced:
                return
            self._reap_actors()
            local = {task_id: task.spec.generation for task_id, task in self.running.items()}
            todo = plan(assigned, local, self.done, self.accepting)
            stopping = [self.running.pop(task_id) for task_id in todo.stop]
            for task in stopping:
                log.info("stopping task %s: not wanted here any more", task.spec.id)
            for wave in stop_waves(stopping, _kind):
                await asyncio.gather(*(t.stop(self.config.stop_timeout_s) for t in wave))
                log.info("stopped task(s) %s", ", ".join(t.spec.id for t in wave))
                for t in wave:
                    await self._last_words(t)
            for spec in todo.start:
                await self._start(spec)

    def _island(self, gpus: tuple[int, ...]) -> str:
        """The NVLink island of a task's first GPU, or this node for a CPU task: where a
        learner rank shards with its neighbours (learner/parallel.py)."""
        for gpu in self.registration.gpus:
            if gpus and gpu.get("index") == gpus[0] and gpu.get("island"):
                return str(gpu["island"])
        return self.node_id

    def _reap_actors(self) -> None:
        for task_id, task in list(self.running.items()):
            reason = task.exited() if isinstance(task, ActorTask) else None
            if reason is not None:
                del self.running[task_id]
                self._finished(task.spec, "failed", reason)

    async def _start(self, spec: TaskSpec) -> None:
        task: RunningTask
        if spec.kind in PROCESS_KINDS:
            try:
                env = self.exchange.prepare(spec.job_id, actor_name(spec.id), spec.gpus)
            except OSError as exc:
                log.error("cannot prepare the directory of task %s: %s", spec.id, exc)
                self._finished(spec, "failed", f"cannot prepare its directory: {exc}")
                return
            env |= {"SHOAL_NODE_ID": self.node_id, "SHOAL_TASK_ISLAND": self._island(spec.gpus)}
            task = ProcessTask(spec, self.log_dir, env)
        else:
            task = ActorTask(spec, self.system)
        try:
            await task.start()
        except TaskError as exc:
            log.error("task %s generation %d failed to start: %s", spec.id, spec.generation, exc)
            self._finished(spec, "failed", str(exc))
            return
        self.running[spec.id] = task
        log.info("task %s generation %d running (%s)", spec.id, spec.generation, spec.actor)
        self._report(spec, "running", "")
        if isinstance(task, ProcessTask):
            watcher = asyncio.create_task(self._watch(task), name=f"shoal-task-{spec.id}")
            self._watchers.add(watcher)
            watcher.add_done_callback(self._watchers.discard)

    async def _watch(self, task: ProcessTask) -> None:
        reason = await task.wait()
        await self._last_words(task)
        if self.running.get(task.spec.id) is not task:
            return  # stopped by us; whoever stopped it reports (or needs no report)
        del self.running[task.spec.id]
        if reason is None:
            log.info("task %s exited cleanly", task.spec.id)
            self._finished(task.spec, "stopped", "exited with status 0")
        else:
            log.warning("task %s %s", task.spec.id, reason)
            self._finished(task.spec, "failed", reason)

    def _finished(self, spec: TaskSpec, state: str, message: str) -> None:
        self.done.add(spec.key)
        self.metrics.inc(
            "shoal_node_tasks_finished_total",
            "tasks that ended on this node, by the state reported",
            state=state,
            kind=spec.kind,
        )
        self._report(spec, state, message)

    # -- what process tasks publish -----------------------------------------------------------

    def _task_dirs(self) -> dict[Path, str]:
        return {
            self.exchange.directory(t.spec.job_id, actor_name(t.spec.id)): t.spec.job_id
            for t in self.running.values()
            if isinstance(t, ProcessTask)
        }

    async def _publish_loop(self) -> None:
        """Forward what running process tasks publish (their published.json) to the
        coordinators, each new version once; a refused one is logged and not retried."""
        while True:
            await asyncio.sleep(PUBLISH_POLL_S)
            for task in list(self.running.values()):
                if isinstance(task, ProcessTask):
                    await self._forward(task.spec)

    async def _last_words(self, task: RunningTask) -> None:
        """Forward what a process task published just before it exited (rank 0's final
        checkpoint): the publish loop no longer looks at a task once it stopped."""
        if isinstance(task, ProcessTask):
            await self._forward(task.spec)

    async def _forward(self, spec: TaskSpec) -> None:
        directory = self.exchange.directory(spec.job_id, actor_name(spec.id))
        data = self.exchange.fresh(spec.id, spec.generation, directory)
        if data is None:
            return
        try:
            state = parse_published(data)
            await self.client.publish_task_state(spec.id, spec.generation, state)
        except (PublishedStateError, ValueError) as exc:
            log.error("task %s published what cannot be forwarded: %s", spec.id, exc)
        except (NotFound, Conflict) as exc:
            log.info("dropped what task %s published: %s", spec.id, exc)
        except RETRYABLE as exc:
            log.warning("cannot forward what task %s published yet (%s)", spec.id, exc)
            self.exchange.retry(spec.id, spec.generation)
        except RaftError as exc:
            log.error("the coordinator refused what task %s published: %s", spec.id, exc)

    # -- fencing -----------------------------------------------------------------------------

    async def _fence_loop(self, clock: FenceClock) -> None:
        while True:
            await asyncio.sleep(clock.wait(time.monotonic()))
            if not clock.check(time.monotonic()):
                continue
            try:
                await self._fence_tasks(clock)
            except Exception:  # a bug here must not end fencing for the daemon's lifetime
                log.exception("fencing the tasks of %s failed", self.node_id)

    async def _fence_tasks(self, clock: FenceClock) -> None:
        """Stop every task in the drain's waves, without marking them done or reporting them:
        they did not end, the node let go of them. Once a heartbeat is accepted again its
        reply's list decides, as after a daemon restart: what is still placed here at the same
        generation starts again; what the leader moved elsewhere is not listed."""
        async with self._lock:
            if not clock.fenced:
                return  # a heartbeat got through while a reconcile held the lock
            # One that already ended stays for its watcher (or the reaper) to report.
            tasks = [t for t in self.running.values() if _alive(t)]
            for task in tasks:
                del self.running[task.spec.id]
            self.metrics.inc("shoal_node_fenced_total", FENCED_HELP)
            log.warning(
                "node %s fenced: no coordinator accepted a heartbeat for %g s (--fence-after); "
                "stopping its %d task(s) until one does",
                self.node_id,
                clock.after,
                len(tasks),
            )
            for wave in stop_waves(tasks, _kind):
                await asyncio.gather(*(self._let_go(t) for t in wave))

    async def _let_go(self, task: RunningTask) -> None:
        """Stop a task this node fenced. Its watcher finds it no longer running and reports
        nothing; whatever the coordinator believes is settled by the next accepted heartbeat."""
        reason = await self._halt(task)
        log.info(
            "fenced task %s generation %d stopped (%s)",
            task.spec.id,
            task.spec.generation,
            reason or "exited with status 0",
        )

    # -- reports -----------------------------------------------------------------------------

    def _report(self, spec: TaskSpec, state: str, message: str) -> None:
        self._pending[spec.id] = (spec.generation, state, message[:4000])
        self._reports_idle.clear()
        self._report_wake.set()

    async def _report_loop(self) -> None:
        backoff = Backoff(0.1, self.config.backoff_max_s)
        while True:
            await self._report_wake.wait()
            self._report_wake.clear()
            while self._pending:
                task_id, report = next(iter(self._pending.items()))
                if await self._send(task_id, *report):
                    backoff.reset()
                    if self._pending.get(task_id) == report:
                        del self._pending[task_id]
                else:
                    await asyncio.sleep(backoff.take())
            self._reports_idle.set()

    async def _send(self, task_id: str, generation: int, state: str, message: str) -> bool:
        """Report one state; False when it should be retried later."""
        try:
            await self.client.set_task_state(task_id, state, generation, message)
        except (NotFound, Conflict) as exc:
            log.info("dropped the %s report of task %s: %s", state, task_id, exc)
        except RETRYABLE as exc:
            log.warning("cannot report task %s %s yet (%s); will retry", task_id, state, exc)
            return False
        except RaftError as exc:
            log.error("the coordinator refused the %s report of task %s: %s", state, task_id, exc)
        return True

    # -- draining ----------------------------------------------------------------------------

    async def drain(self) -> None:
        """Stop taking tasks, mark the node draining, stop every task (learner ranks get SIGTERM
        and time to checkpoint), then try to deliver the final reports."""
        self.accepting = False
        log.info("draining node %s: %d task(s) to stop", self.node_id, len(self.running))
        try:
            await self.client.drain(self.node_id)
        except RaftError as exc:
            log.warning("could not mark node %s draining: %s", self.node_id, exc)
        await self._stop_all(f"node {self.node_id} drained")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._reports_idle.wait(), self.client.timeout)
        if self._pending:
            log.warning("%d task report(s) were not delivered before exit", len(self._pending))

    async def _stop_all(self, message: str) -> None:
        async with self._lock:
            tasks, self.running = list(self.running.values()), {}
            for wave in stop_waves(tasks, _kind):
                await asyncio.gather(*(self._stop_one(t, message) for t in wave))
            for watcher in list(self._watchers):
                watcher.cancel()
            await asyncio.gather(*self._watchers, return_exceptions=True)

    async def _stop_one(self, task: RunningTask, message: str) -> None:
        reason = await self._halt(task)
        if reason is None or reason.startswith("killed by SIGTERM"):
            self._finished(task.spec, "stopped", message)
        elif reason.startswith("killed by SIGKILL"):
            limit = self.config.stop_timeout_s
            self._finished(task.spec, "failed", f"{message}; killed after {limit:g} s")
        else:
            self._finished(task.spec, "failed", reason)

    async def _halt(self, task: RunningTask) -> str | None:
        """SIGTERM, SIGKILL after the stop timeout; the child's exit (None: status 0)."""
        await task.stop(self.config.stop_timeout_s)
        await self._last_words(task)
        return await task.wait() if isinstance(task, ProcessTask) else None


def _alive(task: RunningTask) -> bool:
    if isinstance(task, ProcessTask):
        return task.process is not None and task.process.returncode is None
    return task.exited() is None


def _kind(task: RunningTask) -> str:
    return task.spec.kind
