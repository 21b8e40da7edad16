"""A cluster whose nodes are hosts of their own (network namespaces), for tests.

`netns_cluster` lays the cluster out and starts it exactly as `shoal up --hosts N` does
(`shoal.local_hosts.create_hosts_cluster`, then start and wait), and on the way out stops every
process and removes the namespaces, veths and bridge, however the test ended. It skips, naming
why, where the machine cannot make namespaces (not root, no `ip`).

`reach` asks from inside a host whether an address answers: a real TCP connect in that
namespace, so a cut is seen the way a node daemon would see it.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal import hosts as host_net
from shoal.errors import ShoalError
from shoal.local import LocalCluster, LocalClusterError
from shoal.local_hosts import create_hosts_cluster

START_S = 120.0
"""How long replicas and node daemons may take to answer before the fixture gives up (a
failure detector on a loaded 2-core machine, not a performance bound)."""
PROBE_S = 1.5
"""How long `reach` waits for a connection: a cut loses packets silently, so this is how long
it takes to say "lost"."""
_PROBE = """\
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("open")
except ConnectionRefusedError:
    print("refused")
except OSError:
    print("lost")
"""


def skip_unless_hosts() -> None:
    """Skip the calling test where this machine cannot make hosts, saying why."""
    try:
        host_net.check_can_create()
    except ShoalError as exc:
        pytest.skip(f"hosts as network namespaces need root and iproute2: {exc}")


@contextlib.contextmanager
def netns_cluster(
    tmp_path: Path,
    hosts: int = 2,
    replicas: int = 1,
    sim_gpus: int = 0,
    island_size: int = 16,
    extra_node_args: tuple[str, ...] = (),
    coordinator_args: tuple[str, ...] = (),
) -> Iterator[LocalCluster]:
    """A started cluster of `replicas` coordinators and `hosts` hosts, each running one node
    daemon (`local.network()` names them); removed on the way out."""
    skip_unless_hosts()
    local = LocalCluster(tmp_path / "run")
    try:
        create_hosts_cluster(
            local, hosts, replicas, sim_gpus, island_size, coordinator_args, extra_node_args
        )
        local.start_all()
        local.wait_ready(timeout=START_S)
        local.wait_nodes(hosts, timeout=START_S)
        yield local
    finally:
        try:
            with contextlib.suppress(LocalClusterError):  # no cluster.json: nothing started
                local.stop_all()
        finally:
            local.remove_network()


def reach(host: host_net.Host, address: str, port: int) -> str:
    """From inside `host`: "open" (something accepted), "refused" (the address answered, no
    listener) or "lost" (no answer within PROBE_S: cut off)."""
    probe = [sys.executable, "-c", _PROBE, address, str(port), str(PROBE_S)]
    done = subprocess.run(
        [*host_net.exec_prefix(host), *probe], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()
