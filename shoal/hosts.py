"""Hosts you can test on one machine: each node daemon in a network namespace of its own.

`shoal up --hosts N` puts a Linux bridge `shb-<tag>` holding `<prefix>.1/24` in the root
namespace and N namespaces `shoal-<tag>-h<i>`, each joined to the bridge by a veth (`shv-<tag>-<i>`
on the bridge, `eth0` inside) and holding `<prefix>.<i+1>/24`, with `lo` up and a default route
via the bridge. Nothing but that network connects two hosts; coordinators bind the bridge address,
so every namespace reaches them. The tag is a hash of the run directory, so two clusters (tests
run two at once) never share a name, and the /24 is picked from 10.0.0.0/8 by the tag and checked
against the networks this machine already uses. Traffic stays on the machine: the bridge has no
uplink, shoal sends nothing off the /24, and shoal never turns on the root namespace's forwarding.

Faults between hosts need only `ip`: a cut makes each side's neighbour entry for the other point
at a MAC address no interface has, so frames are sent and silently lost, as on a pulled cable
(connections time out; nothing is refused). That works where `nft`, `iptables` and tc's `gact`
action are all missing, as on the machine shoal is developed on. A host's fault is kept in the kernel
beside it, as the alias of its bridge-side veth, so any process can cut, and another heal, and
the record goes with the network. Delay uses tc's netem qdisc, where the kernel has it.

The planner (names, addresses, which neighbour entries a set of faults needs) is pure; the
functions below it run `ip`/`tc` with argument lists and turn every failure into a
`HostNetworkError` carrying the command, its stderr and what to do.

One module of about 540 lines on purpose: it is one naming scheme and the only code that acts
on it. `plan` makes the names, `Network.from_record` accepts only what `plan` makes,
`remove_tagged` finds what a crashed run left by the same patterns, and the faults read back
the alias they wrote; split, each part would restate the others' names. Its two halves are
already apart inside it (the pure planner, tested alone in tests/shoal/test_hosts_plan.py, and
the functions that run `ip`/`tc`), and callers use it as one namespace (`hosts.plan`, `hosts.cut`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from shoal.errors import ConfigError, ShoalError

MAX_HOSTS = 64
TAG_LENGTH = 6
IFACE = "eth0"
"""The host's end of its veth, inside its namespace (each namespace has its own names)."""
LOST_MAC = "02:73:68:6f:61:6c"
"""Where a cut host's frames go: a locally administered address no interface has."""
FAULT_ALIAS = "shoal-fault:"
NETNS_ETC = Path("/etc/netns")
"""`ip netns exec NS` bind-mounts /etc/netns/NS/resolv.conf over /etc/resolv.conf."""
RESOLV_CONF = """\
# shoal host namespace: no name server reachable from here, so a lookup (torch's reverse
# lookup of a peer's address, say) fails at once instead of waiting out the host's resolver
# through the bridge.
nameserver 127.0.0.1
options timeout:1 attempts:1
"""
SUPERNET = ipaddress.IPv4Network("10.0.0.0/8")
_TAG = re.compile(rf"[0-9a-f]{{{TAG_LENGTH}}}")
_PREFIX = re.compile(r"10\.(\d{1,3})\.(\d{1,3})")


class HostNetworkError(ShoalError):
    """Creating, faulting or removing the hosts' network failed; the message names the command,
    what it said and what to do."""


class NetemUnavailable(HostNetworkError):
    """This kernel has no netem qdisc, so `delay` cannot slow a host's links."""


class Fault(Enum):
    """What is done to one host: cut from the other hosts, or isolated from everything."""

    NONE = ""
    CUT = "cut"
    ISOLATED = "isolated"


@dataclass(frozen=True)
class Host:
    """One host: its namespace, the bridge side of its veth, its address and its node daemon."""

    name: str
    netns: str
    veth: str
    address: str
    node: str


