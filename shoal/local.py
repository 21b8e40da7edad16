"""The local cluster: coordinator replicas and node daemons (simulated GPUs) as background
child processes of one run directory.

Layout of a run directory (deleting it leaves nothing behind once `stop` ran):
  cluster.json          the process specs and addresses (what `status`, `logs`, `down` read)
  secret, api-token     the Raft secret and the operator token, mode 0600
  node-token            the node credential node daemons use (no job submission), mode 0600
  read-token            the read-only token for dashboards and scrapers, mode 0600
  logs/NAME.log         each process's stdout and stderr
  pids/NAME.pid         each process's pid
  data/NAME/            each replica's Raft journal and dump, each node's data directory
With `shoal up --hosts N` (each node daemon a host of its own, laid out by shoal/local_hosts.py
on the network of shoal/hosts.py) also:
  tls/                  the cluster's CA, certificate and key ($SHOAL_TLS_DIR of every process)
  storage/              stands for the file system every host mounts (checkpoints go there)
and cluster.json records the network (bridge, namespaces, addresses) so `down`, or the next
`up` after a crash, removes it.
A process is recognised by its pid AND its command line naming the run directory, so a reused
pid is never signalled.
The embedded cluster of `shoal train` is shoal/local_embedded.py.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shoal import hosts
from shoal.boundedjson import JsonRefused, loads
from shoal.errors import ShoalError
from shoal.ports import free_port
from shoal.process import signal_on_parent_death
from shoal.runtime.tls import CA_FILE, TLS_DIR_ENV, TlsFiles
from shoal.scheduler.health.presence import read_states, read_util_source

STOP_GRACE = 5.0
MAX_CLUSTER_JSON = 4 << 20
"""cluster.json of 9 replicas and 64 nodes is a few tens of KiB; anything larger was not written
by `shoal up`."""


class LocalClusterError(ShoalError):
    """The local cluster could not be started, found or stopped; the message says why."""


def default_run_dir() -> Path:
    return Path(os.environ.get("SHOAL_RUN_DIR", Path.home() / ".shoal" / "run"))


@dataclass(frozen=True)
class ProcessSpec:
    """One background process: its name, its command line and where it answers when ready
    (a coordinator replica, or a node daemon: kind "node", no API of its own)."""

    name: str
    argv: list[str]
    kind: str
    health_url: str | None = None
    api_url: str | None = None
    raft: str | None = None
    raft_bind: str | None = None
    """Where the replica's Raft listens when `raft` (what peers dial) is a proxy in front of it."""
    env: dict[str, str] | None = None
    """Variables added to the inherited environment (chaos hooks such as SHOAL_CHAOS_CLOCK_FILE)."""


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def coordinator_specs(
    run_dir: Path,
    replicas: int,
    extra_args: tuple[str, ...] = (),
    raft_bind: bool = False,
    api_host: str = "127.0.0.1",
    tls_dir: Path | None = None,
) -> list[ProcessSpec]:
    """Specs for `replicas` coordinator replicas on free loopback ports. With `raft_bind`, each
    replica binds Raft on a port of its own and advertises another, where the caller must put
    something that forwards to it (chaos puts a fault proxy there). `api_host` is where the
    admin API listens (Raft stays on loopback); with `tls_dir` it serves HTTPS."""
    rafts = [f"127.0.0.1:{free_port()}" for _ in range(replicas)]
    binds = [f"127.0.0.1:{free_port()}" if raft_bind else None for _ in range(replicas)]
    apis = [f"{api_host}:{free_port(api_host)}" for _ in range(replicas)]
    scheme = "https" if tls_dir else "http"
    specs = []
    for i in range(replicas):
        name = f"c{i + 1}"
        peers = ",".join(r for j, r in enumerate(rafts) if j != i)
        argv = [
            sys.executable, "-m", "shoal", "coordinator",
            "--id", name, "--raft", rafts[i], "--peers", peers, "--api", apis[i],
            "--data-dir", str(run_dir / "data" / name),
            "--secret-file", str(run_dir / "secret"), "--token-file", str(run_dir / "api-token"),
            "--node-token-file", str(run_dir / "node-token"),
            "--read-token-file", str(run_dir / "read-token"),
            *(("--raft-bind", binds[i]) if binds[i] else ()),
            *extra_args,
        ]  # fmt: skip
        specs.append(
            ProcessSpec(
                name,
                argv,
                "coordinator",
                f"{scheme}://{apis[i]}/healthz",
                f"{scheme}://{apis[i]}",
                rafts[i],
                binds[i],
                _tls_env(tls_dir),
            )
        )
    return specs


