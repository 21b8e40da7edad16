"""Run a scenario: start a local cluster (coordinator replicas, node daemons) with a fault proxy
in front of each replica's API, at each replica's Raft address and on each node's link to each
replica (chaos/nodenet.py), run the scenario's training job through that cluster
(chaos/trainjob.py, chaos/jobfaults.py), drive the client workload through the proxies, inject
and heal the faults on schedule, then check the invariants and stop everything.

Recovery of a fault is measured by a probe through the same proxies from the moment of
injection: for control-plane faults until a write is acknowledged, for a killed node or one
whose coordinator links were faulted until it heartbeats again after the heal, for a GPU fault
until the node's replicated health shows it, for a clock skew until that health shows the
offset. For the faults that hit the training job it is the time until the job trains again,
read off the curve of rank 0's status. The fault counts as recovered if that came within
`duration + recover_within_s`. For node faults the run also records the node's liveness and
when its tasks ran elsewhere (chaos/nodefate.py). For the event loop; signals, file reads of
the run and the blocking local-cluster calls run in worker threads.

With `hosts` (`shoal chaos run --hosts N`) each node daemon is a host of its own, a network
namespace that reaches this one only through the bridge: the nodes' proxies, the reference
clock and the link relay listen on the bridge address instead of loopback, the API is https
under the cluster's CA (so is every proxied client's), the job's checkpoints go to the storage
every host mounts, and the host-* faults (chaos/hostfaults.py) cut, kill and delay whole hosts.
A fault this machine cannot make (host-delay without netem, any host fault without hosts) is
recorded as unsupported, with why, and counts neither as recovered nor as a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shoal.chaos import invariants, nodefate
from shoal.chaos.cluster import Cluster, Hosts, ProcessSpec
from shoal.chaos.errors import ChaosError, FaultError, FaultUnsupported
from shoal.chaos.faults import ClockSkew, Fault, GpuXid, KillProcess, PauseProcess, XidStorm
from shoal.chaos.history import HistoryRecorder
from shoal.chaos.hostfaults import HostFaults
from shoal.chaos.jobfaults import SAMPLE_PERIOD, JobFaults
from shoal.chaos.linkfaults import LinkFaults
from shoal.chaos.nodenet import NodeLinks, NodeMesh, api_address
from shoal.chaos.proxy import FaultProxy
from shoal.chaos.raftnet import RaftMesh
from shoal.chaos.relay import LinkRelay
from shoal.chaos.report import FaultRecord, RunReport
from shoal.chaos.scenario import (
    COORD_KINDS,
    HOST_KINDS,
    LEARNERS,
    LINK_KINDS,
    MOVE_KINDS,
    NET_KINDS,
    RAFT_KINDS,
    TRAINING_KINDS,
    FaultSpec,
    Scenario,
    parse_file,
)
from shoal.chaos.trainjob import ClusterJob
from shoal.chaos.workload import (
    JOB,
    CheckpointLog,
    WorkloadStats,
    make_client,
    newest_checkpoint,
    prepare_registers,
    run_client,
    watch_checkpoints,
    write_checkpoints,
)
from shoal.errors import ShoalError
from shoal.raft.client import CoordinatorClient
from shoal.raft.errors import RaftError
from shoal.runtime.tls import TlsFiles
from shoal.scheduler.health.clock import ClockServer, serve_clock

PROBE_PERIOD = 0.05
CONVERGE_TIMEOUT = 30.0
XID_CLEAR_TIMEOUT = 30.0
DEFAULT_SKEW_S = 2.5
SKEW_TOLERANCE = 0.25
# Faults on the learners' node: their recovery is the job's too.
LEARNER_NODE_KINDS = ("node-kill", "gpu-xid", "host-kill", *COORD_KINDS, *MOVE_KINDS)
# Faults after which the run watches what becomes of the node and its tasks.
FATE_KINDS = ("node-kill", "host-kill", "host-cut", *COORD_KINDS)
# Faults after which training must come from a new learner incarnation (the old one is dead).
GROUP_RESTARTING = ("learner-kill", "node-kill", "host-kill", *MOVE_KINDS)
# Faults on the training job itself: their recovery is training again, read off the curve.
JOB_KINDS = TRAINING_KINDS + LINK_KINDS
# Faults on a host's network: the node stays alive; their recovery is training again too.
HOST_NET_KINDS = ("host-cut", "host-delay")
# How often the job's newest checkpoint in its storage is read (checkpoints_forward).
CHECKPOINT_PERIOD = 1.0


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
        nodes' `--coordinators` name them, see chaos/nodenet.py); without it coord-* faults
        are refused. `relay_port`: where the link relay listens, the address the node daemons
        have in `$SHOAL_LINK_RELAY` (their tasks' links dial through it); without it link-*
        faults are refused. `hosts`: the hosts the nodes run on, when each is one of its own
        (then the clock, the nodes' proxies and the relay are on its bridge address, not
        127.0.0.1); without it host-* faults are unsupported."""
        self.scenario = scenario
        self.hosts = hosts
        self.listen_host = "127.0.0.1" if hosts is None else hosts.bridge_address
        self.hostfaults = HostFaults(hosts, cluster)
        self._tls = None if cluster.tls_dir is None else TlsFiles(cluster.tls_dir)
        self.relay_port = relay_port
        self.links: LinkFaults | None = None
        self.clock_port = clock_port
        self._clock: ClockServer | None = None
        self.run_dir = cluster.run_dir
        self._log = log or (lambda line: None)
        self.cluster = cluster
        self.proxies: dict[str, FaultProxy] = {}
        self.mesh = RaftMesh(cluster)
        self.node_mesh = NodeMesh(node_links or {}, self.listen_host)
        self.history = HistoryRecorder()
        self.stats = WorkloadStats()
        self.checkpoints = CheckpointLog()
        self.records: list[FaultRecord] = []
        self._faulted: Counter[str] = Counter()
        self._healed_wall: dict[int, float] = {}
        self._t0 = 0.0
        self.job = (
            None
            if scenario.training is None
            else ClusterJob(
                scenario.training,
                cluster.run_dir,
                scenario.duration_s + 600.0,
                None if hosts is None else hosts.storage,
                cluster.tls_dir,
            )
        )
        self.jobfaults = (
            None if self.job is None else JobFaults(self.job, self._client, self._nodes)
        )
        self._hits_group: set[int] = set()
        self._moved_to: dict[int, list[str]] = {}
        self._stored_steps: list[int] = []
        """The job's newest complete checkpoint in its storage, as sampled during the run."""

    async def run(self) -> RunReport:
        results: dict[str, invariants.Verdict] = {}
        ports: list[tuple[str, int]] = []
        try:
            ports = await self._start()
            await self._drive()
            await self._restart_downed()
            results.update(await self._stop_job())
            results.update(await self._check_cluster())
        finally:
            if self.job is not None and self.job.exit_code is None:
                await asyncio.to_thread(self.job.stop)
            await self._stop()
        if "no_leaks" in self.scenario.invariants:
            processes = invariants.leaked_processes(self.run_dir)
            busy = [
                port
                for host in dict.fromkeys(h for h, _ in ports)
                for port in invariants.busy_ports([p for h, p in ports if h == host], host)
            ]
            results["no_leaks"] = invariants.no_leaks(processes, busy)
        return self._report(results)

    # -- set-up and tear-down ----------------------------------------------------------------

    async def _start(self) -> list[tuple[str, int]]:
        specs = self._coordinators()
        shape = (len(specs), len(self._nodes()))
        if shape != (self.scenario.replicas, self.scenario.nodes):
            raise ChaosError(
                f"scenario {self.scenario.name} wants {self.scenario.replicas} replicas and "
                f"{self.scenario.nodes} nodes, the cluster in {self.run_dir} has {shape}"
            )
        ports: list[tuple[str, int]] = []
        loopback, here = "127.0.0.1", self.listen_host
        if any(s.raft_bind is not None for s in specs):
            ports += [(loopback, p) for p in await self.mesh.start(specs)]
        elif any(f.kind in RAFT_KINDS for f in self.scenario.faults):
            raise ChaosError(
                f"scenario {self.scenario.name} partitions Raft links, but the replicas in "
                f"{self.run_dir} bind their advertised Raft addresses; make the specs with "
                "coordinator_specs(..., raft_bind=True)"
            )
        ports += [(here, p) for p in await self._start_node_mesh(specs)]
        ports += [(here, p) for p in await self._start_relay()]
        where = "" if self.hosts is None else f", each node a host of its own on {here}"
        self._log(f"starting {shape[0]} replicas and {shape[1]} nodes in {self.run_dir}{where}")
        if self.clock_port is not None:
            self._clock = await serve_clock(host=here, port=self.clock_port)
        await asyncio.to_thread(self.cluster.start_all)
        await asyncio.to_thread(self.cluster.wait_ready, None, 60.0)
        for spec in specs:
            if spec.api_url is None or spec.raft is None:
                raise ChaosError(f"{spec.name} has no API or Raft address to put a proxy before")
            api = api_address(spec.api_url)
            proxy = await FaultProxy(api).start()
            self.proxies[spec.name] = proxy
            ports += [api, (loopback, int(spec.raft.rsplit(":", 1)[1])), (loopback, proxy.port)]
        nodes = await self._nodes_alive(60.0)
        if not nodes.held:
            raise ChaosError(f"{nodes.detail}; see the node logs in {self.run_dir / 'logs'}")
        async with self._client() as client:
            await prepare_registers(client, self.scenario.keys, self.history, self.stats)
        if self.job is not None:
            self._log(f"starting the training job ({self.job.cfg.env}) through the cluster")
            # Straight to the replicas, never through a faulted proxy: `shoal train` reads its
            # job through consistent reads and rides out a killed or replaying replica itself.
            urls = [s.api_url for s in specs if s.api_url]
            cpus = await self._host_cpus() if self.job.cfg.spread else None
            await asyncio.to_thread(self.job.start, urls, self.run_dir / "api-token", cpus)
            try:
                await asyncio.to_thread(self.job.wait_training)
            except FaultError as exc:
                raise ChaosError(str(exc)) from exc
        return ports

    async def _start_node_mesh(self, specs: list[ProcessSpec]) -> list[int]:
        """The nodes' coordinator-link proxies, before the nodes (they register through them)."""
        links = self.node_mesh.links
        if not links:
            if any(f.kind in COORD_KINDS for f in self.scenario.faults):
                raise ChaosError(
                    f"scenario {self.scenario.name} faults the node<->coordinator links, but "
                    "no node links were planned; pass node_links (chaos.nodenet.plan_links) "
                    "and point each node's --coordinators at coordinator_urls(links, node)"
                )
            return []
        if sorted(links) != sorted(self._nodes()):
            raise ChaosError(
                f"node links are planned for {sorted(links)}, the cluster's nodes are "
                f"{sorted(self._nodes())}"
            )
        return await self.node_mesh.start(specs)

    async def _host_cpus(self) -> float | None:
        """The smallest node's CPUs, as the nodes registered them (what `spread` shares)."""
        async with self._client() as client:
            nodes = await client.nodes()
        cpus = [float(n.get("resources", {}).get("cpus", 0)) for n in nodes]
        return min(cpus) if cpus and min(cpus) > 0 else None

    async def _start_relay(self) -> list[int]:
        """The link relay, before the nodes: their tasks' first links dial through it."""
        if self.relay_port is None:
            if any(f.kind in LINK_KINDS for f in self.scenario.faults):
                raise ChaosError(
                    f"scenario {self.scenario.name} faults rollout<->learner links, but no "
                    "link relay was planned; pass relay_port and give each node daemon "
                    "SHOAL_LINK_RELAY=127.0.0.1:PORT in its environment"
                )
            return []
        reach = () if self.hosts is None else (ipaddress.IPv4Network(self.hosts.subnet),)
        relay = LinkRelay(self.relay_port, listen_host=self.listen_host, reach=reach)
        await relay.start()
        if self.job is not None:
            self.links = LinkFaults(relay, self.job)
            self.hostfaults.relay = relay
        else:
            await relay.close()
        return [self.relay_port]

    def _coordinators(self) -> list[ProcessSpec]:
        return [s for s in self.cluster.specs() if s.kind == "coordinator"]

    def _nodes(self) -> list[str]:
        return [s.name for s in self.cluster.specs() if s.kind == "node"]

    async def _nodes_alive(self, timeout: float) -> invariants.Verdict:
        """Wait until every node daemon is registered and alive; the verdict says which not."""
        wanted = set(self._nodes())
        deadline = time.monotonic() + timeout
        missing = sorted(wanted)
        async with self._client() as client:
            while wanted:
                try:
                    alive = {n["id"] for n in await client.nodes(liveness="alive")}
                except (RaftError, OSError, TimeoutError):
                    alive = set()
                missing = sorted(wanted - alive)
                if not missing or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.2)
        if missing:
            return invariants.Verdict(False, f"nodes not alive after {timeout:g} s: {missing}")
        return invariants.Verdict(True, f"{len(wanted)} nodes alive")

    async def _stop(self) -> None:
        try:
            for proxy in self.proxies.values():
                await proxy.close()
            await self.mesh.close()
            await self.node_mesh.close()
            if self.links is not None:
                await self.links.relay.close()
        finally:
            await asyncio.to_thread(self.cluster.stop_all)
            if self._clock is not None:
                self._clock.close()

    def _urls(self) -> list[str]:
        """The replicas' API through their proxies (https where the API is: the proxies pass
        TLS through, and the cluster's certificate names 127.0.0.1)."""
        schemes = {s.name: (s.api_url or "http:").split(":", 1)[0] for s in self._coordinators()}
        return [f"{schemes[name]}://127.0.0.1:{p.port}" for name, p in self.proxies.items()]

    def _client(self) -> CoordinatorClient:
        return make_client(self._urls(), self.cluster.token, self._tls)

    # -- the run -------------------------------------------------------------------------------

    async def _drive(self) -> None:
        async with self._client() as setup:
            await setup.submit_job(spec={"chaos": self.scenario.name}, job_id=JOB)
        clients = [self._client() for _ in range(self.scenario.clients + 2)]
        self._t0 = time.monotonic()
        until = self._t0 + self.scenario.duration_s
        work = [
            run_client(c, f"c{i}", self.scenario.keys, until, self.history, self.stats, i)
            for i, c in enumerate(clients[: self.scenario.clients])
        ]
        work += [
            write_checkpoints(clients[-2], until, self.checkpoints),
            watch_checkpoints(clients[-1], until, self.checkpoints),
        ]
        watching = asyncio.Event()
        watchers = (
            [
                asyncio.create_task(self.jobfaults.sample_curve(watching, self._t0)),
                asyncio.create_task(self.jobfaults.count_restarts(watching)),
                asyncio.create_task(self._watch_stored_checkpoints(watching)),
            ]
            if self.jobfaults is not None
            else []
        )
        self._log(f"workload of {self.scenario.clients} clients for {self.scenario.duration_s:g} s")
        try:
            await asyncio.gather(*work, *(self._fault(spec) for spec in self.scenario.faults))
            if self.job is not None:
                await self._await_progress()
        finally:
            watching.set()
            await asyncio.gather(*watchers, return_exceptions=True)
            for client in clients:
                await client.close()

    async def _watch_stored_checkpoints(self, done: asyncio.Event) -> None:
        """The job's newest complete checkpoint in its storage, every CHECKPOINT_PERIOD, until
        `done` (a changed step is recorded; checkpoints_forward checks it never went back)."""
        if self.job is None:
            return
        while not done.is_set():
            step = await asyncio.to_thread(self.job.newest_checkpoint)
            if not self._stored_steps or self._stored_steps[-1] != step:
                self._stored_steps.append(step)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), CHECKPOINT_PERIOD)

    async def _await_progress(self) -> None:
        """Keep sampling after the workload until training progressed after every fault, or
        the last fault's bound passed (faults near the end need time to show recovery)."""
        deadline = max(
            (
                self._t0 + r.injected_at + r.bound_s
                for r in self.records
                if r.injected_at is not None
            ),
            default=0.0,
        )
        self._log("waiting for training to progress after the last faults")
        while time.monotonic() < deadline:
            self._measure_progress()
            if all(r.progress_s is not None for r in self.records if r.injected_at is not None):
                return
            await asyncio.sleep(SAMPLE_PERIOD)

    async def _fault(self, spec: FaultSpec) -> None:
        await asyncio.sleep(max(0.0, self._t0 + spec.at - time.monotonic()))
        record = FaultRecord(
            spec.kind, spec.target, [], bound_s=spec.duration + spec.recover_within_s
        )
        self.records.append(record)
        try:
            record.processes = await self._resolve(spec)
            if spec.kind in LEARNER_NODE_KINDS and await self._runs_learners(spec, record):
                self._hits_group.add(len(self.records) - 1)
            faults = self._faults(spec, record.processes)
            fates = await self._fates(spec, record.processes)
        except ShoalError as exc:
            self._faulted.subtract(record.processes)
            record.detail = f"not injected: {exc}"
            if isinstance(exc, FaultUnsupported):
                self._unsupported(record, exc)
            return
        injected = time.monotonic()
        record.injected_at = round(injected - self._t0, 3)
        deadline = injected + spec.duration + spec.recover_within_s
        check = self._check(spec, record)
        probe = asyncio.create_task(self._probe(injected, deadline, check))
        healed_event = asyncio.Event()
        watch = asyncio.create_task(self._watch(fates, injected, deadline, healed_event))
        unsupported: FaultUnsupported | None = None
        try:
            try:
                record.detail = "; ".join([await f() for f in faults["inject"]])
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
                await self._heal(spec, record, faults["heal"], healed_event)
                record.recovery_s = await probe
                await watch
                self._fate_into(record, fates)
                self._moved_into(spec, record)
                bound = spec.duration + spec.recover_within_s
                record.recovered = record.recovery_s is not None and record.recovery_s <= bound

    async def _heal(
        self,
        spec: FaultSpec,
        record: FaultRecord,
        heals: list[Callable[[], Any]],
        healed_event: asyncio.Event,
    ) -> None:
        healed = [await f() for f in heals]
        self._faulted.subtract(record.processes)
        self._healed_wall[id(spec)] = time.time()
        record.healed_at = round(time.monotonic() - self._t0, 3)
        record.detail += "; healed: " + "; ".join(healed)
        healed_event.set()

    def _unsupported(self, record: FaultRecord, exc: FaultUnsupported) -> None:
        """Nothing was done: the record says why, and no recovery is measured."""
        record.unsupported = str(exc)
        record.detail = f"unsupported here: {exc}"
        record.injected_at = None
        self._log(f"{record.kind} {record.target}: unsupported here: {exc}")

    def _moved_into(self, spec: FaultSpec, record: FaultRecord) -> None:
        if spec.kind in MOVE_KINDS:
            where = self._moved_to.get(id(spec))
            record.detail += (
                f"; learner group running on {where}"
                if where
                else "; the learner group never ran on another node"
            )

    async def _fates(self, spec: FaultSpec, nodes: list[str]) -> list[nodefate.NodeFate]:
        """For a node fault, each node and the job's tasks it runs now (read before the
        injection: a dead node's tasks are placed elsewhere soon after)."""
        if spec.kind not in FATE_KINDS:
            return []
        return [
            nodefate.NodeFate(n, [] if self.jobfaults is None else await self.jobfaults.tasks_on(n))
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
        read = None if self.jobfaults is None else self.jobfaults.tasks
        async with self._client() as client:
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

    def _faults(self, spec: FaultSpec, names: list[str]) -> dict[str, list[Callable[[], Any]]]:
        """Coroutine functions that inject and heal `spec` on the processes `names`."""
        if spec.kind in HOST_KINDS:
            return self._host_faults(spec, names[0])
        if spec.kind in MOVE_KINDS:
            return {
                "inject": [functools.partial(self._drain, names[0])],
                "heal": [functools.partial(self._undrain, spec, names[0])],
            }
        if spec.kind == "gpu-xid":
            storm = XidStorm(self._gpu_fault(spec, names[0]))
            uncordon = functools.partial(self._uncordon, names[0])
            return {"inject": [storm.start], "heal": [storm.stop, uncordon]}
        if spec.kind == "disk-full":
            jobfaults = self._jobfaults()
            full = functools.partial(jobfaults.disk_full, spec)
            return {"inject": [full], "heal": [functools.partial(jobfaults.disk_freed, spec)]}
        if spec.kind in TRAINING_KINDS:
            return {
                "inject": [functools.partial(self._jobfaults().kill_task, spec)],
                "heal": [functools.partial(self._jobfaults().task_back, spec)],
            }
        if spec.kind in LINK_KINDS:
            links = self._links()
            return {
                "inject": [functools.partial(links.inject, spec)],
                "heal": [functools.partial(links.heal, spec)],
            }
        if spec.kind in COORD_KINDS:
            return {
                "inject": [functools.partial(self._coord, spec, names)],
                "heal": [functools.partial(self._coord_heal, names)],
            }
        if spec.kind in NET_KINDS:
            proxies = [self.proxies[n] for n in names]
            return {"inject": [lambda: self._net(spec, proxies)], "heal": [lambda: _heal(proxies)]}
        if spec.kind in RAFT_KINDS:
            return {
                "inject": [functools.partial(_now, self._raft_fault(spec), names[0])],
                "heal": [functools.partial(_now, self.mesh.heal, names[0])],
            }
        if spec.kind == "clock-skew":
            skew = self._clock_fault(spec, names[0])
            return {
                "inject": [functools.partial(asyncio.to_thread, skew.inject)],
                "heal": [functools.partial(asyncio.to_thread, skew.heal)],
            }
        made: list[Fault] = [
            PauseProcess(self.cluster, n) if spec.kind == "pause" else KillProcess(self.cluster, n)
            for n in names
        ]
        return {
            "inject": [functools.partial(asyncio.to_thread, f.inject) for f in made],
            "heal": [functools.partial(asyncio.to_thread, f.heal) for f in made],
        }

    def _host_faults(self, spec: FaultSpec, node: str) -> dict[str, list[Callable[[], Any]]]:
        if self.hosts is None:
            raise FaultUnsupported(
                "the cluster's nodes share this host's network; run the scenario with "
                "`shoal chaos run SCENARIO --hosts N` (root) to fault hosts"
            )
        faults = self.hostfaults
        if spec.kind == "host-cut":
            return {
                "inject": [functools.partial(faults.cut, spec, node)],
                "heal": [functools.partial(faults.uncut, spec, node)],
            }
        if spec.kind == "host-kill":
            return {
                "inject": [functools.partial(faults.kill, node)],
                "heal": [functools.partial(faults.revive, node)],
            }
        return {
            "inject": [functools.partial(faults.delay, spec, node)],
            "heal": [functools.partial(faults.undelay, node)],
        }

    async def _drain(self, node: str) -> str:
        """Move the learner group off its node as an operator does: drain the node through
        the API (cordoned: nothing new lands there; the restarts it causes are not counted
        against the job), then stop the group in order (SIGTERM to every rank; rank 0 writes
        its final checkpoint). The leader starts the group again on another node's GPUs,
        from that checkpoint. (The balancer would move a group off a draining node by itself
        at a checkpoint boundary, but not while it sees every other node busy, as every host
        on one shared machine is under a chaos run's load.)"""
        async with self._client() as client:
            await client.drain(node)
        return f"{node} drained through the API; " + await self._jobfaults().stop_group()

    async def _undrain(self, spec: FaultSpec, node: str) -> str:
        """Back into service once the group is placed elsewhere (or the bound passed)."""
        placed = await self._jobfaults().placed_off(node, spec.recover_within_s)
        async with self._client() as client:
            await client.uncordon(node)
        return f"{placed}; {node} uncordoned"

    async def _coord(self, spec: FaultSpec, nodes: list[str]) -> str:
        if spec.kind == "coord-reset":
            return "; ".join(self.node_mesh.reset(n) for n in nodes)
        faults = spec.net_faults()
        return "; ".join(self.node_mesh.degrade(n, faults) for n in nodes)

    async def _coord_heal(self, nodes: list[str]) -> str:
        return "; ".join(self.node_mesh.heal(n) for n in nodes)

    def _raft_fault(self, spec: FaultSpec) -> Callable[[str], str]:
        """What the mesh does to every Raft link of the replica it is given."""
        if spec.kind == "raft-partition":
            return self.mesh.isolate
        faults = spec.net_faults()
        if spec.kind == "raft-delay":
            return functools.partial(
                self.mesh.delay, delay_s=faults.delay_s, jitter_s=faults.jitter_s
            )
        return functools.partial(
            self.mesh.loss, p=faults.loss, mode=faults.loss_mode, stall_s=faults.stall_s
        )

    def _clock_fault(self, spec: FaultSpec, node: str) -> ClockSkew:
        offset = float(spec.params.get("offset_s", DEFAULT_SKEW_S))
        return ClockSkew(clock_file(self.run_dir, node), offset, target=node)

    def _gpu_fault(self, spec: FaultSpec, node: str) -> GpuXid:
        state = self.run_dir / "nodes" / node / "simgpu.json"
        gpu, xid = int(spec.params.get("gpu", 0)), int(spec.params.get("xid", 79))
        return GpuXid(state, gpu, xid, target=f"{node} GPU {gpu}")

    def _check(self, spec: FaultSpec, record: FaultRecord) -> Callable[[CoordinatorClient], Any]:
        """What "recovered" means for this fault: the API takes writes again; a killed node
        re-registered after its restart; a GPU fault shows in the node's replicated health."""

        async def writable(client: CoordinatorClient) -> bool:
            await client.add_event("chaos_probe", "probe write")
            return True

        async def node_back(client: CoordinatorClient) -> bool:
            healed = self._healed_wall.get(id(spec))
            if healed is None:
                return False
            for name in record.processes:
                node = await client.node(name)
                if node["last_heartbeat"] < healed:
                    return False
            return True

        async def xid_seen(client: CoordinatorClient) -> bool:
            node = await client.node(record.processes[0])
            return int(node["health"].get("summary", {}).get("xid_errors", 0)) > 0

        async def skew_seen(client: CoordinatorClient) -> bool:
            node = await client.node(record.processes[0])
            offset_ms = node["health"].get("summary", {}).get("clock_offset_ms")
            wanted = -1000.0 * float(spec.params.get("offset_s", DEFAULT_SKEW_S))
            return offset_ms is not None and abs(offset_ms - wanted) <= SKEW_TOLERANCE * abs(wanted)

        async def group_moved(client: CoordinatorClient) -> bool:
            ranks = [
                t for t in await self._jobfaults().tasks(client) if "-learner-" in str(t["id"])
            ]
            where = sorted({str(t.get("node")) for t in ranks})
            if not ranks or any(t["state"] != "running" for t in ranks):
                return False
            if set(where) & set(record.processes):
                return False
            self._moved_to[id(spec)] = where
            return True

        checks = {
            "node-kill": node_back,
            "host-kill": node_back,
            "gpu-xid": xid_seen,
            "clock-skew": skew_seen,
            "learner-move": group_moved,
        }
        checks.update({kind: node_back for kind in COORD_KINDS})
        return checks.get(spec.kind, writable)

    async def _net(self, spec: FaultSpec, proxies: list[FaultProxy]) -> str:
        if spec.kind == "api-reset":
            cut = sum(p.reset_connections() for p in proxies)
            return f"reset {cut} client connections"
        faults = spec.net_faults()
        for proxy in proxies:
            proxy.set_faults(faults)
        return f"proxies {[p.port for p in proxies]}: {faults.to_dict()}"

    async def _resolve(self, spec: FaultSpec) -> list[str]:
        """The processes `spec` hits, marked as faulted before anything else can run, so two
        faults injected at the same moment never pick the same follower."""
        names = [s.name for s in self._coordinators()]
        if spec.kind in JOB_KINDS:
            return [spec.target]
        if spec.target == LEARNERS:
            chosen = [await self._learner_node()]
        elif spec.target == "all":
            chosen = self._nodes() if spec.kind in COORD_KINDS else names
        elif spec.target not in ("leader", "follower"):
            chosen = [spec.target]
        else:
            leader = await self._leader()
            healthy = [
                n
                for n in names
                if n != leader and not self._faulted[n] and self.cluster.pid(n) is not None
            ]
            if spec.target == "leader":
                chosen = [leader]
            elif healthy:
                chosen = [healthy[0]]
            else:
                raise FaultError("no healthy follower to fault")
        self._faulted.update(chosen)
        return chosen

    async def _leader(self) -> str:
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            views = await asyncio.to_thread(self._views)
            leaders = Counter(v["leader_id"] for v in views.values() if v and v.get("leader_id"))
            if leaders:
                return str(leaders.most_common(1)[0][0])
            await asyncio.sleep(0.1)
        raise FaultError("no replica knows a leader to fault")

    def _views(self, digest: bool = False) -> dict[str, dict[str, Any] | None]:
        """Each running replica's own GET /v1/cluster (None when down or silent)."""
        views: dict[str, dict[str, Any] | None] = {}
        for spec in self._coordinators():
            views[spec.name] = None
            if spec.api_url and self.cluster.pid(spec.name):
                query = "?digest=true" if digest else ""
                with contextlib.suppress(OSError, ValueError):
                    views[spec.name] = self.cluster.get(f"{spec.api_url}/v1/cluster{query}")
        return views

    async def _probe(
        self, start: float, deadline: float, check: Callable[[CoordinatorClient], Any]
    ) -> float | None:
        """Seconds from `start` until `check` (through the proxies) is true, or None."""
        async with self._client() as client:
            while time.monotonic() < deadline:
                try:
                    if await check(client):
                        return round(time.monotonic() - start, 3)
                except (RaftError, OSError, TimeoutError, KeyError, TypeError, ValueError):
                    pass
                await asyncio.sleep(PROBE_PERIOD)
        return None

    # -- checks after the run ------------------------------------------------------------------

    async def _restart_downed(self) -> None:
        for spec in self.cluster.specs():
            if self.cluster.pid(spec.name) is None:
                await asyncio.to_thread(self.cluster.start, spec.name)
        await asyncio.to_thread(self.cluster.wait_ready, None, 60.0)

    async def _stop_job(self) -> dict[str, invariants.Verdict]:
        """Stop the training job in order and check what it recorded across all its learner
        incarnations; each fault's recovery of training is read off the curve."""
        if self.job is None:
            return {}
        self._log("stopping the training job")
        await asyncio.to_thread(self.job.stop)
        restarted = any(
            r.injected_at is not None and self._kills_learners(i)
            for i, r in enumerate(self.records)
        )
        results = await asyncio.to_thread(self.job.verdicts, restarted)
        self._measure_training()
        results["training_progress"] = invariants.training_progress(
            [
                {
                    "kind": r.kind,
                    "target": r.target,
                    "progress_s": r.progress_s,
                    "bound_s": r.bound_s,
                }
                for r in self.records
                if r.injected_at is not None
            ]
        )
        return results

    def _measure_progress(self) -> None:
        if self.jobfaults is not None:
            self.jobfaults.measure_progress(self.records, self._kills_learners)

    def _kills_learners(self, index: int) -> bool:
        """Whether fault `index` killed the learner ranks (a learner kill, or a kill of the
        node they ran on): training must then come from a new incarnation."""
        kind = self.records[index].kind
        return kind == "learner-kill" or (kind in GROUP_RESTARTING and index in self._hits_group)

    def _measure_training(self) -> None:
        """Once, at the end: for the faults that hit the job, training's recovery is theirs
        (for a node fault, the later of it and the node's own recovery check)."""
        self._measure_progress()
        for i, record in enumerate(self.records):
            if record.injected_at is None:
                continue
            if record.kind in JOB_KINDS + HOST_NET_KINDS or i in self._hits_group:
                probe = record.recovery_s if record.kind not in JOB_KINDS else 0.0
                record.recovery_s = (
                    None
                    if record.progress_s is None or probe is None
                    else max(probe, record.progress_s)
                )
                record.recovered = (
                    record.recovery_s is not None and record.recovery_s <= record.bound_s
                )

    # -- the training job ------------------------------------------------------------------------

    def _jobfaults(self) -> JobFaults:
        if self.jobfaults is None:
            raise FaultError("the scenario has no [training] job to fault")
        return self.jobfaults

    def _links(self) -> LinkFaults:
        if self.links is None:
            raise FaultError("the run has no link relay (or no [training] job) to fault links on")
        return self.links

    async def _learner_node(self) -> str:
        return await self._jobfaults().learner_node()

    async def _runs_learners(self, spec: FaultSpec, record: FaultRecord) -> bool:
        if self.jobfaults is None:
            return False
        learners = await self.jobfaults.learner_nodes()
        return any(node in learners for node in record.processes)

    async def _uncordon(self, node: str) -> str:
        """After an XID storm the leader has drained the node; once its health shows no XID
        in the current window, put it back into service so later faults find room."""
        deadline = time.monotonic() + XID_CLEAR_TIMEOUT
        async with self._client() as client:
            while time.monotonic() < deadline:
                with contextlib.suppress(RaftError, OSError, TimeoutError, KeyError):
                    record = await client.node(node)
                    if not int(record["health"].get("summary", {}).get("xid_errors", 0)):
                        await client.uncordon(node)
                        return f"{node} uncordoned"
                await asyncio.sleep(0.5)
        return f"{node} still reports XIDs after {XID_CLEAR_TIMEOUT:g} s; left cordoned"

    async def _check_cluster(self) -> dict[str, invariants.Verdict]:
        wanted = self.scenario.invariants
        results: dict[str, invariants.Verdict] = {}
        if "linearizable" in wanted:
            results["linearizable"] = await asyncio.to_thread(
                invariants.linearizable, self.history.operations()
            )
        if "digests_equal" in wanted:
            results["digests_equal"] = await self._converged()
        if "checkpoints_forward" in wanted:
            async with self._client() as client:
                final = await newest_checkpoint(client)
            results["checkpoints_forward"] = invariants.checkpoints_forward(
                self.checkpoints.acknowledged, self.checkpoints.observed, final
            )
            if self.job is not None:
                stored = await asyncio.to_thread(self.job.checkpoints_forward, self._stored_steps)
                results["checkpoints_forward"] = invariants.both(
                    results["checkpoints_forward"], stored, "the training job's"
                )
        if "nodes_alive" in wanted:
            results["nodes_alive"] = await self._nodes_alive(30.0)
        if "recovered" in wanted:
            results["recovered"] = invariants.recovered([asdict(r) for r in self.records])
        return results

    async def _converged(self) -> invariants.Verdict:
        """Replicas keep applying the leader's own writes (liveness, health), so poll until
        one round of views agrees."""
        deadline = time.monotonic() + CONVERGE_TIMEOUT
        verdict = invariants.Verdict(False, "no views")
        while time.monotonic() < deadline:
            verdict = invariants.digests_equal(await asyncio.to_thread(self._views, True))
            if verdict.held:
                return verdict
            await asyncio.sleep(0.2)
        return verdict

    def _report(self, results: dict[str, invariants.Verdict]) -> RunReport:
        ops = self.history.operations()
        return RunReport(
            scenario=self.scenario.name,
            run_dir=str(self.run_dir),
            faults=self.records,
            invariants={k: results[k] for k in self.scenario.invariants if k in results},
            operations=len(ops),
            workload={
                "acknowledged": self.stats.acknowledged,
                "unknown_outcome": self.stats.unknown,
                "refused": self.stats.refused,
                "checkpoints_acknowledged": len(self.checkpoints.acknowledged),
                "sample_errors": self.stats.errors[:5],
            },
            training=self._training_section(),
        )

    def _training_section(self) -> dict[str, Any]:
        return {} if self.jobfaults is None else self.jobfaults.section()


async def _now(action: Callable[[str], str], name: str) -> str:
    """A proxy action as an injector: proxies are touched only on the event loop's thread."""
    return action(name)


async def _heal(proxies: list[FaultProxy]) -> str:
    for proxy in proxies:
        proxy.heal()
    return f"proxies {[p.port for p in proxies]} healed"


BUILTIN = Path(__file__).parent / "scenarios"


def clock_file(run_dir: Path, node: str) -> Path:
    """The offset file node `node`'s clock reads (its SHOAL_CHAOS_CLOCK_FILE): a clock-skew
    fault writes the skew there."""
    return run_dir / "nodes" / node / "clock-offset"


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
