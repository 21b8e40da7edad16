"""The node daemon's settings (`shoal node`'s options) and their checks, apart from the daemon
that runs with them (shoal/node.py), so the command line builds and checks a NodeConfig without
importing the daemon's health collectors and agent.

Every value is checked once, here, and an invalid one is a ConfigError naming the option, the
value and what would be valid.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from shoal.agent_policy import AgentConfig
from shoal.config import check_number
from shoal.errors import ConfigError

NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")
LABEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
DCGM_HOST_RE = re.compile(r"unix:///[^\s\x00]{1,106}|[A-Za-z0-9.:\[\]-]{1,253}")
PTP_SOCKET_RE = re.compile(r"/[^\s\x00]{1,106}")


@dataclass(frozen=True)
class NodeConfig:
    """Everything `shoal node` needs; invalid values raise ConfigError naming the option."""

    coordinators: tuple[str, ...]
    """The API URLs of the coordinator replicas (any subset works; all is best)."""
    data_dir: Path
    token: str
    """The API bearer token; also the cluster token of the actor transport."""
    node_id: str | None = None
    """None: the id stored in the data dir, or a new `<hostname>-<hex>` stored there."""
    listen: str = "127.0.0.1:0"
    """The actor transport's address; port 0 picks a free one."""
    stream_port: int = 0
    """Where the transport takes its links' frame streams; 0 picks a free port (announced
    to peers in each link's handshake). Fixed, a firewall or proxy can be set up for it."""
    sim_gpus: int = 0
    island_size: int = 16
    """GPUs per NVLink island: GPU i is in island i // island_size of this node."""
    domain: str = "default"
    """This node's RDMA domain label."""
    labels: dict[str, str] = field(default_factory=dict)
    clock: str | None = None
    """HOST:PORT of a clock responder (shoal.scheduler.health.clock) to measure the offset."""
    dcgm_host: str = "127.0.0.1"
    """The DCGM host engine: IP (port 5555), IP:PORT or unix://PATH; the collector is built
    only when DCGM answers there."""
    ptp_socket: str | None = None
    """ptp4l's Unix socket (its uds_address) when not the default /var/run/ptp4l."""
    health_s: float = 2.0
    metrics: str | None = None
    """HOST:PORT of the Prometheus scrape server (`/metrics`); None serves none."""
    request_timeout_s: float = 2.0
    agent: AgentConfig = field(default_factory=AgentConfig)

    def __post_init__(self) -> None:
        if not self.coordinators:
            raise ConfigError(
                "--coordinators is empty: give the replicas' API URLs, comma-separated"
            )
        for url in self.coordinators:
            if not re.fullmatch(r"https?://[^/\s]+", url.rstrip("/")):
                raise ConfigError(
                    f"--coordinators entry {url!r} is invalid: use http://HOST:PORT of a replica's API"
                )
        if not self.token:
            raise ConfigError("the API token is empty: pass --token-file or set $SHOAL_API_TOKEN")
        if self.node_id is not None and not NODE_ID_RE.fullmatch(self.node_id):
            raise ConfigError(
                f"--node-id={self.node_id!r} is invalid: use 1-128 letters, digits or ._:@/- "
                "starting with a letter or digit"
            )
        parse_listen(self.listen)
        if type(self.stream_port) is not int or not 0 <= self.stream_port <= 65535:
            raise ConfigError(
                f"--stream-port={self.stream_port!r} is invalid: use 0 (any free port) to 65535"
            )
        if type(self.sim_gpus) is not int or not 0 <= self.sim_gpus <= 1024:
            raise ConfigError(f"--sim-gpus={self.sim_gpus!r} is invalid: use 0 to 1024")
        if type(self.island_size) is not int or self.island_size < 1:
            raise ConfigError(f"--island-size={self.island_size!r} is invalid: use an int >= 1")
        if not LABEL_RE.fullmatch(self.domain):
            raise ConfigError(
                f"--domain={self.domain!r} is invalid: use 1-128 letters, digits or ._/-"
            )
        for key, value in self.labels.items():
            if not LABEL_RE.fullmatch(key) or not isinstance(value, str) or len(value) > 256:
                raise ConfigError(
                    f"--label {key}={value!r} is invalid: KEY is letters, digits or ._/-, "
                    "VALUE at most 256 characters"
                )
        if self.clock is not None:
            parse_listen(self.clock, "--clock")
        if not DCGM_HOST_RE.fullmatch(self.dcgm_host):
            raise ConfigError(
                f"--dcgm-host={self.dcgm_host!r} is invalid: use IP, IP:PORT or unix://PATH "
                "of the DCGM host engine (nv-hostengine)"
            )
        if self.ptp_socket is not None and not PTP_SOCKET_RE.fullmatch(self.ptp_socket):
            raise ConfigError(
                f"--ptp-socket={self.ptp_socket!r} is invalid: use the absolute path of "
                "ptp4l's uds_address (at most 107 characters)"
            )
        if self.metrics is not None:
            parse_listen(self.metrics, "--metrics")
        check_number("--health-period", self.health_s, above=0)
        check_number("request_timeout_s", self.request_timeout_s, above=0)


def parse_listen(value: str, key: str = "--listen") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{key}={value!r} is invalid: use HOST:PORT with a port in 0..65535")
    return host.strip("[]"), int(port)