@dataclass(frozen=True)
class Network:
    """The bridge and the hosts of one cluster, as `cluster.json` records them."""

    tag: str
    bridge: str
    prefix: str
    hosts: tuple[Host, ...]

    @property
    def bridge_address(self) -> str:
        return f"{self.prefix}.1"

    @property
    def cidr(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{self.prefix}.0/24")

    def host(self, name: str) -> Host:
        """The host called `name` (`h2`) or running node `name` (`n2`)."""
        for host in self.hosts:
            if name in (host.name, host.node):
                return host
        raise HostNetworkError(
            f"no host {name!r} in network {self.bridge}; hosts: "
            f"{', '.join(h.name for h in self.hosts)}"
        )

    def names(self) -> list[str]:
        """Every name `ip` knows this network by (names in cluster.json, error messages)."""
        return [self.bridge, *(h.netns for h in self.hosts), *(h.veth for h in self.hosts)]

    def to_record(self) -> dict[str, Any]:
        return {
            "tag": self.tag,
            "bridge": self.bridge,
            "prefix": self.prefix,
            "hosts": [
                {"name": h.name, "netns": h.netns, "address": h.address, "node": h.node}
                for h in self.hosts
            ],
        }

    @classmethod
    def from_record(cls, record: object) -> Network:
        """The network a `cluster.json` recorded. The record is a file anyone may have edited
        and its names go to `ip`: only exactly what `plan` makes from its tag, prefix and host
        count is accepted."""
        if not isinstance(record, dict):
            raise _bad_record("is not an object")
        tag, prefix, hosts = record.get("tag"), record.get("prefix"), record.get("hosts")
        if not isinstance(tag, str) or not _TAG.fullmatch(tag):
            raise _bad_record(f"tag {tag!r} is not {TAG_LENGTH} hex digits")
        if not isinstance(prefix, str) or not _valid_prefix(prefix):
            raise _bad_record(f"prefix {prefix!r} is not a /24 of {SUPERNET}")
        if not isinstance(hosts, list) or not 1 <= len(hosts) <= MAX_HOSTS:
            raise _bad_record(f"hosts must be a list of 1 to {MAX_HOSTS} hosts")
        network = plan(tag, prefix, len(hosts))
        if network.to_record() != record:
            raise _bad_record("differs from the names its tag and prefix give")
        return network


def _bad_record(why: str) -> HostNetworkError:
    return HostNetworkError(
        f"cluster.json's network record {why}; remove the network by hand "
        "(`ip netns list`, `ip link`) and start over with a fresh --run-dir"
    )


def _valid_prefix(prefix: str) -> bool:
    match = _PREFIX.fullmatch(prefix)
    return match is not None and all(int(octet) <= 255 for octet in match.groups())


# -- the planner (pure) ----------------------------------------------------------------------


def run_tag(run_dir: Path) -> str:
    """A short name for the cluster in `run_dir`, the same every time for the same path."""
    return hashlib.sha256(str(run_dir).encode()).hexdigest()[:TAG_LENGTH]


def plan(tag: str, prefix: str, hosts: int) -> Network:
    """Names and addresses of `hosts` hosts h1..hN on `prefix`.0/24 (the bridge holds .1)."""
    if not 1 <= hosts <= MAX_HOSTS:
        raise ConfigError(f"--hosts={hosts} is invalid: use an integer from 1 to {MAX_HOSTS}")
    return Network(
        tag=tag,
        bridge=f"shb-{tag}",
        prefix=prefix,
        hosts=tuple(
            Host(
                name=f"h{i}",
                netns=f"shoal-{tag}-h{i}",
                veth=f"shv-{tag}-{i}",
                address=f"{prefix}.{i + 1}",
                node=f"n{i}",
            )
            for i in range(1, hosts + 1)
        ),
    )


def choose_prefix(tag: str, used: Iterable[ipaddress.IPv4Network]) -> str:
    """The first /24 of 10.0.0.0/8, counting on from the one the tag names, that overlaps no
    network in `used` (what this machine's addresses and routes already cover; a default
    route covers nothing)."""
    taken: set[int] = set()
    for net in used:
        if net.prefixlen > 0 and net.overlaps(SUPERNET):
            taken.update(range(_slash24(net.network_address), _slash24(net.broadcast_address) + 1))
    start = int(tag, 16) % 65536
    for step in range(65536):
        index = (start + step) % 65536
        if index not in taken:
            return f"10.{index >> 8}.{index & 255}"
    raise HostNetworkError(
        f"every /24 of {SUPERNET} overlaps a network this machine uses; free one "
        "(`ip route`) to make hosts"
    )


def _slash24(address: ipaddress.IPv4Address) -> int:
    """Which /24 of 10.0.0.0/8 `address` falls in, clamped to the ends of 10.0.0.0/8."""
    offset = int(address) - int(SUPERNET.network_address)
    return min(max(offset >> 8, 0), 65535)


def blocked(network: Network, faults: Mapping[str, Fault]) -> frozenset[tuple[str, str]]:
    """The neighbour entries the faults need, as (namespace, address): the namespace's entry for
    that address points nowhere. The root namespace is "" (its entries sit on the bridge).

    A cut host and any other host lose each other; an isolated one also loses the bridge, in
    both directions. Every pair appears from both sides, so no reply finds a way back either."""
    out: set[tuple[str, str]] = set()
    for host in network.hosts:
        fault = faults.get(host.name, Fault.NONE)
        if fault is Fault.NONE:
            continue
        for other in network.hosts:
            if other is not host:
                out |= {(host.netns, other.address), (other.netns, host.address)}
        if fault is Fault.ISOLATED:
            out |= {(host.netns, network.bridge_address), ("", host.address)}
    return frozenset(out)


def create_commands(network: Network) -> list[list[str]]:
    """The `ip` argument lists that make the network, in order."""
    bridge = network.bridge
    commands = [
        ["link", "add", bridge, "type", "bridge"],
        ["addr", "add", f"{network.bridge_address}/24", "dev", bridge],
        ["link", "set", bridge, "up"],
    ]
    for host in network.hosts:
        ns = host.netns
        commands += [
            ["netns", "add", ns],
            ["link", "add", host.veth, "type", "veth", "peer", "name", IFACE, "netns", ns],
            ["link", "set", host.veth, "master", bridge, "up"],
            ["-n", ns, "addr", "add", f"{host.address}/24", "dev", IFACE],
            ["-n", ns, "link", "set", IFACE, "up"],
            ["-n", ns, "link", "set", "lo", "up"],
            ["-n", ns, "route", "add", "default", "via", network.bridge_address],
        ]
    return commands


def used_networks(addresses: object, routes: object) -> list[ipaddress.IPv4Network]:
    """The IPv4 networks in `ip -j addr` and `ip -j route` output (anything unexpected in them
    is skipped: at worst a /24 in use is not seen, and creating the bridge address fails)."""
    out = []
    for link in addresses if isinstance(addresses, list) else []:
        infos = link.get("addr_info", []) if isinstance(link, dict) else []
        for info in infos if isinstance(infos, list) else []:
            if isinstance(info, dict) and info.get("family") == "inet":
                out += _network(f"{info.get('local')}/{info.get('prefixlen')}")
    for route in routes if isinstance(routes, list) else []:
        if isinstance(route, dict) and route.get("dst") not in (None, "default"):
            out += _network(str(route["dst"]))
    return out


def _network(text: str) -> list[ipaddress.IPv4Network]:
    try:
        return [ipaddress.IPv4Network(text, strict=False)]
    except ValueError:
        return []


# -- running ip and tc -----------------------------------------------------------------------


def check_can_create() -> None:
    """`--hosts` needs root (namespaces, links) and iproute2's `ip`: one line if either lacks."""
    if os.geteuid() != 0:
        raise ConfigError(
            "--hosts needs root (it creates network namespaces and a bridge); run as root, "
            "or use --nodes to run the node daemons on this host's own network"
        )
    _tool("ip")


def can_manage() -> bool:
    """Whether this process may make and remove hosts' networks (root, with `ip`)."""
    try:
        check_can_create()
    except ShoalError:
        return False
    return True


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if path is None:
        raise HostNetworkError(f"`{name}` is not installed; install iproute2 to use --hosts")
    return path


def _run(tool: str, args: list[str], what: str) -> str:
    argv = [_tool(tool), *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30)
    except subprocess.CalledProcessError as exc:
        said = (exc.stderr or "").strip().splitlines()
        raise HostNetworkError(
            f"`{tool} {' '.join(args)}` failed ({said[-1] if said else f'exit {exc.returncode}'})"
            f"; {what}"
        ) from None
    except subprocess.TimeoutExpired:
        raise HostNetworkError(f"`{tool} {' '.join(args)}` hung for 30 s; {what}") from None
    return done.stdout


def _json(tool: str, args: list[str], what: str) -> Any:
    text = _run(tool, ["-j", *args], what)
    try:
        return json.loads(text) if text.strip() else []
    except ValueError:
        raise HostNetworkError(f"`{tool} -j {' '.join(args)}` printed no JSON; {what}") from None


def machine_networks() -> list[ipaddress.IPv4Network]:
    what = "check that iproute2 works (`ip addr`)"
    return used_networks(
        _json("ip", ["-4", "addr", "show"], what), _json("ip", ["-4", "route", "show"], what)
    )


def create(network: Network) -> None:
    """Make the bridge, namespaces and veths; on a failure remove what was made, then raise."""
    clash = [net for net in machine_networks() if net.overlaps(network.cidr)]
    if clash:
        raise HostNetworkError(
            f"{network.cidr} overlaps {clash[0]}, which this machine already uses; start the "
            "cluster in a fresh --run-dir (it picks another /24)"
        )
    try:
        for args in create_commands(network):
            _run("ip", args, f"removing what was made and giving up on {network.bridge}")
        for host in network.hosts:
            _write_resolv_conf(host.netns)
    except (HostNetworkError, OSError):
        remove(network)
        raise


def _write_resolv_conf(netns: str) -> None:
    directory = NETNS_ETC / netns
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "resolv.conf").write_text(RESOLV_CONF)


