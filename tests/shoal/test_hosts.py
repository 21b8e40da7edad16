"""Hosts as network namespaces, for real (root only; skipped elsewhere, saying why): node
daemons in namespaces of their own register at their own addresses, a cut or an isolation is
seen by a real TCP connect from inside a namespace and healed, a node that must die with its
parent does so through `ip netns exec`, and `shoal up --hosts` / `shoal down` as commands leave
nothing behind, also after a crash."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal import hosts
from shoal.hosts import Network
from shoal.local import LocalCluster
from tests.support.netns import netns_cluster, reach, skip_unless_hosts
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(300)


def _ports(local: LocalCluster) -> dict[str, int]:
    """Each node's transport port, from its registration (`shoal://ADDRESS:PORT`)."""
    nodes = local.get(f"{local.api_urls()[0]}/v1/nodes")["nodes"]
    return {n["id"]: int(n["address"].rsplit(":", 1)[1]) for n in nodes}


def _api(local: LocalCluster) -> tuple[str, int]:
    host, port = local.api_urls()[0].removeprefix("https://").rsplit(":", 1)
    return host, int(port)


def _netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _leftovers(tag: str) -> list[str]:
    """Whatever of the tag's namespaces, veths and bridge `ip` still lists."""
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    return [line for line in (spaces.stdout + links.stdout).splitlines() if tag in line]


def test_each_node_runs_in_its_host_and_registers_its_address(tmp_path: Path) -> None:
    with netns_cluster(tmp_path, hosts=2) as local:
        network = local.network()
        assert network is not None
        nodes = {n["id"]: n for n in local.get(f"{local.api_urls()[0]}/v1/nodes")["nodes"]}
        for host in network.hosts:
            assert nodes[host.node]["address"].startswith(f"shoal://{host.address}:")
            pid = local.pid(host.node)
            assert pid is not None
            assert _netns_inode(pid) == os.stat(f"/run/netns/{host.netns}").st_ino
            assert _netns_inode(pid) != _netns_inode(os.getpid())
            assert (local.run_dir / "data" / host.node).is_dir()
        assert len({h.address for h in network.hosts}) == 2
        for spec in local.specs():
            if spec.kind == "coordinator":
                assert spec.api_url == f"https://{network.bridge_address}:{_api(local)[1]}"
                assert str(spec.raft).startswith("127.0.0.1:")
            assert spec.env == {"SHOAL_TLS_DIR": str(local.run_dir / "tls")}
        record = json.loads((local.run_dir / "cluster.json").read_text())
        assert record["network"] == network.to_record()
        assert Path(record["storage"]).is_dir()


def test_a_cut_host_loses_the_other_hosts_but_not_the_coordinators(tmp_path: Path) -> None:
    with netns_cluster(tmp_path, hosts=3) as local:
        network = local.network()
        assert network is not None
        h1, h2, h3 = network.hosts
        ports = _ports(local)
        api = _api(local)
        assert reach(h1, h2.address, ports["n2"]) == "open"

        hosts.cut(network, "h1")
        assert reach(h1, h2.address, ports["n2"]) == "lost"
        assert reach(h3, h1.address, ports["n1"]) == "lost"
        assert reach(h1, *api) == "open"
        assert reach(h2, h3.address, ports["n3"]) == "open"
        assert hosts.faults(network) == {"h1": hosts.Fault.CUT}

        hosts.heal(network, "h1")
        eventually(lambda: reach(h1, h2.address, ports["n2"]) == "open", "h1 reaches h2 again")
        eventually(lambda: reach(h3, h1.address, ports["n1"]) == "open", "h3 reaches h1 again")
        assert hosts.faults(network) == {}


def test_an_isolated_host_loses_everything_until_healed(tmp_path: Path) -> None:
    with netns_cluster(tmp_path, hosts=2) as local:
        network = local.network()
        assert network is not None
        h1, h2 = network.hosts
        ports, api = _ports(local), _api(local)

        hosts.isolate(network, "n1")  # a host is also known by its node's name
        assert reach(h1, *api) == "lost"
        assert reach(h1, h2.address, ports["n2"]) == "lost"
        assert reach(h2, *api) == "open"

        hosts.heal(network, "h1")
        eventually(lambda: reach(h1, *api) == "open", "h1 reaches the coordinator again")
        eventually(lambda: reach(h1, h2.address, ports["n2"]) == "open", "h1 reaches h2 again")


