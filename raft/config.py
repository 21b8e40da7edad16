"""Typed configuration of a coordinator replica; every check names the key, value and fix."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.errors import ConfigError
from shoal.runtime.tls import TlsFiles, tls_from_env
from shoal.scheduler.signals import BalancerConfig

MIN_SECRET_CHARS = 16
"""pysyncobj derives its key from the secret with PBKDF2 and a salt fixed in its source, so a
short secret can be guessed offline from one captured Raft message."""


def parse_address(key: str, value: str) -> tuple[str, int]:
    """'HOST:PORT' -> (host, port), or ConfigError naming `key`."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{key}={value!r} is not HOST:PORT with a port in 1..65535")
    return host, int(port)


def _require_finite(section: str, config: Any) -> None:
    """NaN slips through every `>` check and inf means 'never': refuse both by name."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{section}.{f.name}={value!r} must be a finite number of seconds")


@dataclass(frozen=True)
class RaftTimings:
    """pysyncobj timings. The defaults aim at a 0.2-0.3 s failover on a LAN (pysyncobj's own
    defaults give 0.5-1.4 s) and unbatched appends for low latency of sequential writes."""

    append_period: float = 0.05
    """Leader heartbeat (append_entries) interval, seconds; below min_timeout / 3."""
    min_timeout: float = 0.2
    """Shortest election timeout, seconds."""
    max_timeout: float = 0.35
    """Longest election timeout, seconds; the spread avoids split votes."""
    connection_timeout: float = 1.0
    """Silence after which a peer connection counts as dead; >= max_timeout."""
    reconnect_period: float = 0.2
    """How often to retry a lost peer (pysyncobj's 5 s default slows a restarted replica)."""
    leader_fallback: float = 1.0
    """A leader that hears from no majority this long steps down, so writes fail fast."""
    batch_appends: bool = False
    """Batch log entries per append (throughput) instead of sending each at once (latency)."""
    tick_period: float = 0.05
    """Longest sleep of pysyncobj's tick thread when no socket is ready."""

    def __post_init__(self) -> None:
        _require_finite("raft", self)
        for key in ("append_period", "min_timeout", "tick_period", "reconnect_period"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"raft.{key}={getattr(self, key)!r} must be > 0 seconds")
        if not self.min_timeout > 3 * self.append_period:
            raise ConfigError(
                f"raft.min_timeout={self.min_timeout} must exceed 3 x raft.append_period "
                f"({3 * self.append_period:g})"
            )
        if not self.max_timeout > self.min_timeout:
            raise ConfigError(
                f"raft.max_timeout={self.max_timeout} must exceed raft.min_timeout={self.min_timeout}"
            )
        if not self.connection_timeout >= self.max_timeout:
            raise ConfigError(
                f"raft.connection_timeout={self.connection_timeout} must be >= raft.max_timeout={self.max_timeout}"
            )
        if not self.leader_fallback > self.append_period:
            raise ConfigError(
                f"raft.leader_fallback={self.leader_fallback} must exceed raft.append_period"
            )


@dataclass(frozen=True)
class LivenessConfig:
    """How long the leader waits without a heartbeat before it marks a node suspect, then dead."""

    suspect_after: float = 3.0
    dead_after: float = 10.0
    check_period: float = 0.25
    """How often the leader looks for overdue nodes (bounds dead-node detection jitter)."""
    health_period: float = 2.0
    """Health summaries are replicated in one batched command this often."""

    def __post_init__(self) -> None:
        _require_finite("liveness", self)
        for key in ("suspect_after", "check_period", "health_period"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"liveness.{key}={getattr(self, key)!r} must be > 0 seconds")
        if not self.dead_after > self.suspect_after:
            raise ConfigError(
                f"liveness.dead_after={self.dead_after} must exceed liveness.suspect_after={self.suspect_after}"
            )


@dataclass(frozen=True)
class SchedulingConfig:
    """The leader's scheduler loop (raft/scheduling.py): its period and the balancer's thresholds."""

    period: float = 0.5
    """Seconds between two scheduling rounds (placement of pending tasks, re-placement, balance)."""
    balancer: BalancerConfig = field(default_factory=BalancerConfig)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.period) and self.period > 0):
            raise ConfigError(
                f"scheduler.period={self.period!r} must be a finite number > 0 seconds"
            )


