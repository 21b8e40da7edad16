"""The registry of fault kinds a scenario can schedule: each kind is an object that injects the
fault, heals it, and probes whether the cluster recovered from it (the `Fault` interface of
chaos/faults.py, made asynchronous and given a probe). `make_fault` picks the class for a
scenario's fault; the runner (chaos/runner.py) only schedules, times and records them.

What "recovered" means (`probe`, through the same proxies as the workload, from the moment of
injection): for control-plane faults a write is acknowledged; for a killed node or one whose
coordinator links were faulted, it heartbeats again after the heal; for a GPU fault the node's
replicated health shows it; for a clock skew that health shows the offset; for a learner move
the group runs on other nodes. The faults on the training job are also measured by the time
until the job trains again, read off the curve (chaos/job_faults.py).

Injection and heals touch proxies on the event loop's thread; blocking faults (signals, files)
run in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable

from shoal.chaos.errors import FaultUnsupported
from shoal.chaos.faults import ClockSkew, Fault, GpuXid, KillProcess, PauseProcess, XidStorm
from shoal.chaos.harness import Harness, clock_file
from shoal.chaos.scenario import (
    COORD_KINDS,
    HOST_KINDS,
    LINK_KINDS,
    MOVE_KINDS,
    NET_KINDS,
    RAFT_KINDS,
    TRAINING_KINDS,
    FaultSpec,
)
from shoal.raft.client import CoordinatorClient
from shoal.raft.errors import RaftError

XID_CLEAR_TIMEOUT = 30.0
DEFAULT_SKEW_S = 2.5
SKEW_TOLERANCE = 0.25


class RunFault:
    """One scheduled fault on the processes `names` it was resolved to. Subclasses inject and
    heal; the probe is the one its kind recovers by (`PROBES`), a control-plane write unless
    the kind says otherwise."""

    def __init__(self, spec: FaultSpec, names: list[str], harness: Harness) -> None:
        self.spec, self.names, self.harness = spec, names, harness
        self.healed_wall: float | None = None
        """Wall-clock time of the heal (a node is back once it heartbeats after it)."""

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def target(self) -> str:
        return self.spec.target

    async def inject(self) -> str:
        raise NotImplementedError

    async def heal(self) -> str:
        raise NotImplementedError

    async def probe(self, client: CoordinatorClient) -> bool:
        """Whether the cluster has recovered from this fault, asked through `client`."""
        return await PROBES.get(self.kind, writable)(self, client)


# -- probes --------------------------------------------------------------------------------------


async def writable(fault: RunFault, client: CoordinatorClient) -> bool:
    await client.add_event("chaos_probe", "probe write")
    return True


async def node_back(fault: RunFault, client: CoordinatorClient) -> bool:
    if fault.healed_wall is None:
        return False
    for name in fault.names:
        node = await client.node(name)
        if node["last_heartbeat"] < fault.healed_wall:
            return False
    return True


async def xid_seen(fault: RunFault, client: CoordinatorClient) -> bool:
    node = await client.node(fault.names[0])
    return int(node["health"].get("summary", {}).get("xid_errors", 0)) > 0


async def skew_seen(fault: RunFault, client: CoordinatorClient) -> bool:
    node = await client.node(fault.names[0])
    offset_ms = node["health"].get("summary", {}).get("clock_offset_ms")
    wanted = -1000.0 * float(fault.spec.params.get("offset_s", DEFAULT_SKEW_S))
    return offset_ms is not None and abs(offset_ms - wanted) <= SKEW_TOLERANCE * abs(wanted)


PROBES = {
    "node-kill": node_back,
    "host-kill": node_back,
    "gpu-xid": xid_seen,
    "clock-skew": skew_seen,
    **{kind: node_back for kind in COORD_KINDS},
}


# -- the kinds -----------------------------------------------------------------------------------


class ProcessFaults(RunFault):
    """kill, pause, node-kill: a signal to each process (restarted or continued on heal)."""

    def __init__(self, spec: FaultSpec, names: list[str], harness: Harness) -> None:
        super().__init__(spec, names, harness)
        cluster = harness.cluster
        self._made: list[Fault] = [
            PauseProcess(cluster, n) if spec.kind == "pause" else KillProcess(cluster, n)
            for n in names
        ]

    async def inject(self) -> str:
        return "; ".join([await asyncio.to_thread(f.inject) for f in self._made])

    async def heal(self) -> str:
        return "; ".join([await asyncio.to_thread(f.heal) for f in self._made])


class ApiNetFault(RunFault):
    """api-*: the replicas' API proxies degrade, cut or reset the clients' connections."""

    def __init__(self, spec: FaultSpec, names: list[str], harness: Harness) -> None:
        super().__init__(spec, names, harness)
        self._proxies = [harness.proxies[n] for n in names]

    async def inject(self) -> str:
        if self.kind == "api-reset":
            cut = sum(p.reset_connections() for p in self._proxies)
            return f"reset {cut} client connections"
        faults = self.spec.net_faults()
        for proxy in self._proxies:
            proxy.set_faults(faults)
        return f"proxies {[p.port for p in self._proxies]}: {faults.to_dict()}"

    async def heal(self) -> str:
        for proxy in self._proxies:
            proxy.heal()
        return f"proxies {[p.port for p in self._proxies]} healed"


class RaftLinkFault(RunFault):
    """raft-*: every Raft link of one replica isolated, delayed or made lossy."""

    def __init__(self, spec: FaultSpec, names: list[str], harness: Harness) -> None:
        super().__init__(spec, names, harness)
        self._action = self._mesh_action()

    async def inject(self) -> str:
        return self._action(self.names[0])

    def _mesh_action(self) -> Callable[[str], str]:
        """What the mesh does to every Raft link of the replica it is given."""
        mesh = self.harness.mesh
        if self.kind == "raft-partition":
            return mesh.isolate
        faults = self.spec.net_faults()
        if self.kind == "raft-delay":
            return functools.partial(mesh.delay, delay_s=faults.delay_s, jitter_s=faults.jitter_s)
        return functools.partial(
            mesh.loss, p=faults.loss, mode=faults.loss_mode, stall_s=faults.stall_s
        )

    async def heal(self) -> str:
        return self.harness.mesh.heal(self.names[0])


class CoordLinkFault(RunFault):
    """coord-*: the nodes' links to the replicas degraded or reset."""

    async def inject(self) -> str:
        mesh = self.harness.node_mesh
        if self.kind == "coord-reset":
            return "; ".join(mesh.reset(n) for n in self.names)
        faults = self.spec.net_faults()
        return "; ".join(mesh.degrade(n, faults) for n in self.names)

    async def heal(self) -> str:
        return "; ".join(self.harness.node_mesh.heal(n) for n in self.names)