def remove(network: Network) -> None:
    """Remove the network: veths, namespaces and bridge, whichever of them exist."""
    remove_tagged(network.tag)


def remove_tagged(tag: str) -> list[str]:
    """Remove every bridge, veth and namespace named for `tag`, whether a cluster made them all
    or crashed halfway; the names removed."""
    if not _TAG.fullmatch(tag):
        raise HostNetworkError(f"tag {tag!r} is not {TAG_LENGTH} hex digits")
    links = re.compile(rf"shv-{tag}-\d+|shb-{tag}")
    spaces = re.compile(rf"shoal-{tag}-h\d+")
    what = "remove it by hand (`ip netns del NAME`, `ip link del NAME`)"
    gone = []
    names = sorted(_links(), key=lambda n: n.startswith("shb-"))  # veths before the bridge
    for name in (n for n in names if links.fullmatch(n)):
        _delete(["link", "del", name], name, lambda n: n in _links(), what)
        gone.append(name)
    for name in (n for n in _namespaces() if spaces.fullmatch(n)):
        _delete(["netns", "del", name], name, lambda n: n in _namespaces(), what)
        gone.append(name)
    for directory in NETNS_ETC.glob(f"shoal-{tag}-h*") if NETNS_ETC.is_dir() else ():
        if spaces.fullmatch(directory.name):
            shutil.rmtree(directory, ignore_errors=True)
    return gone