def test_a_node_dies_with_its_parent_through_ip_netns_exec(tmp_path: Path) -> None:
    """`ip netns exec` execs: the pid recorded is the node's, and the parent-death signal set
    before the exec still reaches it."""
    script = (
        "import sys, time\nfrom pathlib import Path\nfrom shoal.local import LocalCluster\n"
        "print(LocalCluster(Path(sys.argv[1])).start('n1', die_with_parent=True), flush=True)\n"
        "time.sleep(3600)\n"
    )
    with netns_cluster(tmp_path, hosts=1) as local:
        network = local.network()
        assert network is not None
        local.stop("n1")
        parent = subprocess.Popen(
            [sys.executable, "-c", script, str(local.run_dir)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert parent.stdout is not None
            pid = int(parent.stdout.readline())
            netns = os.stat(f"/run/netns/{network.hosts[0].netns}").st_ino
            eventually(
                lambda: local.pid("n1") == pid and _netns_inode(pid) == netns,
                "n1 runs inside h1 under the pid its parent recorded",
            )
            parent.kill()
            eventually(lambda: local.pid("n1") is None, "n1 dies with its parent")
        finally:
            parent.kill()
            parent.wait()


@contextlib.contextmanager
def _bare_network(tmp_path: Path, count: int) -> Iterator[Network]:
    skip_unless_hosts()
    tag = hosts.run_tag(tmp_path)
    network = hosts.plan(tag, hosts.choose_prefix(tag, hosts.machine_networks()), count)
    hosts.create(network)
    try:
        yield network
    finally:
        hosts.remove(network)


def test_delay_slows_a_host_or_says_the_kernel_cannot(tmp_path: Path) -> None:
    with _bare_network(tmp_path, 1) as network:
        host = network.hosts[0]
        try:
            hosts.delay(network, "h1", 100)
        except hosts.NetemUnavailable as exc:
            missing = str(exc)
        else:
            missing = ""
        if missing:
            assert "CONFIG_NET_SCH_NETEM" in missing
            return
        started = time.monotonic()
        assert reach(host, network.bridge_address, 9) == "refused"
        assert time.monotonic() - started >= 0.2  # the SYN out and the RST back both waited
        hosts.delay(network, "h1", 0)
        shown = subprocess.run(
            ["ip", "netns", "exec", host.netns, "tc", "qdisc", "show", "dev", hosts.IFACE],
            capture_output=True,
            text=True,
            check=True,
        )
        assert "netem" not in shown.stdout


def test_removing_a_half_made_network_is_harmless(tmp_path: Path) -> None:
    skip_unless_hosts()
    tag = hosts.run_tag(tmp_path)
    subprocess.run(["ip", "netns", "add", f"shoal-{tag}-h3"], check=True)
    subprocess.run(["ip", "link", "add", f"shb-{tag}", "type", "bridge"], check=True)
    try:
        assert sorted(hosts.remove_tagged(tag)) == [f"shb-{tag}", f"shoal-{tag}-h3"]
        assert hosts.remove_tagged(tag) == []
    finally:
        hosts.remove_tagged(tag)
    assert _leftovers(tag) == []


def _shoal(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shoal", *argv], capture_output=True, text=True, timeout=240
    )


@contextlib.contextmanager
def _cli_cluster(run_dir: Path) -> Iterator[str]:
    """The run dir's tag; on the way out whatever is left is stopped and removed."""
    skip_unless_hosts()
    try:
        yield hosts.run_tag(run_dir.resolve())
    finally:
        if (run_dir / "cluster.json").exists():
            local = LocalCluster(run_dir)
            local.stop_all()
            local.remove_network()


def test_up_hosts_then_down_leaves_no_namespace_bridge_or_veth(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with _cli_cluster(run_dir) as tag:
        up = _shoal("up", "--hosts", "2", "--replicas", "1", "--run-dir", str(run_dir))
        assert up.returncode == 0, up.stderr
        network = LocalCluster(run_dir).network()
        assert network is not None
        for host in network.hosts:
            assert f"host {host.name} {host.address} (netns {host.netns})" in up.stdout
        assert len(_leftovers(tag)) == 5  # two namespaces, two veths, the bridge
        status = _shoal("status", "--run-dir", str(run_dir))
        assert status.returncode == 0, status.stderr
        assert "nodes 2" in status.stdout

        down = _shoal("down", "--run-dir", str(run_dir))
        assert down.returncode == 0, down.stderr
        assert "removed the hosts' network" in down.stdout
        assert _leftovers(tag) == []


def test_the_next_up_removes_what_a_crashed_cluster_left(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with _cli_cluster(run_dir) as tag:
        subprocess.run(["ip", "netns", "add", f"shoal-{tag}-h9"], check=True)  # a half-made one
        up = _shoal("up", "--hosts", "2", "--replicas", "1", "--run-dir", str(run_dir))
        assert up.returncode == 0, up.stderr
        assert not any(f"shoal-{tag}-h9" in line for line in _leftovers(tag))
        local = LocalCluster(run_dir)
        for spec in local.specs():  # the crash: everything killed, the network left behind
            local.signal(spec.name, signal.SIGKILL)
        eventually(lambda: all(local.pid(s.name) is None for s in local.specs()), "all dead")
        assert len(_leftovers(tag)) == 5

        again = _shoal("up", "--hosts", "2", "--replicas", "1", "--run-dir", str(run_dir))
        assert again.returncode == 0, again.stderr
        assert len(_leftovers(tag)) == 5
        assert len(local.wait_nodes(2, timeout=120)) == 2

        down = _shoal("down", "--run-dir", str(run_dir))
        assert down.returncode == 0, down.stderr
        assert _leftovers(tag) == []