class GpuXidStorm(RunFault):
    """gpu-xid: XID events on a node's simulated GPU until healed; then the node, drained by
    the leader, is put back into service once its health shows no XID in the current window
    (so later faults find room)."""

    def __init__(self, spec: FaultSpec, names: list[str], harness: Harness) -> None:
        super().__init__(spec, names, harness)
        node = names[0]
        state = harness.run_dir / "nodes" / node / "simgpu.json"
        gpu, xid = int(spec.params.get("gpu", 0)), int(spec.params.get("xid", 79))
        self._storm = XidStorm(GpuXid(state, gpu, xid, target=f"{node} GPU {gpu}"))

    async def inject(self) -> str:
        return await self._storm.start()

    async def heal(self) -> str:
        return "; ".join([await self._storm.stop(), await self._uncordon(self.names[0])])

    async def _uncordon(self, node: str) -> str:
        deadline = time.monotonic() + XID_CLEAR_TIMEOUT
        async with self.harness.client() as client:
            while time.monotonic() < deadline:
                with contextlib.suppress(RaftError, OSError, TimeoutError, KeyError):
                    record = await client.node(node)
                    if not int(record["health"].get("summary", {}).get("xid_errors", 0)):
                        await client.uncordon(node)
                        return f"{node} uncordoned"
                await asyncio.sleep(0.5)
        return f"{node} still reports XIDs after {XID_CLEAR_TIMEOUT:g} s; left cordoned"


class ClockSkewFault(RunFault):
    """clock-skew: an offset in the file the node's clock reads."""

    def __init__(self, spec: FaultSpec, names: list[str], harness: Harness) -> None:
        super().__init__(spec, names, harness)
        offset = float(spec.params.get("offset_s", DEFAULT_SKEW_S))
        node = names[0]
        self._skew = ClockSkew(clock_file(harness.run_dir, node), offset, target=node)

    async def inject(self) -> str:
        return await asyncio.to_thread(self._skew.inject)

    async def heal(self) -> str:
        return await asyncio.to_thread(self._skew.heal)


class TrainingTaskKill(RunFault):
    """learner-kill, rollout-kill: a task of the training job killed; heal waits for it back."""

    def __init__(self, spec: FaultSpec, names: list[str], harness: Harness) -> None:
        super().__init__(spec, names, harness)
        self._jobfaults = harness.require_jobfaults()

    async def inject(self) -> str:
        return await self._jobfaults.kill_task(self.spec)

    async def heal(self) -> str:
        return await self._jobfaults.task_back(self.spec)


