"""The stage of a chaos run: it starts and stops the local cluster (coordinator replicas, node
daemons) with a fault proxy in front of each replica's API, at each replica's Raft address
(chaos/raft_mesh.py) and on each node's link to each replica (chaos/node_mesh.py), the link relay
the training job's links dial through (chaos/relay.py), the reference clock, and the scenario's
training job (chaos/job_process.py). It answers what the faults and the checks ask of the cluster:
a client through the proxies, the replicas' own views, the leader, the nodes alive.

With `hosts` each node daemon is a host of its own, a network namespace that reaches this one
only through the bridge: the nodes' proxies, the reference clock and the link relay listen on
the bridge address instead of loopback, the API is https under the cluster's CA (so is every
proxied client's), and the job's checkpoints go to the storage every host mounts. Signals,
file reads of the run and the blocking local-cluster calls run in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal.chaos import invariants
from shoal.chaos.cluster import Cluster, Hosts, ProcessSpec
from shoal.chaos.errors import ChaosError, FaultError
from shoal.chaos.hostfaults import HostFaults
from shoal.chaos.job_faults import JobFaults
from shoal.chaos.job_links import LinkFaults
from shoal.chaos.job_process import ClusterJob
from shoal.chaos.node_mesh import NodeLinks, NodeMesh, api_address
from shoal.chaos.proxy import FaultProxy
from shoal.chaos.raft_mesh import RaftMesh
from shoal.chaos.relay import LinkRelay
from shoal.chaos.scenario import COORD_KINDS, LINK_KINDS, RAFT_KINDS, Scenario
from shoal.chaos.workload import make_client
from shoal.raft.client import CoordinatorClient
from shoal.raft.errors import RaftError
from shoal.runtime.tls import TlsFiles
from shoal.scheduler.health.clock import ClockServer, serve_clock

LOOPBACK = "127.0.0.1"


def clock_file(run_dir: Path, node: str) -> Path:
    """The offset file node `node`'s clock reads (its SHOAL_CHAOS_CLOCK_FILE): a clock-skew
    fault writes the skew there."""
    return run_dir / "nodes" / node / "clock-offset"


class Harness:
    """The cluster of one run and everything put in front of it. `start` raises ChaosError
    when the cluster cannot carry the scenario; `stop` stops all it started."""

    def __init__(
        self,
        scenario: Scenario,
        cluster: Cluster,
        log: Callable[[str], None],
        clock_port: int | None = None,
        node_links: NodeLinks | None = None,
        relay_port: int | None = None,
        hosts: Hosts | None = None,
    ) -> None:
        """See `ChaosRun` (chaos/runner.py) for what each argument makes possible."""
        self.scenario, self.cluster, self.hosts, self.log = scenario, cluster, hosts, log
        self.run_dir = cluster.run_dir
        self.listen_host = LOOPBACK if hosts is None else hosts.bridge_address
        self.hostfaults = HostFaults(hosts, cluster)
        self._tls = None if cluster.tls_dir is None else TlsFiles(cluster.tls_dir)
        self.relay_port, self.clock_port = relay_port, clock_port
        self.links: LinkFaults | None = None
        self._clock: ClockServer | None = None
        self.proxies: dict[str, FaultProxy] = {}
        self.mesh = RaftMesh(cluster)
        self.node_mesh = NodeMesh(node_links or {}, self.listen_host)
        self.job = None if scenario.training is None else self._make_job(scenario, cluster, hosts)
        self.jobfaults = None if self.job is None else JobFaults(self.job, self.client, self.nodes)

    @staticmethod
    def _make_job(scenario: Scenario, cluster: Cluster, hosts: Hosts | None) -> ClusterJob:
        assert scenario.training is not None
        storage = None if hosts is None else hosts.storage
        timeout = scenario.duration_s + 600.0
        return ClusterJob(scenario.training, cluster.run_dir, timeout, storage, cluster.tls_dir)

    # -- set-up and tear-down ----------------------------------------------------------------

    async def start(self) -> list[tuple[str, int]]:
        """Start everything, in the order each piece needs the others; returns every
        (host, port) the run listened on or made listen (no_leaks checks them after)."""
        specs = self.coordinators()
        shape = (len(specs), len(self.nodes()))
        if shape != (self.scenario.replicas, self.scenario.nodes):
            raise ChaosError(
                f"scenario {self.scenario.name} wants {self.scenario.replicas} replicas and "
                f"{self.scenario.nodes} nodes, the cluster in {self.run_dir} has {shape}"
            )
        here = self.listen_host
        ports = [(LOOPBACK, p) for p in await self._start_raft_mesh(specs)]
        ports += [(here, p) for p in await self._start_node_mesh(specs)]
        ports += [(here, p) for p in await self._start_relay()]
        where = "" if self.hosts is None else f", each node a host of its own on {here}"
        self.log(f"starting {shape[0]} replicas and {shape[1]} nodes in {self.run_dir}{where}")
        if self.clock_port is not None:
            self._clock = await serve_clock(host=here, port=self.clock_port)
        await asyncio.to_thread(self.cluster.start_all)
        await asyncio.to_thread(self.cluster.wait_ready, None, 60.0)
        ports += await self._start_api_proxies(specs)
        nodes = await self.nodes_alive(60.0)
        if not nodes.held:
            raise ChaosError(f"{nodes.detail}; see the node logs in {self.run_dir / 'logs'}")
        return ports

    async def start_job(self) -> None:
        """The training job, once the cluster is up: straight to the replicas, never through
        a faulted proxy (`shoal train` reads its job through consistent reads and rides out a
        killed or replaying replica itself)."""
        if self.job is None:
            return
        self.log(f"starting the training job ({self.job.cfg.env}) through the cluster")
        urls = [s.api_url for s in self.coordinators() if s.api_url]
        cpus = await self._host_cpus() if self.job.cfg.spread else None
        await asyncio.to_thread(self.job.start, urls, self.run_dir / "api-token", cpus)
        try:
            await asyncio.to_thread(self.job.wait_training)
        except FaultError as exc:
            raise ChaosError(str(exc)) from exc

    async def _start_raft_mesh(self, specs: list[ProcessSpec]) -> list[int]:
        if any(s.raft_bind is not None for s in specs):
            return await self.mesh.start(specs)
        if any(f.kind in RAFT_KINDS for f in self.scenario.faults):
            raise ChaosError(
                f"scenario {self.scenario.name} partitions Raft links, but the replicas in "
                f"{self.run_dir} bind their advertised Raft addresses; make the specs with "
                "coordinator_specs(..., raft_bind=True)"
            )
        return []

    async def _start_api_proxies(self, specs: list[ProcessSpec]) -> list[tuple[str, int]]:
        ports: list[tuple[str, int]] = []
        for spec in specs:
            if spec.api_url is None or spec.raft is None:
                raise ChaosError(f"{spec.name} has no API or Raft address to put a proxy before")
            api = api_address(spec.api_url)
            proxy = await FaultProxy(api).start()
            self.proxies[spec.name] = proxy
            raft_port = int(spec.raft.rsplit(":", 1)[1])
            ports += [api, (LOOPBACK, raft_port), (LOOPBACK, proxy.port)]
        return ports

    async def _start_node_mesh(self, specs: list[ProcessSpec]) -> list[int]:
        """The nodes' coordinator-link proxies, before the nodes (they register through them)."""
        links = self.node_mesh.links
        if not links:
            if any(f.kind in COORD_KINDS for f in self.scenario.faults):
                raise ChaosError(
                    f"scenario {self.scenario.name} faults the node<->coordinator links, but "
                    "no node links were planned; pass node_links (chaos.node_mesh.plan_links) "
                    "and point each node's --coordinators at coordinator_urls(links, node)"
                )
            return []
        if sorted(links) != sorted(self.nodes()):
            raise ChaosError(
                f"node links are planned for {sorted(links)}, the cluster's nodes are "
                f"{sorted(self.nodes())}"
            )
        return await self.node_mesh.start(specs)

    async def _host_cpus(self) -> float | None:
        """The smallest node's CPUs, as the nodes registered them (what `spread` shares)."""
        async with self.client() as client:
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

    async def stop(self) -> None:
        """Stop the job (if still running), the proxies, the relay, the cluster, the clock."""
        try:
            if self.job is not None and self.job.exit_code is None:
                await asyncio.to_thread(self.job.stop)
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

    async def restart_downed(self) -> None:
        """Start again whatever a fault left down, so the checks see the whole cluster."""
        for spec in self.cluster.specs():
            if self.cluster.pid(spec.name) is None:
                await asyncio.to_thread(self.cluster.start, spec.name)
        await asyncio.to_thread(self.cluster.wait_ready, None, 60.0)

    # -- what the faults and the checks ask ------------------------------------------------------

    def coordinators(self) -> list[ProcessSpec]:
        return [s for s in self.cluster.specs() if s.kind == "coordinator"]

    def nodes(self) -> list[str]:
        return [s.name for s in self.cluster.specs() if s.kind == "node"]

    def client(self) -> CoordinatorClient:
        """A client of the replicas' API through their proxies (https where the API is: the
        proxies pass TLS through, and the cluster's certificate names 127.0.0.1)."""
        schemes = {s.name: (s.api_url or "http:").split(":", 1)[0] for s in self.coordinators()}
        urls = [f"{schemes[name]}://{LOOPBACK}:{p.port}" for name, p in self.proxies.items()]
        return make_client(urls, self.cluster.token, self._tls)

    def require_jobfaults(self) -> JobFaults:
        if self.jobfaults is None:
            raise FaultError("the scenario has no [training] job to fault")
        return self.jobfaults

    def require_links(self) -> LinkFaults:
        if self.links is None:
            raise FaultError("the run has no link relay (or no [training] job) to fault links on")
        return self.links

    async def nodes_alive(self, timeout: float) -> invariants.Verdict:
        """Wait until every node daemon is registered and alive; the verdict says which not."""
        wanted = set(self.nodes())
        deadline = time.monotonic() + timeout
        missing = sorted(wanted)
        async with self.client() as client:
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

    async def leader(self) -> str:
        """The replica most running replicas name as leader (waits up to 10 s for one)."""
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            views = await asyncio.to_thread(self.views)
            leaders = Counter(v["leader_id"] for v in views.values() if v and v.get("leader_id"))
            if leaders:
                return str(leaders.most_common(1)[0][0])
            await asyncio.sleep(0.1)
        raise FaultError("no replica knows a leader to fault")

    def views(self, digest: bool = False) -> dict[str, dict[str, Any] | None]:
        """Each running replica's own GET /v1/cluster (None when down or silent)."""
        views: dict[str, dict[str, Any] | None] = {}
        for spec in self.coordinators():
            views[spec.name] = None
            if spec.api_url and self.cluster.pid(spec.name):
                query = "?digest=true" if digest else ""
                with contextlib.suppress(OSError, ValueError):
                    views[spec.name] = self.cluster.get(f"{spec.api_url}/v1/cluster{query}")
        return views
