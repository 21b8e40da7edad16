"""The hosts planner (shoal/hosts.py) without touching the network: names and addresses, the
/24 picked by the tag, the neighbour entries a set of faults needs, cluster.json's record read
as hostile bytes, and `shoal up --hosts` refusing what it cannot do in one line."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal import hosts
from shoal.cli import main
from shoal.hosts import Fault, HostNetworkError, Network
from shoal.local import LocalCluster

TAGS = st.text(alphabet="0123456789abcdef", min_size=6, max_size=6)
PREFIXES = st.tuples(st.integers(0, 255), st.integers(0, 255)).map(lambda p: f"10.{p[0]}.{p[1]}")
COUNTS = st.integers(1, hosts.MAX_HOSTS)
NETWORKS = st.builds(hosts.plan, TAGS, PREFIXES, COUNTS)
FAULTS = st.sampled_from(list(Fault))


@given(NETWORKS)
def test_a_plan_has_distinct_names_and_addresses_on_its_own_24(network: Network) -> None:
    links = [network.bridge, *(h.veth for h in network.hosts)]
    assert all(len(name) <= 15 for name in links), "Linux interface names are at most 15"
    assert len(set(network.names())) == len(network.names())
    addresses = [network.bridge_address, *(h.address for h in network.hosts)]
    assert len(set(addresses)) == len(addresses)
    assert all(ipaddress.ip_address(a) in network.cidr for a in addresses)
    assert network.cidr.subnet_of(hosts.SUPERNET)
    assert [h.node for h in network.hosts] == [f"n{i}" for i in range(1, len(network.hosts) + 1)]
    assert all(network.host(h.node) is h and network.host(h.name) is h for h in network.hosts)


@given(NETWORKS)
def test_the_record_round_trips_through_json(network: Network) -> None:
    record = json.loads(json.dumps(network.to_record()))
    assert Network.from_record(record) == network


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)


@given(JSON)
def test_any_record_is_a_network_or_one_clear_refusal(record: Any) -> None:
    try:
        Network.from_record(record)
    except HostNetworkError as exc:
        message = str(exc)
    else:
        return
    assert "cluster.json's network record" in message


@given(NETWORKS, st.sampled_from(["bridge", "netns", "address", "node", "name", "extra"]), JSON)
def test_an_edited_record_is_refused(network: Network, key: str, value: Any) -> None:
    """Its names go to `ip` as arguments: only exactly what the tag and prefix give is used."""
    record = network.to_record()
    if key == "bridge":
        record["bridge"] = value
    else:
        record["hosts"][0][key] = value
    if record == network.to_record():
        return
    with pytest.raises(HostNetworkError, match="network record"):
        Network.from_record(record)


def test_a_hostile_bridge_name_never_reaches_ip() -> None:
    record = hosts.plan("abcdef", "10.1.2", 1).to_record()
    record["bridge"] = "shb-abcdef; rm -rf /"
    with pytest.raises(HostNetworkError, match="differs from the names"):
        Network.from_record(record)


NETS = st.builds(
    lambda a, b, c, n: ipaddress.IPv4Network(f"10.{a}.{b}.{c}/{n}", strict=False),
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(8, 32),
)


@given(TAGS, st.lists(NETS, max_size=8))
@settings(deadline=None)  # with 10/8 in use it scans all 65,536 /24s: seconds on a loaded box
def test_the_chosen_24_overlaps_nothing_in_use(tag: str, used: list[ipaddress.IPv4Network]) -> None:
    ten = ipaddress.IPv4Network("10.0.0.0/8")
    if ten in ipaddress.collapse_addresses(used):  # a /8, or two /9s, ...: nothing is free
        with pytest.raises(HostNetworkError, match="every /24"):
            hosts.choose_prefix(tag, used)
        return
    prefix = hosts.choose_prefix(tag, used)
    chosen = ipaddress.IPv4Network(f"{prefix}.0/24")
    assert not any(chosen.overlaps(net) for net in used)
    assert hosts.choose_prefix(tag, used) == prefix


@given(TAGS)
def test_the_tag_alone_picks_the_24_on_a_machine_using_none(tag: str) -> None:
    other = format((int(tag, 16) + 1) % (1 << 24), "06x")
    assert hosts.choose_prefix(tag, []) != hosts.choose_prefix(other, [])
    default = [ipaddress.IPv4Network("0.0.0.0/0")]
    assert hosts.choose_prefix(tag, default) == hosts.choose_prefix(tag, [])


def test_the_run_dir_names_the_tag() -> None:
    assert hosts.run_tag(Path("/a/run")) == hosts.run_tag(Path("/a/run"))
    assert hosts.run_tag(Path("/a/run")) != hosts.run_tag(Path("/b/run"))
    assert len(hosts.run_tag(Path("/a/run"))) == hosts.TAG_LENGTH


@given(
    NETWORKS.flatmap(
        lambda n: st.tuples(
            st.just(n), st.lists(FAULTS, min_size=len(n.hosts), max_size=len(n.hosts))
        )
    )
)
def test_faults_block_pairs_from_both_sides(case: tuple[Network, list[Fault]]) -> None:
    network, drawn = case
    faults = {h.name: f for h, f in zip(network.hosts, drawn, strict=True)}
    entries = hosts.blocked(network, faults)
    by_address = {h.address: h for h in network.hosts}
    for h in network.hosts:
        for other in network.hosts:
            if other is h:
                continue
            cut = faults[h.name] is not Fault.NONE or faults[other.name] is not Fault.NONE
            assert ((h.netns, other.address) in entries) == cut
        isolated = faults[h.name] is Fault.ISOLATED
        assert ((h.netns, network.bridge_address) in entries) == isolated
        assert (("", h.address) in entries) == isolated
    for netns, address in entries:  # every entry names a real namespace and address
        assert netns == "" or any(h.netns == netns for h in network.hosts)
        assert address in by_address or address == network.bridge_address


@given(NETWORKS)
def test_no_fault_needs_no_entry(network: Network) -> None:
    assert hosts.blocked(network, {}) == frozenset()
    assert hosts.blocked(network, {h.name: Fault.NONE for h in network.hosts}) == frozenset()


def test_a_cut_keeps_the_coordinators_and_a_heal_of_one_keeps_the_others_cut() -> None:
    network = hosts.plan("abcdef", "10.1.2", 3)
    h1, h2, h3 = network.hosts
    cut = hosts.blocked(network, {"h1": Fault.CUT})
    assert cut == {
        (h1.netns, h2.address), (h2.netns, h1.address),
        (h1.netns, h3.address), (h3.netns, h1.address),
    }  # fmt: skip
    both = hosts.blocked(network, {"h1": Fault.CUT, "h2": Fault.CUT})
    healed = hosts.blocked(network, {"h2": Fault.CUT})
    assert (h1.netns, h2.address) in both
    assert (h1.netns, h2.address) in healed
    assert (h1.netns, h3.address) in both
    assert (h1.netns, h3.address) not in healed


@given(
    st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(JSON, max_size=3), JSON),
    st.one_of(st.none(), st.lists(JSON, max_size=3), JSON),
)
def test_any_ip_output_gives_a_list_of_networks(addresses: Any, routes: Any) -> None:
    assert all(isinstance(n, ipaddress.IPv4Network) for n in hosts.used_networks(addresses, routes))


def test_ip_output_names_the_networks_in_use() -> None:
    addresses = [{"addr_info": [{"family": "inet", "local": "10.9.8.7", "prefixlen": 16}]}]
    routes = [{"dst": "default"}, {"dst": "10.1.2.0/24"}, {"dst": "192.0.2.1"}]
    assert hosts.used_networks(addresses, routes) == [
        ipaddress.IPv4Network("10.9.0.0/16"),
        ipaddress.IPv4Network("10.1.2.0/24"),
        ipaddress.IPv4Network("192.0.2.1/32"),
    ]


def test_delay_sets_both_ends_and_zero_removes_only_what_is_there() -> None:
    host = hosts.plan("abcdef", "10.1.2", 1).hosts[0]
    set_ = hosts.delay_commands(host, 25, (False, False))
    assert set_ == [
        ["-n", host.netns, "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", "25ms"],
        ["qdisc", "replace", "dev", host.veth, "root", "netem", "delay", "25ms"],
    ]
    assert hosts.delay_commands(host, 0, (False, False)) == []
    assert hosts.delay_commands(host, 0, (False, True)) == [
        ["qdisc", "del", "dev", host.veth, "root"]
    ]


@pytest.mark.parametrize("ms", [-1, 60_001, float("nan"), float("inf")])
def test_a_delay_out_of_range_is_refused(ms: float) -> None:
    host = hosts.plan("abcdef", "10.1.2", 1).hosts[0]
    with pytest.raises(hosts.ConfigError, match="use 0 to 60000 milliseconds"):
        hosts.delay_commands(host, ms, (False, False))


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--hosts", "65"], "--hosts=65 is invalid: use an integer from 0 to 64"),
        (["--hosts", "-1"], "--hosts=-1 is invalid"),
        (["--hosts", "2", "--nodes", "3"], "every host runs one node daemon; leave out --nodes"),
    ],
)
def test_up_refuses_bad_host_counts_in_one_line(
    argv: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["up", *argv, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert words in err
    assert not (tmp_path / "run").exists()


def test_up_hosts_without_root_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hosts.os, "geteuid", lambda: 1000)
    assert main(["up", "--hosts", "2", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--hosts needs root" in err
    assert not (tmp_path / "run" / "cluster.json").exists()


def _edited_cluster(tmp_path: Path, edit: Any) -> Path:
    run_dir = tmp_path / "run"
    LocalCluster(run_dir).create([], hosts.plan("abcdef", "10.1.2", 2))
    path = run_dir / "cluster.json"
    path.write_bytes(edit(path.read_bytes()))
    return run_dir


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda b: b.replace(b'"shb-abcdef"', b'"eth0"'), "differs from the names"),
        (lambda b: b.replace(b'"tag": "abcdef"', b'"tag": "-rf /"'), "is not 6 hex digits"),
        (lambda b: b"[" * 100_000, "nests arrays and objects deeper"),
        (lambda b: b" " * (5 << 20), "more than the limit"),
        (lambda b: b'{"processes": [{"name": 1}]}', "a process entry `shoal up` does not write"),
    ],
)
def test_down_refuses_an_edited_cluster_json_in_one_line(
    edit: Any, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = _edited_cluster(tmp_path, edit)
    assert main(["down", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert words in err
