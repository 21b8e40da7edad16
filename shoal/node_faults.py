"""The node's side of the chaos API: execute each fault addressed to this node exactly once and
report its outcome to the coordinator.

Faults arrive in heartbeat replies (every fault still `requested` for this node). Each outcome
is written to an outcome file in the data directory, a node-kill's before the daemon kills itself, so
a node that comes back never executes a fault again; it only re-sends the outcome it recorded
holds, in case the first report was lost with the process. (A task fault interrupted by the
node's death needs no entry: its task died with the node, and a retry finds nothing to fault.)
Event-loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.errors import ShoalError
from shoal.files import write_atomically
from shoal.raft.client import RETRYABLE, CoordinatorClient
from shoal.raft.errors import RaftError
from shoal.tasks import ActorTask, ProcessTask

log = logging.getLogger("shoal.node")

OUTCOMES_FILE = "chaos-faults.json"
MAX_OUTCOMES = 1000
REPORT_TRIES = 5
KILL_REPORT_TIMEOUT_S = 1.0

RunningTask = ActorTask | ProcessTask
Outcome = tuple[str, str]


class FaultOutcomes:
    """fault id -> (state, message) of every fault this node executed, oldest first, kept in
    a JSON file (written beside, then renamed). A missing or unreadable file starts empty:
    the only risk is executing again a fault older than the file, which the coordinator no
    longer lists once its outcome is recorded."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, Outcome] = _load(path)

    def __contains__(self, fault_id: object) -> bool:
        return fault_id in self.entries

    def record(self, fault_id: str, state: str, message: str) -> None:
        self.entries[fault_id] = (state, message)
        while len(self.entries) > MAX_OUTCOMES:
            del self.entries[next(iter(self.entries))]
        entries = {k: list(v) for k, v in self.entries.items()}
        write_atomically(self.path, json.dumps(entries), durable=True)


def _load(path: Path) -> dict[str, Outcome]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("chaos fault outcomes %s are unreadable (%s); starting a new one", path, exc)
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        str(k): (str(v[0]), str(v[1]))
        for k, v in data.items()
        if isinstance(v, list) and len(v) == 2
    }


@dataclass(frozen=True)
class FaultOrder:
    """One fault as a heartbeat reply lists it (the coordinator's `Fault` record)."""

    id: str
    kind: str
    target: str
    duration_s: float
    generation: int
    gpu: int | None
    xid: int | None
    offset_s: float | None = None

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> FaultOrder:
        return cls(
            str(record["id"]),
            str(record["kind"]),
            str(record["target"]),
            float(record.get("duration_s") or 0.0),
            int(record.get("generation") or 0),
            None if record.get("gpu") is None else int(record["gpu"]),
            None if record.get("xid") is None else int(record["xid"]),
            None if record.get("offset_s") is None else float(record["offset_s"]),
        )


def to_execute(orders: Sequence[FaultOrder], outcomes: FaultOutcomes, busy: set[str]) -> list[str]:
    """Which listed faults to execute now: never one with an outcome or one in progress."""
    return [o.id for o in orders if o.id not in outcomes and o.id not in busy]


