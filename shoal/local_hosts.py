"""`shoal up --hosts N`: a local cluster whose node daemons are hosts of their own, each in a
network namespace on a private bridge (shoal/hosts.py makes the network), with the cluster's
CA and certificate in `run_dir/tls` so every process speaks TLS across the bridge.

Laid out here, apart from shoal/local.py, which starts, probes and stops any local cluster's
processes and knows nothing of namespaces but what cluster.json records.
"""

from __future__ import annotations

from pathlib import Path

from shoal import hosts
from shoal.local import LocalCluster, LocalClusterError, coordinator_specs, node_specs
from shoal.runtime.tls import CA_FILE


def cluster_names(network: hosts.Network) -> list[str]:
    """What the cluster's certificate must name: the bridge (coordinators), every host (node
    daemons and their tasks) and loopback (Raft, and tools on this host)."""
    from shoal.runtime.local_ca import LOCAL_NAMES

    return [network.bridge_address, *(h.address for h in network.hosts), *LOCAL_NAMES]


def create_hosts_cluster(
    local: LocalCluster,
    count: int,
    replicas: int,
    sim_gpus: int = 0,
    island_size: int = 16,
    coordinator_args: tuple[str, ...] = (),
    node_args: tuple[str, ...] = (),
) -> hosts.Network:
    """Lay out a new cluster whose `count` nodes are hosts of their own (`shoal up --hosts`):
    what a crashed earlier one left is removed, the network made, the cluster's CA and
    certificate written to `run_dir/tls`, then cluster.json. Nothing is started; on a failure
    the network is removed again."""
    hosts.check_can_create()
    local.check_not_running()
    local.remove_network()
    tag = hosts.run_tag(local.run_dir)
    network = hosts.plan(tag, hosts.choose_prefix(tag, hosts.machine_networks()), count)
    hosts.create(network)
    try:
        tls = _cluster_tls(local.run_dir / "tls", network)
        specs = coordinator_specs(
            local.run_dir, replicas, coordinator_args, api_host=network.bridge_address, tls_dir=tls
        )
        urls = [s.api_url for s in specs if s.api_url]
        specs += node_specs(
            local.run_dir, urls, count, sim_gpus, island_size, node_args, network, tls
        )
        local.create(specs, network)
    except BaseException:
        hosts.remove(network)
        raise
    return network


def restore_network(local: LocalCluster) -> hosts.Network | None:
    """Before an existing cluster starts again: its recorded network, made afresh (after
    removing what a crash left of it), or None for a one-host cluster."""
    network = local.network()
    if network is not None:
        hosts.check_can_create()
        local.check_not_running()
        local.remove_network()
        hosts.create(network)
    return network


def _cluster_tls(directory: Path, network: hosts.Network) -> Path:
    """The CA and certificate for the cluster's addresses; a fresh one unless the directory
    already holds one (the same cluster again: same addresses, and every process trusts it)."""
    from shoal.runtime.local_ca import make_local_ca

    if not (directory / CA_FILE).is_file():
        try:
            make_local_ca(directory, cluster_names(network))
        except OSError as exc:
            raise LocalClusterError(
                f"cannot write the cluster's TLS files to {directory}: {exc.strerror or exc}; "
                "choose a writable --run-dir"
            ) from None
    return directory
