"""Run a scenario: the harness (chaos/harness.py) starts a local cluster with fault proxies in
front of it and the scenario's training job; the runner drives the client workload through the
proxies, injects and heals the scenario's faults on schedule (each an object of the registry in
chaos/faultkinds.py), measures each fault's recovery with that fault's probe from the moment of
injection, and hands what it observed to the checker (chaos/checker.py), which evaluates the
invariants and writes the report; then everything is stopped.

A fault counts as recovered if its probe held within `duration + recover_within_s`. For node
faults the run also records the node's liveness and when its tasks ran elsewhere
(chaos/nodefate.py). A fault this machine cannot make (host-delay without netem, any host fault
without hosts) is recorded as unsupported, with why, and counts neither as recovered nor as a
failure. For the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from shoal.chaos import invariants, nodefate
from shoal.chaos.checker import JOB_KINDS, LEARNER_NODE_KINDS, Checker, Observations
from shoal.chaos.cluster import Cluster, Hosts
from shoal.chaos.errors import ChaosError, FaultError, FaultUnsupported
from shoal.chaos.faultkinds import LearnerMove, RunFault, make_fault
from shoal.chaos.harness import Harness
from shoal.chaos.job_faults import SAMPLE_PERIOD
from shoal.chaos.node_mesh import NodeLinks
from shoal.chaos.report import FaultRecord, RunReport
from shoal.chaos.scenario import COORD_KINDS, LEARNERS, FaultSpec, Scenario, parse_file
from shoal.chaos.workload import (
    JOB,
    prepare_registers,
    run_client,
    watch_checkpoints,
    write_checkpoints,
)
from shoal.errors import ShoalError
from shoal.raft.client import CoordinatorClient
from shoal.raft.errors import RaftError

PROBE_PERIOD = 0.05
# Faults after which the run watches what becomes of the node and its tasks.
FATE_KINDS = ("node-kill", "host-kill", "host-cut", *COORD_KINDS)
# How often the job's newest checkpoint in its storage is read (checkpoints_forward).
CHECKPOINT_PERIOD = 1.0
BUILTIN = Path(__file__).parent / "scenarios"


class ChaosRun:
    """One run of one scenario on `cluster`, whose process specs are written but not started
    (the caller makes them: `shoal.local.coordinator_specs` plus node daemon specs of kind
    "node"). Everything it started is stopped when `run` returns or raises."""

    def __init__(
        self,
        scenario: Scenario,
        cluster: Cluster,
        log: Callable[[str], None] | None = None,
        clock_port: int | None = None,
        node_links: NodeLinks | None = None,
        relay_port: int | None = None,
        hosts: Hosts | None = None,
    ) -> None:
        """`clock_port`: the UDP port on 127.0.0.1 the node daemons measure their clock
        against (`shoal node --clock`); the run serves the reference clock there.
        `node_links`: the proxy port through which each node reaches each replica (the
        nodes' `--coordinators` name them, see chaos/node_mesh.py); without it coord-* faults
        are refused. `relay_port`: where the link relay listens, the address the node daemons
        have in `$SHOAL_LINK_RELAY` (their tasks' links dial through it); without it link-*
        faults are refused. `hosts`: the hosts the nodes run on, when each is one of its own
        (then the clock, the nodes' proxies and the relay are on its bridge address, not
        127.0.0.1); without it host-* faults are unsupported."""
        self.scenario = scenario
        self._log = log or (lambda line: None)
        self.harness = Harness(
            scenario, cluster, self._log, clock_port, node_links, relay_port, hosts
        )
        self.seen = Observations()
        self.checker = Checker(self.harness, self.seen)
        self._faulted: Counter[str] = Counter()
        self._t0 = 0.0

    async def run(self) -> RunReport:
        results: dict[str, invariants.Verdict] = {}
        ports: list[tuple[str, int]] = []
        try:
            ports = await self.harness.start()
            async with self.harness.client() as client:
                await prepare_registers(
                    client, self.scenario.keys, self.seen.history, self.seen.stats
                )
            await self.harness.start_job()
            await self._drive()
            await self.harness.restart_downed()
            results.update(await self.checker.stop_job())
            results.update(await self.checker.check_cluster())
        finally:
            await self.harness.stop()
        if "no_leaks" in self.scenario.invariants:
            results["no_leaks"] = self.checker.no_leaks(ports)
        return self.checker.report(results)

    # -- the run -------------------------------------------------------------------------------

    async def _drive(self) -> None:
        async with self.harness.client() as setup:
            await setup.submit_job(spec={"chaos": self.scenario.name}, job_id=JOB)
        clients = [self.harness.client() for _ in range(self.scenario.clients + 2)]
        self._t0 = time.monotonic()
        until = self._t0 + self.scenario.duration_s
        seen = self.seen
        keys, rate = self.scenario.keys, self.scenario.rate
        work = [
            run_client(c, f"c{i}", keys, until, seen.history, seen.stats, i, rate)
            for i, c in enumerate(clients[: self.scenario.clients])
        ]
        work += [
            write_checkpoints(clients[-2], until, seen.checkpoints),
            watch_checkpoints(clients[-1], until, seen.checkpoints),
        ]
        watching = asyncio.Event()
        watchers = [asyncio.create_task(w) for w in self._watchers(watching)]
        self._log(f"workload of {self.scenario.clients} clients for {self.scenario.duration_s:g} s")
        try:
            await asyncio.gather(*work, *(self._fault(spec) for spec in self.scenario.faults))
            if self.harness.job is not None:
                await self._await_progress()
        finally:
            watching.set()
            await asyncio.gather(*watchers, return_exceptions=True)
            for client in clients:
                await client.close()

    def _watchers(self, done: asyncio.Event) -> list[Coroutine[Any, Any, None]]:
        """What samples the training job while the workload runs, until `done`."""
        jobfaults = self.harness.jobfaults
        if jobfaults is None:
            return []
        return [
            jobfaults.sample_curve(done, self._t0),
            jobfaults.count_restarts(done),
            self._watch_stored_checkpoints(done),
        ]

    async def _watch_stored_checkpoints(self, done: asyncio.Event) -> None:
        """The job's newest complete checkpoint in its storage, every CHECKPOINT_PERIOD, until
        `done` (a changed step is recorded; checkpoints_forward checks it never went back)."""
        job, steps = self.harness.job, self.seen.stored_steps
        if job is None:
            return
        while not done.is_set():
            step = await asyncio.to_thread(job.newest_checkpoint)
            if not steps or steps[-1] != step:
                steps.append(step)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), CHECKPOINT_PERIOD)

    async def _await_progress(self) -> None:
        """Keep sampling after the workload until training progressed after every fault, or
        the last fault's bound passed (faults near the end need time to show recovery)."""
        deadline = max(
            (
                self._t0 + r.injected_at + r.bound_s
                for r in self.seen.records
                if r.injected_at is not None
            ),
            default=0.0,
        )
        self._log("waiting for training to progress after the last faults")
        while time.monotonic() < deadline:
            if not self.checker.progress_pending():
                return
            await asyncio.sleep(SAMPLE_PERIOD)

    async def _fault(self, spec: FaultSpec) -> None:
        await asyncio.sleep(max(0.0, self._t0 + spec.at - time.monotonic()))
        record = FaultRecord(
            spec.kind, spec.target, [], bound_s=spec.duration + spec.recover_within_s
        )
        index = len(self.seen.records)
        self.seen.records.append(record)
        try:
            record.processes = await self._resolve(spec)
            if spec.kind in LEARNER_NODE_KINDS and await self._runs_learners(record):
                self.seen.hits_group.add(index)
            fault = make_fault(spec, record.processes, self.harness)
            fates = await self._fates(spec, record.processes)
        except ShoalError as exc:
            self._faulted.subtract(record.processes)
            record.detail = f"not injected: {exc}"
            if isinstance(exc, FaultUnsupported):
                self._unsupported(record, exc)
            return
        await self._inject_and_heal(fault, record, fates)

    async def _inject_and_heal(
        self, fault: RunFault, record: FaultRecord, fates: list[nodefate.NodeFate]
    ) -> None:
        """Inject, hold for the fault's duration, heal, and record how the cluster recovered."""
        spec = fault.spec
        injected = time.monotonic()
        record.injected_at = round(injected - self._t0, 3)
        deadline = injected + spec.duration + spec.recover_within_s
        probe = asyncio.create_task(self._probe(injected, deadline, fault.probe))
        healed_event = asyncio.Event()
        watch = asyncio.create_task(self._watch(fates, injected, deadline, healed_event))
        unsupported: FaultUnsupported | None = None
        try:
            try:
                record.detail = await fault.inject()
            except FaultUnsupported as exc:
                unsupported = exc
                return
            except FaultError as exc:
                record.detail = f"injection failed: {exc}"
            self._log(
                f"t={record.injected_at:.1f} s {spec.kind} {record.processes}: {record.detail}"
            )
            await asyncio.sleep(spec.duration)
        finally:
            if unsupported is not None:
                for task in (probe, watch):
                    task.cancel()
                await asyncio.gather(probe, watch, return_exceptions=True)
                self._faulted.subtract(record.processes)
                self._unsupported(record, unsupported)
            else:
                await self._heal(fault, record, healed_event)
                record.recovery_s = await probe
                await watch
                self._fate_into(record, fates)
                if isinstance(fault, LearnerMove):
                    record.detail += fault.describe_move()
                bound = spec.duration + spec.recover_within_s
                record.recovered = record.recovery_s is not None and record.recovery_s <= bound

    async def _heal(
        self, fault: RunFault, record: FaultRecord, healed_event: asyncio.Event
    ) -> None:
        healed = await fault.heal()
        self._faulted.subtract(record.processes)
        fault.healed_wall = time.time()
        record.healed_at = round(time.monotonic() - self._t0, 3)
        record.detail += "; healed: " + healed
        healed_event.set()

    def _unsupported(self, record: FaultRecord, exc: FaultUnsupported) -> None:
        """Nothing was done: the record says why, and no recovery is measured."""
        record.unsupported = str(exc)
        record.detail = f"unsupported here: {exc}"
        record.injected_at = None
        self._log(f"{record.kind} {record.target}: unsupported here: {exc}")

    async def _fates(self, spec: FaultSpec, nodes: list[str]) -> list[nodefate.NodeFate]:
        """For a node fault, each node and the job's tasks it runs now (read before the
        injection: a dead node's tasks are placed elsewhere soon after)."""
        if spec.kind not in FATE_KINDS:
            return []
        jobfaults = self.harness.jobfaults
        return [
            nodefate.NodeFate(n, [] if jobfaults is None else await jobfaults.tasks_on(n))
            for n in nodes
        ]

    async def _watch(
        self,
        fates: list[nodefate.NodeFate],
        start: float,
        deadline: float,
        healed: asyncio.Event,
    ) -> None:
        if not fates:
            return
        jobfaults = self.harness.jobfaults
        read = None if jobfaults is None else jobfaults.tasks
        async with self.harness.client() as client:
            await nodefate.watch(client, fates, read, start, deadline, healed)

    def _fate_into(self, record: FaultRecord, fates: list[nodefate.NodeFate]) -> None:
        if not fates:
            return
        record.liveness = {f.node: f.liveness for f in fates}
        record.detail += "; " + "; ".join(f.describe() for f in fates)
        if any(f.tasks for f in fates):
            record.tasks_elsewhere_target_s = nodefate.TASKS_ELSEWHERE_TARGET_S
        times = [f.elsewhere_s for f in fates if f.tasks]
        if times and all(t is not None for t in times):
            record.tasks_elsewhere_s = max(t for t in times if t is not None)

    async def _resolve(self, spec: FaultSpec) -> list[str]:
        """The processes `spec` hits, marked as faulted before anything else can run, so two
        faults injected at the same moment never pick the same follower."""
        if spec.kind in JOB_KINDS:
            return [spec.target]
        names = [s.name for s in self.harness.coordinators()]
        if spec.target == LEARNERS:
            chosen = [await self.harness.require_jobfaults().learner_node()]
        elif spec.target == "all":
            chosen = self.harness.nodes() if spec.kind in COORD_KINDS else names
        elif spec.target not in ("leader", "follower"):
            chosen = [spec.target]
        else:
            chosen = [await self._leader_or_follower(spec.target, names)]
        self._faulted.update(chosen)
        return chosen

    async def _leader_or_follower(self, target: str, names: list[str]) -> str:
        leader = await self.harness.leader()
        if target == "leader":
            return leader
        pid = self.harness.cluster.pid
        healthy = [n for n in names if n != leader and not self._faulted[n] and pid(n) is not None]
        if not healthy:
            raise FaultError("no healthy follower to fault")
        return healthy[0]

    async def _runs_learners(self, record: FaultRecord) -> bool:
        jobfaults = self.harness.jobfaults
        if jobfaults is None:
            return False
        learners = await jobfaults.learner_nodes()
        return any(node in learners for node in record.processes)

    async def _probe(
        self,
        start: float,
        deadline: float,
        check: Callable[[CoordinatorClient], Awaitable[bool]],
    ) -> float | None:
        """Seconds from `start` until `check` (through the proxies) is true, or None."""
        async with self.harness.client() as client:
            while time.monotonic() < deadline:
                try:
                    if await check(client):
                        return round(time.monotonic() - start, 3)
                except (RaftError, OSError, TimeoutError, KeyError, TypeError, ValueError):
                    pass
                await asyncio.sleep(PROBE_PERIOD)
        return None


def find_scenario(name_or_path: str) -> Scenario:
    """A scenario file by path, or a shipped one by name (`smoke`, `stress`)."""
    path = Path(name_or_path)
    if not path.is_file():
        path = BUILTIN / f"{name_or_path}.toml"
    if not path.is_file():
        shipped = sorted(p.stem for p in BUILTIN.glob("*.toml"))
        raise ChaosError(f"no scenario file {name_or_path!r}; give a path or one of {shipped}")
    return parse_file(path)


def run_scenario(
    scenario: Scenario,
    cluster: Cluster,
    log: Callable[[str], None] | None = None,
    clock_port: int | None = None,
    node_links: NodeLinks | None = None,
    relay_port: int | None = None,
    hosts: Hosts | None = None,
) -> RunReport:
    """Blocking entry point (CLI, tests): one run in a fresh event loop."""
    run = ChaosRun(scenario, cluster, log, clock_port, node_links, relay_port, hosts)
    return asyncio.run(run.run())