class NodeFaults:
    """Executes the faults addressed to one node. `offer(records, running)` after each
    heartbeat; `close()` when the node stops (a pause in progress is ended with SIGCONT)."""

    def __init__(
        self,
        node_id: str,
        client: CoordinatorClient,
        data_dir: Path,
        sim_gpu_state: Path | None,
        clock_file: Path | None = None,
        die: Callable[[], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self.client = client
        self.outcomes = FaultOutcomes(data_dir / OUTCOMES_FILE)
        self.sim_gpu_state = sim_gpu_state
        self.clock_file = clock_file
        """The offset file of the node's chaos clock hook, when it runs with one."""
        self._die = die or _kill_self
        self._busy: set[str] = set()
        self._jobs: set[asyncio.Task[None]] = set()
        self._paused: dict[str, ProcessTask] = {}

    def offer(
        self, records: Sequence[Mapping[str, Any]], running: Mapping[str, RunningTask]
    ) -> None:
        """Start every new fault in `records`; re-send the recorded outcome of the known ones
        (the coordinator still lists them, so their report did not arrive)."""
        try:
            orders = [FaultOrder.from_record(r) for r in records]
        except (KeyError, TypeError, ValueError) as exc:
            log.error("a heartbeat reply with malformed faults (%r): %s", exc, records)
            return
        fresh = set(to_execute(orders, self.outcomes, self._busy))
        for order in orders:
            if order.id in fresh:
                self._spawn(self._execute(order, running.get(order.target)), order.id)
            elif order.id in self.outcomes and order.id not in self._busy:
                state, message = self.outcomes.entries[order.id]
                self._spawn(self._report(order.id, state, message), order.id)

    def _spawn(self, coro: Coroutine[Any, Any, None], fault_id: str) -> None:
        self._busy.add(fault_id)
        job = asyncio.create_task(coro, name=f"shoal-fault-{fault_id}")
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        job.add_done_callback(lambda _: self._busy.discard(fault_id))

    async def close(self) -> None:
        for task in self._paused.values():
            task.signal(signal.SIGCONT)
        for job in list(self._jobs):
            job.cancel()
        await asyncio.gather(*self._jobs, return_exceptions=True)

    # -- execution ---------------------------------------------------------------------------

    async def _execute(self, order: FaultOrder, task: RunningTask | None) -> None:
        log.warning("chaos: executing fault %s (%s of %s)", order.id, order.kind, order.target)
        if order.kind == "node-kill":
            await self._node_kill(order)
            return
        if order.kind == "clock-skew":
            await self._clock_skew(order)
            return
        try:
            if order.kind == "gpu-xid":
                message = await asyncio.to_thread(self._gpu_xid, order)
            else:
                process, pid = self._process_of(order, task)
                sig = signal.SIGKILL if order.kind == "task-kill" else signal.SIGSTOP
                process.signal(sig)
                message = f"{sig.name} sent to task {order.target} (pid {pid})"
        except FaultRefused as exc:
            await self._outcome(order.id, "failed", str(exc))
            return
        await self._outcome(order.id, "injected", message)
        if order.kind == "task-pause":
            await self._resume_after(order, process)

    async def _node_kill(self, order: FaultOrder) -> None:
        message = f"node {self.node_id} (daemon pid {os.getpid()}) SIGKILLed itself"
        self.outcomes.record(order.id, "injected", message)
        with contextlib.suppress(RaftError, TimeoutError):
            await asyncio.wait_for(
                self.client.report_fault(order.id, "injected", message), KILL_REPORT_TIMEOUT_S
            )
        log.warning("chaos: %s", message)
        self._die()

    def _process_of(self, order: FaultOrder, task: RunningTask | None) -> tuple[ProcessTask, int]:
        if task is None or task.spec.generation != order.generation:
            raise FaultRefused(
                f"task {order.target} generation {order.generation} does not run on node "
                f"{self.node_id} (it ended or moved)"
            )
        if not isinstance(task, ProcessTask) or task.process is None:
            raise FaultRefused(
                f"task {order.target} is an actor inside the node daemon, not a process: "
                f"{order.kind} needs a process task (learner-rank, rollout-worker); "
                "fault its node with node-kill instead"
            )
        if task.process.returncode is not None:
            raise FaultRefused(f"task {order.target} already exited")
        return task, task.process.pid

    async def _resume_after(self, order: FaultOrder, task: ProcessTask) -> None:
        self._paused[order.id] = task
        try:
            await asyncio.sleep(order.duration_s)
        finally:
            del self._paused[order.id]
            task.signal(signal.SIGCONT)
        await self._outcome(order.id, "healed", f"SIGCONT after {order.duration_s:g} s")

    def _gpu_xid(self, order: FaultOrder) -> str:
        from shoal.scheduler.errors import HealthError
        from shoal.scheduler.health.simgpu import SimGpuBackend

        if self.sim_gpu_state is None:
            raise FaultRefused(
                f"node {self.node_id} runs no simulated GPUs: gpu-xid raises an XID only "
                "through the simulated backend (shoal node --sim-gpus N), never on real NVML GPUs"
            )
        gpu, xid = order.gpu or 0, order.xid or 79
        try:
            SimGpuBackend.attach(self.sim_gpu_state).raise_xid(gpu, xid)
        except HealthError as exc:
            raise FaultRefused(str(exc)) from None
        return f"XID {xid} raised on simulated GPU {gpu} of node {self.node_id}"

    async def _clock_skew(self, order: FaultOrder) -> None:
        if self.clock_file is None:
            await self._outcome(
                order.id,
                "failed",
                f"node {self.node_id} has no chaos clock hook: start it with --clock HOST:PORT "
                "and SHOAL_CHAOS_CLOCK_FILE=PATH to let clock-skew move its clock",
            )
            return
        offset = order.offset_s or 0.0
        await asyncio.to_thread(_write_offset, self.clock_file, offset)
        await self._outcome(order.id, "injected", f"clock skewed by {offset:+g} s")
        try:
            await asyncio.sleep(order.duration_s)
        finally:
            await asyncio.to_thread(_write_offset, self.clock_file, 0.0)
        await self._outcome(order.id, "healed", f"clock true again after {order.duration_s:g} s")

    # -- outcomes ----------------------------------------------------------------------------

    async def _outcome(self, fault_id: str, state: str, message: str) -> None:
        self.outcomes.record(fault_id, state, message)
        log.warning("chaos: fault %s %s: %s", fault_id, state, message)
        await self._report(fault_id, state, message)

    async def _report(self, fault_id: str, state: str, message: str) -> None:
        """Deliver one outcome, retrying a few times; a later heartbeat that still lists the
        fault as requested brings it back here (`offer`) if every try failed."""
        for attempt in range(REPORT_TRIES):
            try:
                await self.client.report_fault(fault_id, state, message)
                return
            except RETRYABLE as exc:
                log.warning("cannot report fault %s %s yet: %s", fault_id, state, exc)
                await asyncio.sleep(0.2 * 2**attempt)
            except RaftError as exc:
                log.info("the coordinator took no %s report of fault %s: %s", state, fault_id, exc)
                return


class FaultRefused(ShoalError):
    """This node cannot execute the fault; the message is the outcome reported as failed."""


def _write_offset(path: Path, seconds: float) -> None:
    """The chaos clock hook's file (scheduler/health/clock.py OffsetClock), replaced whole."""
    write_atomically(path, repr(seconds), durable=False)


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