@dataclass(frozen=True)
class ChaosSection:
    """The `[chaos]` table: whether the chaos API (`/v1/chaos/faults`) exists on this replica.
    Off by default, so a production cluster cannot be faulted by anyone holding its token."""

    enabled: bool = False
    """Serve the chaos routes; when false they answer 404 saying how to turn them on."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"chaos.enabled={self.enabled!r} must be true or false")


@dataclass(frozen=True)
class CoordinatorConfig:
    """One replica: its ids and addresses, its data directory, its secrets, its timings."""

    replica_id: str
    raft: str
    peers: tuple[str, ...]
    api: str
    data_dir: Path
    secret: str
    """pysyncobj's `password`: it encrypts and authenticates every Raft message, which
    pysyncobj pickles, so it is required on loopback too (`shoal up` generates one)."""
    token: str
    """The operator token: every route, job submission included."""
    node_token: str | None = None
    """The node credential: node daemons' and their tasks' routes and every read; None: none."""
    read_token: str | None = None
    """The read-only token for dashboards and scrapers: every GET; None: none."""
    task_entry_points: tuple[str, ...] | None = None
    """Import-path prefixes a job's tasks may name besides shoal's own (`shoal.`); None (the
    `[api]` key absent) admits every entry point."""
    timings: RaftTimings = field(default_factory=RaftTimings)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    write_timeout: float = 5.0
    settings_source: str = "defaults"
    """Where timings, liveness and scheduling came from: an operator's file or the defaults."""
    chaos: ChaosSection = field(default_factory=ChaosSection)
    raft_bind: str | None = None
    """Where Raft listens when peers reach this replica through another address (`raft`), such
    as a proxy in front of it; None binds `raft` itself."""
    tls: TlsFiles | None = field(default_factory=tls_from_env)
    """Serve the admin API over HTTPS with this certificate (`$SHOAL_TLS_DIR` by default) and
    forward to other replicas with its CA; None serves plain HTTP."""

    def __post_init__(self) -> None:
        if not self.replica_id or not self.replica_id.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"--id={self.replica_id!r} must be letters, digits, '-' or '_'")
        parse_address("--raft", self.raft)
        parse_address("--api", self.api)
        for peer in self.peers:
            parse_address("--peers", peer)
        if self.raft_bind is not None:
            parse_address("--raft-bind", self.raft_bind)
        if self.raft in self.peers:
            raise ConfigError(
                f"--peers lists this replica's own --raft address {self.raft}; list only the others"
            )
        if not self.token:
            raise ConfigError("the API token is empty; pass --token-file with a non-empty token")
        self._check_role_tokens()
        if not self.secret:
            raise ConfigError(
                "refusing to start without the cluster secret: Raft traffic is pickled, so it "
                "must be encrypted; pass --secret-file FILE (mode 0600, the same file on every "
                "replica; docs/operations.md shows how to make one)"
            )
        if len(self.secret) < MIN_SECRET_CHARS:
            raise ConfigError(
                f"the cluster secret has {len(self.secret)} characters; use at least "
                f"{MIN_SECRET_CHARS}, e.g. python3 -c 'import secrets; "
                "print(secrets.token_urlsafe(32))' > FILE"
            )
        if not self.write_timeout > 0:
            raise ConfigError(f"write_timeout={self.write_timeout!r} must be > 0 seconds")

    def _check_role_tokens(self) -> None:
        """Three distinct credentials: an empty one or one equal to another would silently
        give its holder more (or less) than its role."""
        given = {"--token-file": self.token}
        for flag, value in (
            ("--node-token-file", self.node_token),
            ("--read-token-file", self.read_token),
        ):
            if value is None:
                continue
            if not value:
                raise ConfigError(f"the token in {flag} is empty; write a non-empty token")
            for other, known in given.items():
                if value == known:
                    raise ConfigError(
                        f"{flag} holds the same token as {other}; each role needs its own token"
                    )
            given[flag] = value

    @property
    def api_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.api}"

    @property
    def raft_listen(self) -> str:
        """The one address Raft listens on: `raft_bind`, else `raft` itself."""
        return self.raft_bind or self.raft


@dataclass(frozen=True)
class SchedulerSection:
    """The `[scheduler]` table of a coordinator config file."""

    period: float = SchedulingConfig.period
    """Seconds between two scheduling rounds of the leader."""

    def __post_init__(self) -> None:
        SchedulingConfig(period=self.period)


@dataclass(frozen=True)
class ApiSection:
    """The `[api]` table: which task entry points a submitted job may name."""

    task_entry_points: tuple[str, ...] | None = None
    """Import-path prefixes allowed besides shoal's own (`shoal.`), e.g. "mylab.tasks."; once
    set, a job naming any other entry point is refused. Absent: every entry point is allowed."""

    def __post_init__(self) -> None:
        points = self.task_entry_points
        if points is None:
            return
        if isinstance(points, list):
            object.__setattr__(self, "task_entry_points", points := tuple(points))
        if not isinstance(points, tuple) or not all(isinstance(p, str) and p for p in points):
            raise ConfigError(
                f"api.task_entry_points={points!r} must be a list of non-empty import-path "
                'prefixes, e.g. ["mylab.tasks."]'
            )


@dataclass(frozen=True)
class CoordinatorSettings:
    """What an operator may tune in `shoal coordinator --config FILE.toml`: one table per
    concern, each checked by its own dataclass, so a bad value names its table and key."""

    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    balancer: BalancerConfig = field(default_factory=BalancerConfig)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)
    raft: RaftTimings = field(default_factory=RaftTimings)
    chaos: ChaosSection = field(default_factory=ChaosSection)
    api: ApiSection = field(default_factory=ApiSection)

    @property
    def scheduling(self) -> SchedulingConfig:
        return SchedulingConfig(period=self.scheduler.period, balancer=self.balancer)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)