def _tls_env(tls_dir: Path | None) -> dict[str, str] | None:
    return {TLS_DIR_ENV: str(tls_dir)} if tls_dir else None


def node_specs(
    run_dir: Path,
    api_urls: list[str],
    nodes: int,
    sim_gpus: int,
    island_size: int = 16,
    extra_args: tuple[str, ...] = (),
    network: hosts.Network | None = None,
    tls_dir: Path | None = None,
) -> list[ProcessSpec]:
    """Specs for `nodes` node daemons `n1..nN`, each with `sim_gpus` simulated GPUs. With a
    `network`, node n<i> runs inside host h<i>'s namespace and listens on its address."""
    specs = []
    for i in range(nodes):
        name = f"n{i + 1}"
        host = network.host(name) if network else None
        argv = [
            *(hosts.exec_prefix(host) if host else ()),
            sys.executable, "-m", "shoal", "node",
            "--coordinators", ",".join(api_urls), "--node-id", name,
            "--data-dir", str(run_dir / "data" / name), "--token-file", str(run_dir / "node-token"),
            "--sim-gpus", str(sim_gpus), "--island-size", str(island_size),
            *(("--listen", f"{host.address}:0") if host else ()),
            *extra_args,
        ]  # fmt: skip
        specs.append(ProcessSpec(name, argv, "node", env=_tls_env(tls_dir)))
    return specs


