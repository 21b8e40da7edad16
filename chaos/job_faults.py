"""The scenario's training job as a fault target and as the measure of recovery: where its
tasks run (read through the coordinator), faults on its processes (a SIGKILLed learner rank or
rollout worker, rank 0's disk full), rank 0's curve sampled while the scenario runs, and each
fault's "training again" read off that curve.

Blocking calls on the job (files, signals) run in worker threads; the coordinator is read
through the run's client factory, i.e. through the API proxies like every other client.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

from shoal.chaos.curve import Recovery, Sample, held_to, incarnation_at, progressed_at, thin
from shoal.chaos.errors import FaultError
from shoal.chaos.faults import WriterFileLimit
from shoal.chaos.job_process import ClusterJob
from shoal.chaos.report import FaultRecord
from shoal.chaos.scenario import DISK_LIMIT_BYTES, FaultSpec
from shoal.raft.client import CoordinatorClient
from shoal.raft.errors import RaftError

SAMPLE_PERIOD = 0.5
CURVE_PERIOD = 2.0
RESTARTS_PERIOD = 2.0
# Task states a node "runs": placed there and not ended.
ACTIVE = ("pending", "running")
# How long a read of the job's tasks at a fault's injection is retried (a leader may be in
# the middle of an election caused by an earlier fault) before the fault is not injected.
READ_RETRY_S = 10.0


class JobFaults:
    """Faults on, and measurements of, one ClusterJob of a chaos run."""

    def __init__(
        self,
        job: ClusterJob,
        client: Callable[[], CoordinatorClient],
        nodes: Callable[[], list[str]],
    ) -> None:
        """`client`: a fresh coordinator client (the caller's proxies); `nodes`: the run's
        node daemons."""
        self.job = job
        self._client = client
        self._nodes = nodes
        self.samples: list[Sample] = []
        self.restarts = 0
        self._killed: dict[int, int] = {}
        self._limits: dict[int, WriterFileLimit] = {}

    # -- where the job runs ------------------------------------------------------------------

    async def tasks(self, client: CoordinatorClient) -> list[dict[str, Any]]:
        job_id = await asyncio.to_thread(self.job.job_id)
        if job_id is None:
            raise FaultError("the training job was never submitted")
        return list(await client.tasks(job=job_id))

    async def _current(self) -> list[dict[str, Any]]:
        """The job's tasks now, asked again for up to READ_RETRY_S while the API is unavailable."""
        deadline = time.monotonic() + READ_RETRY_S
        async with self._client() as client:
            while True:
                try:
                    return await self.tasks(client)
                except RaftError as exc:
                    if time.monotonic() >= deadline:
                        raise FaultError(
                            f"the job's tasks could not be read for {READ_RETRY_S:g} s: {exc}"
                        ) from exc
                await asyncio.sleep(0.2)

    async def tasks_on(self, node: str) -> list[tuple[str, int]]:
        """The job's tasks placed on `node` and not ended: (id, generation) each."""
        tasks = await self._current()
        return sorted(
            (str(t["id"]), int(t.get("generation", 0)))
            for t in tasks
            if t.get("node") == node and t["state"] in ACTIVE
        )

    async def learner_nodes(self) -> list[str]:
        """The nodes running the job's learner ranks, rank 0's first."""
        tasks = await self._current()
        ranks = sorted(
            (t["id"], t.get("node")) for t in tasks if "-learner-" in str(t.get("id", ""))
        )
        nodes = [str(node) for _, node in ranks if node]
        if not nodes:
            raise FaultError("no learner rank of the training job is placed on a node")
        return list(dict.fromkeys(nodes))

    async def learner_node(self) -> str:
        node = (await self.learner_nodes())[0]
        if node not in self._nodes():
            raise FaultError(f"learner rank 0 is placed on {node!r}, not a node daemon of the run")
        return node

    # -- watching it -------------------------------------------------------------------------

    async def sample_curve(self, done: asyncio.Event, t0: float) -> None:
        """Rank 0's status every SAMPLE_PERIOD seconds (one file read each) until `done`."""
        while not done.is_set():
            sample = self.job.sample(time.monotonic() - t0, self.restarts)
            if sample is not None:
                self.samples.append(sample)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), SAMPLE_PERIOD)

    async def count_restarts(self, done: asyncio.Event) -> None:
        """The job's task restarts as the coordinator records them (the last count is kept
        while it is slow to answer)."""
        async with self._client() as client:
            while not done.is_set():
                with contextlib.suppress(RaftError, OSError, TimeoutError, FaultError):
                    tasks = await self.tasks(client)
                    self.restarts = sum(int(t.get("restarts", 0)) for t in tasks)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), RESTARTS_PERIOD)

    def measure_progress(
        self, records: Sequence[FaultRecord], restarts_group: Callable[[int], bool]
    ) -> None:
        """Per fault: seconds from injection until training progressed again after the heal
        (from a new learner incarnation when `restarts_group(index)`: the old one is dead)."""
        for i, record in enumerate(records):
            if record.injected_at is None:
                continue
            old = incarnation_at(self.samples, record.injected_at) if restarts_group(i) else None
            after = record.healed_at if record.healed_at is not None else record.injected_at
            at = progressed_at(self.samples, after, old)
            record.progress_s = None if at is None else round(at - record.injected_at, 3)
        hold(records, restarts_group)

    def section(self) -> dict[str, Any]:
        """The report's `training` section: the job and its thinned curve."""
        job = self.job
        return {
            "env": job.cfg.env,
            "ranks": job.cfg.ranks,
            "workers": job.cfg.workers,
            "job": job.job_id(),
            "env_steps": job.summary.get("env_steps"),
            "restarts": max((s.restarts for s in self.samples), default=0),
            "curve": [s.to_dict() for s in thin(self.samples, CURVE_PERIOD)],
        }

    # -- faults on its processes -------------------------------------------------------------

    async def kill_task(self, spec: FaultSpec) -> str:
        index = int(spec.target.removeprefix("rank").removeprefix("w"))
        if spec.kind == "learner-kill":
            pid = await asyncio.to_thread(self.job.learner_pid, index)
            what = f"learner rank {index}"
        else:
            pid = await asyncio.to_thread(self.job.rollout_pid, index)
            what = f"rollout worker {index}"
        self._killed[id(spec)] = pid
        return await asyncio.to_thread(self.job.kill, pid, what)

    async def stop_group(self) -> str:
        """Every learner process of the job gets SIGTERM (ranks still joining their group
        too): the group stops in order (rank 0 writes a final checkpoint) and the leader
        starts it again where it may, as for a group whose node is being drained."""
        pids = await asyncio.to_thread(self.job.live_learners)
        if not pids:
            return "no learner process runs now: the drain alone moves the group"
        said = []
        for pid in pids:
            with contextlib.suppress(FaultError):  # it ended on its own meanwhile
                said.append(await asyncio.to_thread(self.job.kill, pid, "learner", signal.SIGTERM))
        return ", ".join(said) or "every learner process ended before its SIGTERM"

    async def placed_off(self, node: str, within_s: float) -> str:
        """Wait (up to `within_s`) until every learner rank is placed on a node other than
        `node`; what became of them, in words."""
        deadline = time.monotonic() + within_s
        where: list[str] = []
        async with self._client() as client:
            while time.monotonic() < deadline:
                with contextlib.suppress(RaftError, OSError, TimeoutError, FaultError):
                    ranks = [t for t in await self.tasks(client) if "-learner-" in str(t["id"])]
                    where = sorted({str(t.get("node")) for t in ranks})
                    if ranks and all(t.get("node") and t["node"] != node for t in ranks):
                        return f"learner group placed on {where}"
                await asyncio.sleep(0.2)
        return f"learner group not placed off {node} within {within_s:g} s (on {where})"

    async def task_back(self, spec: FaultSpec) -> str:
        """Heal of a task kill is the cluster's: wait (within the bound) for the new process."""
        index = int(spec.target.removeprefix("rank").removeprefix("w"))
        find = self.job.learner_pid if spec.kind == "learner-kill" else self.job.rollout_pid
        deadline = time.monotonic() + spec.recover_within_s
        while time.monotonic() < deadline:
            with contextlib.suppress(FaultError):
                pid = await asyncio.to_thread(find, index)
                if pid != self._killed.get(id(spec)):
                    return f"the cluster started {spec.target} again (pid {pid})"
            await asyncio.sleep(0.2)
        return f"{spec.target} not started again within {spec.recover_within_s:g} s"

    async def disk_full(self, spec: FaultSpec) -> str:
        """Learner rank 0's checkpoint writes fail (RLIMIT_FSIZE on its pid: the unprivileged
        full disk, which needs no mount under a running writer)."""
        pid = await asyncio.to_thread(self.job.learner_pid, 0)
        limit = int(spec.params.get("limit_bytes", DISK_LIMIT_BYTES))
        fault = WriterFileLimit(pid, limit, target=f"learner rank 0 (pid {pid})")
        self._limits[id(spec)] = fault
        return await asyncio.to_thread(fault.inject)

    async def disk_freed(self, spec: FaultSpec) -> str:
        fault = self._limits.pop(id(spec), None)
        return "nothing to heal" if fault is None else await asyncio.to_thread(fault.heal)


def hold(records: Sequence[FaultRecord], restarts_group: Callable[[int], bool]) -> None:
    """Each injected fault's `masked_by` and `held_to_s` (chaos/curve.py `held_to`)."""
    injected = [(i, r) for i, r in enumerate(records) if r.injected_at is not None]
    recoveries = [
        Recovery(float(r.injected_at or 0.0), r.bound_s, r.progress_s, restarts_group(i))
        for i, r in injected
    ]
    for (_, record), (masker, bound) in zip(injected, held_to(recoveries), strict=True):
        masking = None if masker is None else injected[masker][1]
        record.masked_by = None if masking is None else f"{masking.kind} {masking.target}"
        record.held_to_s = bound