def _delete(args: list[str], name: str, present: Callable[[str], bool], what: str) -> None:
    """A namespace being torn down takes its veth with it: gone by now is as good as removed."""
    try:
        _run("ip", args, what)
    except HostNetworkError:
        if present(name):
            raise


def _links() -> list[str]:
    listed = _json("ip", ["link", "show"], "check that iproute2 works (`ip link`)")
    return [str(link.get("ifname")) for link in listed if isinstance(link, dict)]


def _namespaces() -> list[str]:
    listed = _json("ip", ["netns", "list"], "check that iproute2 works (`ip netns list`)")
    return [str(ns.get("name")) for ns in listed if isinstance(ns, dict)]


def exec_prefix(host: Host) -> list[str]:
    """What runs a command inside `host`: `ip netns exec` execs it, so its pid is the command's
    and a parent-death signal set before survives."""
    return [_tool("ip"), "netns", "exec", host.netns]


# -- faults ----------------------------------------------------------------------------------


def pids(network: Network, name: str) -> list[int]:
    """Every process whose network namespace is host `name`'s (`ip netns pids`): what dies
    when that host does."""
    netns = network.host(name).netns
    said = _run("ip", ["netns", "pids", netns], "is the cluster up?")
    return [int(word) for word in said.split() if word.isdigit()]


def cut(network: Network, name: str) -> None:
    """Drop traffic between host `name` and the other hosts; the coordinators stay reachable."""
    _set_fault(network, name, Fault.CUT)


def isolate(network: Network, name: str) -> None:
    """Drop all of host `name`'s traffic: the other hosts and the coordinators."""
    _set_fault(network, name, Fault.ISOLATED)


def heal(network: Network, name: str) -> None:
    """End host `name`'s cut or isolation (pairs another host's fault still blocks stay so)."""
    _set_fault(network, name, Fault.NONE)