class JobDiskFull(TrainingTaskKill):
    """disk-full: the job's checkpoint writes fail until healed."""

    async def inject(self) -> str:
        return await self._jobfaults.disk_full(self.spec)

    async def heal(self) -> str:
        return await self._jobfaults.disk_freed(self.spec)


class JobLinkFault(RunFault):
    """link-*: the rollout<->learner links through the link relay."""

    def __init__(self, spec: FaultSpec, names: list[str], harness: Harness) -> None:
        super().__init__(spec, names, harness)
        self._links = harness.require_links()

    async def inject(self) -> str:
        return await self._links.inject(self.spec)

    async def heal(self) -> str:
        return await self._links.heal(self.spec)


class LearnerMove(RunFault):
    """learner-move: move the learner group off its node as an operator does: drain the node
    through the API (cordoned: nothing new lands there; the restarts it causes are not counted
    against the job), then stop the group in order (SIGTERM to every rank; rank 0 writes its
    final checkpoint). The leader starts the group again on another node's GPUs, from that
    checkpoint. (The balancer would move a group off a draining node by itself at a
    checkpoint boundary, but not while it sees every other node busy, as every host on one
    shared machine is under a chaos run's load.) Recovered once every rank runs elsewhere."""

    def __init__(self, spec: FaultSpec, names: list[str], harness: Harness) -> None:
        super().__init__(spec, names, harness)
        self.moved_to: list[str] | None = None
        """The nodes the group was seen running on after the move."""

    async def inject(self) -> str:
        node = self.names[0]
        async with self.harness.client() as client:
            await client.drain(node)
        stopped = await self.harness.require_jobfaults().stop_group()
        return f"{node} drained through the API; {stopped}"

    async def heal(self) -> str:
        """Back into service once the group is placed elsewhere (or the bound passed)."""
        node = self.names[0]
        jobfaults = self.harness.require_jobfaults()
        placed = await jobfaults.placed_off(node, self.spec.recover_within_s)
        async with self.harness.client() as client:
            await client.uncordon(node)
        return f"{placed}; {node} uncordoned"

    async def probe(self, client: CoordinatorClient) -> bool:
        tasks = await self.harness.require_jobfaults().tasks(client)
        ranks = [t for t in tasks if "-learner-" in str(t["id"])]
        where = sorted({str(t.get("node")) for t in ranks})
        if not ranks or any(t["state"] != "running" for t in ranks):
            return False
        if set(where) & set(self.names):
            return False
        self.moved_to = where
        return True

    def describe_move(self) -> str:
        if self.moved_to:
            return f"; learner group running on {self.moved_to}"
        return "; the learner group never ran on another node"


class HostFault(RunFault):
    """host-cut, host-kill, host-delay: a whole host of its own (`--hosts N`) cut off,
    killed or delayed (chaos/hostfaults.py)."""

    def __init__(self, spec: FaultSpec, names: list[str], harness: Harness) -> None:
        super().__init__(spec, names, harness)
        if harness.hosts is None:
            raise FaultUnsupported(
                "the cluster's nodes share this host's network; run the scenario with "
                "`shoal chaos run SCENARIO --hosts N` (root) to fault hosts"
            )

    async def inject(self) -> str:
        faults, node = self.harness.hostfaults, self.names[0]
        if self.kind == "host-cut":
            return await faults.cut(self.spec, node)
        if self.kind == "host-kill":
            return await faults.kill(node)
        return await faults.delay(self.spec, node)

    async def heal(self) -> str:
        faults, node = self.harness.hostfaults, self.names[0]
        if self.kind == "host-cut":
            return await faults.uncut(self.spec, node)
        if self.kind == "host-kill":
            return await faults.revive(node)
        return await faults.undelay(node)


KINDS: dict[str, type[RunFault]] = {
    **{kind: HostFault for kind in HOST_KINDS},
    **{kind: LearnerMove for kind in MOVE_KINDS},
    "gpu-xid": GpuXidStorm,
    **{kind: TrainingTaskKill for kind in TRAINING_KINDS},
    "disk-full": JobDiskFull,
    **{kind: JobLinkFault for kind in LINK_KINDS},
    **{kind: CoordLinkFault for kind in COORD_KINDS},
    **{kind: ApiNetFault for kind in NET_KINDS},
    **{kind: RaftLinkFault for kind in RAFT_KINDS},
    "clock-skew": ClockSkewFault,
}
"""Fault kind -> its class; the process kinds (kill, pause, node-kill) are `ProcessFaults`."""


def make_fault(spec: FaultSpec, names: list[str], harness: Harness) -> RunFault:
    """The fault `spec` on the processes `names`; raises FaultError (FaultUnsupported) when
    the run cannot make it."""
    return KINDS.get(spec.kind, ProcessFaults)(spec, names, harness)