class LocalCluster:
    """A run directory and the processes it records. Methods are blocking (CLI and tests)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir.resolve()
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._ssl_context: ssl.SSLContext | None = None

    # -- files -----------------------------------------------------------------------------

    @property
    def token(self) -> str:
        return (self.run_dir / "api-token").read_text().strip()

    def _record(self) -> dict[str, Any]:
        """cluster.json, read as a file anyone may have edited: bounded, then checked."""
        path = self.run_dir / "cluster.json"
        try:
            with path.open("rb") as handle:
                data = loads(handle.read(MAX_CLUSTER_JSON + 1), max_bytes=MAX_CLUSTER_JSON)
        except FileNotFoundError:
            raise LocalClusterError(
                f"no cluster in {self.run_dir}; start one with `shoal up`"
            ) from None
        except (OSError, JsonRefused) as exc:
            raise LocalClusterError(
                f"cannot read {path} ({exc}); `shoal down` cannot stop what it does not name: "
                "stop the processes by hand and delete the run directory"
            ) from None
        if not isinstance(data, dict) or not isinstance(data.get("processes"), list):
            raise LocalClusterError(f"{path} lists no processes; delete the run directory")
        return data

    def specs(self) -> list[ProcessSpec]:
        try:
            return [ProcessSpec(**item) for item in self._record()["processes"]]
        except TypeError as exc:
            raise LocalClusterError(
                f"{self.run_dir / 'cluster.json'} has a process entry `shoal up` does not "
                f"write ({exc}); delete the run directory"
            ) from None

    def network(self) -> hosts.Network | None:
        """The hosts' network `shoal up --hosts` recorded, or None for a one-host cluster."""
        record = self._record().get("network")
        return None if record is None else hosts.Network.from_record(record)

    @property
    def tls_dir(self) -> Path | None:
        """The cluster's TLS directory (`shoal up --hosts` makes one), or None."""
        directory = self.run_dir / "tls"
        return directory if (directory / CA_FILE).is_file() else None

    def spec(self, name: str) -> ProcessSpec:
        for spec in self.specs():
            if spec.name == name:
                return spec
        raise LocalClusterError(f"no process {name!r}; known: {[s.name for s in self.specs()]}")

    def api_urls(self) -> list[str]:
        return [s.api_url for s in self.specs() if s.api_url]

    def log_path(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    # -- lifecycle -------------------------------------------------------------------------

    def check_not_running(self) -> None:
        """Refuses a run dir whose processes still run (before anything in it is replaced)."""
        if (self.run_dir / "cluster.json").exists() and any(self.pid(s.name) for s in self.specs()):
            raise LocalClusterError(
                f"a cluster is already running in {self.run_dir}; `shoal down` first"
            )

    def create(self, specs: list[ProcessSpec], network: hosts.Network | None = None) -> None:
        """Write the secrets and cluster.json; refuses a run dir whose processes still run.
        With a `network` (hosts of their own) cluster.json records it and the storage every
        host mounts, which is created."""
        self.check_not_running()
        record: dict[str, Any] = {"processes": [asdict(s) for s in specs]}
        if network is not None:
            record |= {"network": network.to_record(), "storage": str(self.run_dir / "storage")}
        try:
            for sub in ("logs", "pids", "data", *(("storage",) if network else ())):
                (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
            os.chmod(self.run_dir, 0o700)
            for name in ("secret", "api-token", "node-token", "read-token"):
                if not (self.run_dir / name).exists():
                    _write_private(self.run_dir / name, secrets.token_urlsafe(32))
            (self.run_dir / "cluster.json").write_text(json.dumps(record, indent=1))
        except OSError as exc:
            raise LocalClusterError(
                f"cannot lay out the run directory {self.run_dir}: {exc.strerror or exc}; "
                "choose a writable --run-dir (or SHOAL_RUN_DIR)"
            ) from exc

    def start(self, name: str, die_with_parent: bool = False) -> int:
        """Start `name` in its own session (Ctrl-C in a terminal does not reach it). With
        `die_with_parent` it gets SIGTERM when this process dies, even by SIGKILL: an embedded
        cluster must not outlive the `shoal train` that started it; `shoal up`'s must."""
        spec = self.spec(name)
        if self.pid(name):
            raise LocalClusterError(f"{name} is already running (pid {self.pid(name)})")
        with open(self.log_path(name), "ab") as log:
            proc = subprocess.Popen(
                spec.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=signal_on_parent_death if die_with_parent else None,
                env={**os.environ, **spec.env} if spec.env else None,
            )
        (self.run_dir / "pids" / f"{name}.pid").write_text(str(proc.pid))
        self._children[name] = proc
        return proc.pid

    def start_all(self) -> None:
        for spec in self.specs():
            self.start(spec.name)

    def pid(self, name: str) -> int | None:
        """The pid of `name` if that process is alive and really ours, else None."""
        child = self._children.get(name)
        if child is not None and child.poll() is None:
            # Started here and alive: trust the handle (it may not have exec'd yet).
            return child.pid
        # Not ours, or ours but dead: another process may have started a newer one since.
        path = self.run_dir / "pids" / f"{name}.pid"
        try:
            pid = int(path.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):
            return None
        if str(self.run_dir) not in cmdline or not _alive(pid):
            return None
        return pid

    def signal(self, name: str, sig: int) -> None:
        pid = self.pid(name)
        if pid is None:
            raise LocalClusterError(f"{name} is not running")
        os.kill(pid, sig)

    def kill(self, name: str) -> None:
        """SIGKILL, then wait until the process is gone."""
        self.signal(name, signal.SIGKILL)
        self._wait_gone(name, STOP_GRACE)

    def stop(self, name: str, grace: float = STOP_GRACE) -> bool:
        """SIGTERM, then SIGKILL after `grace` seconds; True if it was running."""
        pid = self.pid(name)
        if pid is None:
            return False
        os.kill(pid, signal.SIGTERM)
        if not self._wait_gone(name, grace):
            os.kill(pid, signal.SIGKILL)
            self._wait_gone(name, STOP_GRACE)
        return True

    def stop_all(self) -> list[str]:
        """Node daemons first (they drain their tasks and report it while a coordinator still
        answers), then the replicas; the names of those that were running."""
        specs = self.specs()
        stopped = []
        for kind in ("node", "coordinator"):
            pids = {s.name: self.pid(s.name) for s in specs if s.kind == kind}
            for pid in pids.values():
                if pid:
                    os.kill(pid, signal.SIGTERM)
            for name, pid in pids.items():
                if pid and not self._wait_gone(name, STOP_GRACE):
                    os.kill(pid, signal.SIGKILL)
                    self._wait_gone(name, STOP_GRACE)
                (self.run_dir / "pids" / f"{name}.pid").unlink(missing_ok=True)
            stopped += [name for name, pid in pids.items() if pid]
        return [s.name for s in specs if s.name in stopped]

    def _wait_gone(self, name: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pid(name) is None:
                return True
            time.sleep(0.02)
        return self.pid(name) is None

    # -- probing -----------------------------------------------------------------------------

    def get(self, url: str, timeout: float = 2.0) -> Any:
        """GET an admin API URL with the operator token (https: checked against the cluster CA)."""
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=timeout, context=self._ssl()) as resp:
            return json.loads(resp.read())

    def _ssl(self) -> ssl.SSLContext | None:
        if self._ssl_context is None and self.tls_dir is not None:
            self._ssl_context = TlsFiles(self.tls_dir).client_context()
        return self._ssl_context

    def cluster_view(self, name: str, digest: bool = False) -> dict[str, Any] | None:
        """The replica's `/v1/cluster`, or None if it does not answer."""
        spec = self.spec(name)
        if spec.api_url is None:
            return None
        query = "?digest=true" if digest else ""
        try:
            return dict(self.get(f"{spec.api_url}/v1/cluster{query}"))
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def wait_ready(self, names: list[str] | None = None, timeout: float = 30.0) -> str:
        """Wait until the named replicas answer and agree on a leader; returns its API URL."""
        names = names or [s.name for s in self.specs() if s.kind == "coordinator"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            views = [self.cluster_view(n) for n in names]
            leaders = {v.get("leader_api") for v in views if v}
            if all(views) and len(leaders) == 1 and None not in leaders:
                return str(leaders.pop())
            for name in names:
                if self.pid(name) is None:
                    raise LocalClusterError(
                        f"{name} exited; see {self.log_path(name)}:\n{self.tail(name, 15)}"
                    )
            time.sleep(0.05)
        raise LocalClusterError(f"replicas {names} did not agree on a leader within {timeout:g} s")

    def nodes(self) -> list[dict[str, Any]]:
        """The registered nodes as the first answering replica lists them (empty if none does):
        id, liveness, cordoned, GPU count and GPUs per NVLink island."""
        for url in self.api_urls():
            try:
                listed = self.get(f"{url}/v1/nodes")["nodes"]
            except (OSError, urllib.error.URLError, ValueError, KeyError):
                continue
            return [_node_row(n) for n in listed]
        return []

    def wait_nodes(self, count: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Wait until `count` nodes are registered and alive."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = [n for n in self.nodes() if n["liveness"] == "alive"]
            if len(rows) >= count:
                return rows
            for spec in self.specs():
                if spec.kind == "node" and self.pid(spec.name) is None:
                    raise LocalClusterError(
                        f"{spec.name} exited; see {self.log_path(spec.name)}:\n{self.tail(spec.name, 15)}"
                    )
            time.sleep(0.1)
        raise LocalClusterError(f"fewer than {count} nodes registered within {timeout:g} s")

    def remove_network(self) -> list[str]:
        """Remove the hosts' network this run dir recorded, and whatever a crashed `shoal up`
        here left under this run dir's names; the names removed (none for a one-host cluster)."""
        network = self.network() if (self.run_dir / "cluster.json").exists() else None
        if network is None and not hosts.can_manage():
            return []  # nothing recorded, and nothing this user could have made
        hosts.check_can_create()  # a recorded network takes root to remove
        tags = {hosts.run_tag(self.run_dir), *((network.tag,) if network else ())}
        return [name for tag in sorted(tags) for name in hosts.remove_tagged(tag)]

    def tail(self, name: str, lines: int = 50) -> str:
        try:
            return "\n".join(self.log_path(name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def status(self) -> list[dict[str, Any]]:
        rows = []
        for spec in self.specs():
            view = self.cluster_view(spec.name) if self.pid(spec.name) else None
            running = "running" if self.pid(spec.name) else "down"
            rows.append(
                {
                    "name": spec.name,
                    "kind": spec.kind,
                    "pid": self.pid(spec.name),
                    "api": spec.api_url,
                    "raft": spec.raft,
                    "state": view["state"] if view else running if spec.kind == "node" else "down",
                    "term": view["term"] if view else None,
                    "commit_index": view["commit_index"] if view else None,
                    "leader": view["leader_id"] if view else None,
                }
            )
        return rows


def _node_row(node: dict[str, Any]) -> dict[str, Any]:
    islands: dict[str, int] = {}
    for gpu in node["resources"].get("gpus", []):
        islands[gpu.get("island", "")] = islands.get(gpu.get("island", ""), 0) + 1
    return {
        "id": node["id"],
        "liveness": node["liveness"],
        "cordoned": node["cordoned"],
        "gpus": sum(islands.values()),
        "islands": dict(sorted(islands.items())),
        "collectors": read_states(node.get("health")),
        "gpu_util_source": read_util_source(node.get("health")),
    }


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
