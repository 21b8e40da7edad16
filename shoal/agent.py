"""The node agent: registers the node, heartbeats with its health, runs what the coordinator
assigns, reports task states, and drains on request.

The heartbeat reply lists every task placed on this node with its generation (for a task
migrating here make-before-break, its incoming copy's generation), so the agent's watch IS
the heartbeat: each reply is reconciled against what runs here (`plan`, pure, in
shoal/agent_policy.py with the agent's other decisions), so an assignment starts within one
heartbeat interval. Reports carry the generation the task was
started under; the coordinator refuses a stale one (the task moved), which is then dropped.
Coordinators that do not answer are retried with growing pauses and one log line per try;
the tasks keep running meanwhile, unless the node fences (`fence_after_s`): after that long
without an accepted heartbeat it stops its tasks itself, before the leader declares it dead and
starts them elsewhere, and lets the next accepted reply decide what runs again. Task states
go out through an outbox (shoal/agent_reports.py). Event-loop only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shoal.agent_policy import (
    AgentConfig,
    FenceClock,
    Registration,
    heartbeat_backoff,
    plan,
    registration_backoff,
    stop_waves,
)
from shoal.agent_reports import TaskReports
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
from shoal.raft.model import PROCESS_KINDS
from shoal.runtime.system import ActorSystem
from shoal.task_exchange import NodeExchange, PublishedStateError, host_of, parse_published
from shoal.tasks import ActorTask, ProcessTask, TaskError, TaskSpec, actor_name

log = logging.getLogger("shoal.node")

RunningTask = ActorTask | ProcessTask


FENCED_HELP = "times this node stopped its tasks after --fence-after without an accepted heartbeat"
REGISTER_WARN_EVERY_S = 5.0
PUBLISH_POLL_S = 0.1
"""How often the agent looks for a new published.json of its process tasks."""


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
        self.reports = TaskReports(client, config.backoff_max_s)
        """The states of the tasks here, on their way to the coordinator."""
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
            asyncio.create_task(self.reports.run(), name="shoal-reports"),
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
        self.reports.add(spec, "running", "")
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
        self.reports.add(spec, state, message)

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
        await self.reports.flush(self.client.timeout)
        if self.reports.pending:
            log.warning(
                "%d task report(s) were not delivered before exit", len(self.reports.pending)
            )

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