def faults(network: Network) -> dict[str, Fault]:
    """Each host's fault as the kernel records it (alias of the bridge-side veth)."""
    by_veth = {h.veth: h.name for h in network.hosts}
    out = {}
    for link in _json("ip", ["link", "show", "master", network.bridge], _gone(network)):
        name = by_veth.get(link.get("ifname", "")) if isinstance(link, dict) else None
        alias = str(link.get("ifalias", "")) if name else ""
        if name and alias.startswith(FAULT_ALIAS):
            try:
                out[name] = Fault(alias.removeprefix(FAULT_ALIAS))
            except ValueError:
                continue
    return out


def _set_fault(network: Network, name: str, fault: Fault) -> None:
    host = network.host(name)
    alias = FAULT_ALIAS + fault.value if fault is not Fault.NONE else ""
    _run("ip", ["link", "set", host.veth, "alias", alias], _gone(network))
    want = blocked(network, faults(network))
    have = _lost_entries(network)
    for netns, address in sorted(have - want):
        _run(
            "ip",
            [*_in(netns), "neigh", "del", address, "dev", _dev(network, netns)],
            _gone(network),
        )
    for netns, address in sorted(want - have):
        dev = _dev(network, netns)
        args = ["neigh", "replace", address, "lladdr", LOST_MAC, "dev", dev, "nud", "permanent"]
        _run("ip", [*_in(netns), *args], _gone(network))


def _lost_entries(network: Network) -> frozenset[tuple[str, str]]:
    """The neighbour entries that now point nowhere, in the root namespace and every host."""
    out = set()
    for netns in ["", *(h.netns for h in network.hosts)]:
        args = [*_in(netns), "neigh", "show", "dev", _dev(network, netns)]
        for entry in _json("ip", args, _gone(network)):
            if isinstance(entry, dict) and entry.get("lladdr") == LOST_MAC:
                out.add((netns, str(entry.get("dst"))))
    return frozenset(out)


def _in(netns: str) -> list[str]:
    return ["-n", netns] if netns else []


def _dev(network: Network, netns: str) -> str:
    return IFACE if netns else network.bridge


def _gone(network: Network) -> str:
    return f"is the cluster of {network.bridge} still up? (`shoal up --hosts N` makes it)"


def delay(network: Network, name: str, ms: float) -> None:
    """Delay every packet host `name` sends and every packet sent to it by `ms` milliseconds
    (netem on both ends of its veth); 0 removes the delay. Needs the kernel's netem qdisc."""
    host = network.host(name)
    for args in delay_commands(host, ms, _netem_on(host)):
        try:
            _run("tc", args, _gone(network))
        except HostNetworkError as exc:
            if "qdisc kind is unknown" in str(exc):
                raise NetemUnavailable(
                    "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so host links "
                    "cannot be delayed; delay links at the application level (chaos's fault "
                    "proxy), or run on a kernel with sch_netem"
                ) from None
            raise


def delay_commands(host: Host, ms: float, present: tuple[bool, bool]) -> list[list[str]]:
    """The `tc` argument lists that set (or with 0 remove) the delay on the host's side and the
    bridge's side of its veth; `present` says where a netem qdisc already is."""
    if not 0 <= ms <= 60_000:
        raise ConfigError(f"delay {ms!r} ms is invalid: use 0 to 60000 milliseconds")
    ends = [(["-n", host.netns], IFACE), ([], host.veth)]
    out = []
    for (where, dev), there in zip(ends, present, strict=True):
        if ms:
            out.append(
                [*where, "qdisc", "replace", "dev", dev, "root", "netem", "delay", f"{ms:g}ms"]
            )
        elif there:
            out.append([*where, "qdisc", "del", "dev", dev, "root"])
    return out


def _netem_on(host: Host) -> tuple[bool, bool]:
    what = "check that tc works (`tc qdisc show`)"
    inside = _json("tc", ["-n", host.netns, "qdisc", "show", "dev", IFACE], what)
    outside = _json("tc", ["qdisc", "show", "dev", host.veth], what)
    return (_has_netem(inside), _has_netem(outside))


def _has_netem(qdiscs: object) -> bool:
    return isinstance(qdiscs, list) and any(
        isinstance(q, dict) and q.get("kind") == "netem" for q in qdiscs
    )
