"""Scenario files: a timed list of faults and the invariants to check, parsed and validated
here without I/O beyond reading the text. Every mistake names the field, the value and what
would be valid.

    name = "leader-kill"
    replicas = 3            # coordinator replicas the runner starts
    duration_s = 30         # how long the client workload runs
    clients = 4             # concurrent clients writing and reading registers
    keys = 4                # registers they share
    rate = 50               # operations per second each client starts, at most
    recover_within_s = 20   # default bound on each fault's recovery
    nodes = 1               # node daemons n1..nN (0: none), each with sim_gpus simulated GPUs
    sim_gpus = 4
    invariants = ["linearizable", "digests_equal", "checkpoints_forward", "no_leaks", "recovered"]

    [training]              # one training job through the cluster for the whole scenario
    env = "acrobot"         # ranks, workers, checkpoint_interval_s, seed, start_within_s too;
                            # gpus_per_rank; spread = true: no two rollout workers on one host

    [[faults]]
    kind = "kill"           # see FAULT_KINDS; raft-partition cuts a replica's Raft links;
                            # learner-kill / rollout-kill SIGKILL a task process of the job;
                            # coord-* fault one node's links to every replica's API;
                            # host-* fault a host (`shoal chaos run --hosts N`: each node in a
                            # network namespace): host-cut cuts it off the other hosts,
                            # host-kill SIGKILLs everything on it (its node comes back at the
                            # heal), host-delay delays its links by delay_ms (netem);
                            # learner-move drains the learners' node so the group moves
    target = "leader"       # leader | follower | c1..cN | all (api-* kinds) | n1..nN (node and
                            # coord-* kinds; also "learners": the node running learner rank 0;
                            # coord-* also "all": every node; learner-move only "learners") |
                            # rank0.. (learner-kill) | w0.. (rollout-kill) |
                            # all | rank0.. | w0.. (link-* kinds: every rollout<->learner link,
                            # or those of one learner rank or rollout worker, via the link relay)
    at = 5.0                # seconds after the workload started
    duration = 3.0          # then healed (a killed process is restarted)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.chaos.errors import ProxyError, ScenarioError
from shoal.chaos.job_process import JobConfig
from shoal.chaos.traffic import NetFaults
from shoal.config import parse_toml, read_toml
from shoal.errors import ConfigError

PROCESS_KINDS = ("kill", "pause")
NET_KINDS = ("api-partition", "api-delay", "api-loss", "api-bandwidth", "api-reset")
# The same faults on a node daemon's links to the replicas' APIs (chaos/node_mesh.py).
COORD_KINDS = ("coord-partition", "coord-delay", "coord-loss", "coord-bandwidth", "coord-reset")
NODE_KINDS = ("node-kill", "gpu-xid", "clock-skew")
RAFT_KINDS = ("raft-partition", "raft-delay", "raft-loss")
TRAINING_KINDS = ("learner-kill", "rollout-kill", "disk-full")
# The same faults on the job's rollout<->learner links, through the link relay (chaos/relay.py).
LINK_KINDS = ("link-partition", "link-delay", "link-loss", "link-bandwidth", "link-reset")
# Faults on a whole host, where the nodes are hosts of their own (chaos/hostfaults.py).
HOST_KINDS = ("host-cut", "host-kill", "host-delay")
# The learner group moved off its node: the node is drained through the API.
MOVE_KINDS = ("learner-move",)
FAULT_KINDS = (
    PROCESS_KINDS
    + NET_KINDS
    + COORD_KINDS
    + NODE_KINDS
    + RAFT_KINDS
    + TRAINING_KINDS
    + LINK_KINDS
    + HOST_KINDS
    + MOVE_KINDS
)
BASE_INVARIANTS = (
    "linearizable",
    "digests_equal",
    "checkpoints_forward",
    "no_leaks",
    "recovered",
    "nodes_alive",
)
# Checked on the scenario's training job, so only with a [training] table.
TRAINING_INVARIANTS = (
    "training_progress",
    "resumed_from_checkpoint",
    "fragment_accounting",
    "job_stopped_in_order",
)
# Faults whose target may be "learners": the node that runs learner rank 0 when injected.
LEARNERS = "learners"
INVARIANTS = BASE_INVARIANTS + TRAINING_INVARIANTS
MIN_SKEW_S = 0.5
# A disk-full fault caps learner rank 0's file size (RLIMIT_FSIZE): a checkpoint (100+ KiB)
# no longer fits, the small status and event files still do.
DISK_LIMIT_BYTES = 64 * 1024
# Extra keys each network kind takes, passed on to NetFaults.
NET_PARAMS: dict[str, tuple[str, ...]] = {
    "api-partition": ("partition",),
    "api-delay": ("delay_s", "jitter_s"),
    "api-loss": ("loss", "loss_mode", "stall_s"),
    "api-bandwidth": ("bandwidth_bps",),
    "api-reset": (),
}
COORD_PARAMS = {kind.replace("api-", "coord-"): keys for kind, keys in NET_PARAMS.items()}
LINK_PARAMS = {kind.replace("api-", "link-"): keys for kind, keys in NET_PARAMS.items()}
RAFT_PARAMS: dict[str, tuple[str, ...]] = {
    "raft-partition": (),
    "raft-delay": ("delay_s", "jitter_s"),
    "raft-loss": ("loss", "loss_mode", "stall_s"),
}
NODE_PARAMS: dict[str, tuple[str, ...]] = {
    "node-kill": (),
    "gpu-xid": ("gpu", "xid"),
    "clock-skew": ("offset_s",),
}
TRAINING_PARAMS: dict[str, tuple[str, ...]] = {"disk-full": ("limit_bytes",)}
HOST_PARAMS: dict[str, tuple[str, ...]] = {"host-delay": ("delay_ms",)}
DEFAULT_DELAY_MS = 100.0
MAX_DELAY_MS = 60_000.0
_FAULT_KEYS = ("kind", "target", "at", "duration", "recover_within_s")
_TOP_KEYS = (
    "name",
    "description",
    "replicas",
    "duration_s",
    "clients",
    "keys",
    "rate",
    "recover_within_s",
    "invariants",
    "faults",
    "nodes",
    "sim_gpus",
    "training",
)
_TRAINING_KEYS = (
    "env",
    "ranks",
    "workers",
    "checkpoint_interval_s",
    "seed",
    "start_within_s",
    "gpus_per_rank",
    "spread",
)


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    target: str
    at: float
    duration: float
    recover_within_s: float
    params: dict[str, Any] = field(default_factory=dict)

    def net_faults(self) -> NetFaults:
        """The proxy setting of an api-*, coord-*, raft-* or link-* fault (the *-reset kinds
        have none: each is one RST; a raft-partition is the mesh's own)."""
        if self.kind in ("api-partition", "coord-partition", "raft-partition", "link-partition"):
            return NetFaults(partition=self.params.get("partition", "refuse"))
        return NetFaults.from_dict(self.params)


@dataclass(frozen=True)
class Scenario:
    name: str
    replicas: int
    duration_s: float
    clients: int
    keys: int
    recover_within_s: float
    invariants: tuple[str, ...]
    faults: tuple[FaultSpec, ...]
    description: str = ""
    nodes: int = 0
    sim_gpus: int = 4
    training: JobConfig | None = None
    rate: int = 50
    """Operations per second each client starts, at most: a paced workload, as Jepsen's, so
    the clients check the registers without saturating the coordinators that must answer
    the nodes' heartbeats on time. An unpaced client ran 640 operations/s against one
    replica; in such a run on a loaded CI machine a node went 4 s without an accepted
    heartbeat, fenced and stopped the job's tasks."""


def parse(text: str, source: str = "scenario") -> Scenario:
    try:
        data = parse_toml(text, source=source)
    except ConfigError as exc:
        raise ScenarioError(str(exc)) from None
    return from_dict(data, source)


def parse_file(path: Path) -> Scenario:
    """A scenario file, read with the size, encoding and depth bounds of shoal.config."""
    try:
        data = read_toml(path)
    except ConfigError as exc:
        raise ScenarioError(str(exc)) from None
    return from_dict(data, str(path))


def from_dict(data: dict[str, Any], source: str = "scenario") -> Scenario:
    _no_unknown(data, _TOP_KEYS, source)
    replicas = _int(data, "replicas", 3, 1, 7, source)
    if replicas % 2 == 0:
        raise ScenarioError(f"{source}: replicas={replicas} must be odd (1, 3, 5 or 7)")
    duration = _number(data, "duration_s", 30.0, 1.0, 86400.0 * 7, source)
    bound = _number(data, "recover_within_s", 20.0, 0.1, 3600.0, source)
    invariants = data.get("invariants")
    if invariants is not None and (
        not isinstance(invariants, list) or not all(i in INVARIANTS for i in invariants)
    ):
        raise ScenarioError(
            f"{source}: invariants={invariants!r} must be a list drawn from {list(INVARIANTS)}"
        )
    raw_faults = data.get("faults", [])
    if not isinstance(raw_faults, list):
        raise ScenarioError(f"{source}: faults must be an array of tables ([[faults]])")
    training = _training(data.get("training"), source)
    cluster = _Shape(
        replicas,
        _int(data, "nodes", 0, 0, 16, source),
        _int(data, "sim_gpus", 4, 0, 64, source),
        training,
    )
    faults = tuple(
        _fault(item, f"{source}: faults[{i}]", cluster, duration, bound)
        for i, item in enumerate(raw_faults)
    )
    if invariants is None:
        invariants = list(BASE_INVARIANTS + (TRAINING_INVARIANTS if training is not None else ()))
    needs_training = sorted(set(invariants) & set(TRAINING_INVARIANTS))
    if needs_training and training is None:
        raise ScenarioError(
            f"{source}: invariants {needs_training} are checked on the training job; "
            "add a [training] table or leave them out"
        )
    if training is not None and cluster.nodes == 0:
        raise ScenarioError(f"{source}: a [training] job needs nodes >= 1 to run its tasks on")
    name = data.get("name", "scenario")
    description = data.get("description", "")
    if not isinstance(name, str) or not isinstance(description, str):
        raise ScenarioError(f"{source}: name and description must be strings")
    return Scenario(
        name=name,
        replicas=replicas,
        duration_s=duration,
        clients=_int(data, "clients", 4, 1, 64, source),
        keys=_int(data, "keys", 4, 1, 1024, source),
        rate=_int(data, "rate", 50, 1, 10_000, source),
        recover_within_s=bound,
        invariants=tuple(dict.fromkeys(invariants)),
        faults=tuple(sorted(faults, key=lambda f: f.at)),
        description=description,
        nodes=cluster.nodes,
        sim_gpus=cluster.sim_gpus,
        training=training,
    )


def _training(table: Any, source: str) -> JobConfig | None:
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ScenarioError(f"{source}: training must be a table ([training])")
    where = f"{source}: training"
    _no_unknown(table, _TRAINING_KEYS, where)
    if not isinstance(table.get("env", ""), str):
        raise ScenarioError(f"{where}.env={table['env']!r} must be an environment id string")
    for key in ("ranks", "workers", "seed", "gpus_per_rank"):
        if key in table:
            _int(table, key, 0, 0, 2**31, where)
    if not isinstance(table.get("spread", False), bool):
        raise ScenarioError(f"{where}.spread={table['spread']!r} must be true or false")
    for key in ("checkpoint_interval_s", "start_within_s"):
        if key in table:
            _number(table, key, None, 0.1, 3600.0, where)
    try:
        return JobConfig(**table)
    except (ConfigError, TypeError) as exc:
        raise ScenarioError(f"{source}: {exc}") from exc


@dataclass(frozen=True)
class _Shape:
    replicas: int
    nodes: int
    sim_gpus: int
    training: JobConfig | None


def _fault(item: Any, where: str, shape: _Shape, duration: float, bound: float) -> FaultSpec:
    if not isinstance(item, dict):
        raise ScenarioError(f"{where} must be a table with kind, target, at, duration")
    kind = item.get("kind")
    if kind not in FAULT_KINDS:
        raise ScenarioError(f"{where}.kind={kind!r} is not one of {list(FAULT_KINDS)}")
    params = (
        NET_PARAMS.get(kind, ())
        + COORD_PARAMS.get(kind, ())
        + LINK_PARAMS.get(kind, ())
        + RAFT_PARAMS.get(kind, ())
        + NODE_PARAMS.get(kind, ())
        + TRAINING_PARAMS.get(kind, ())
        + HOST_PARAMS.get(kind, ())
    )
    _no_unknown(item, _FAULT_KEYS + params, where)
    target = item.get("target")
    if kind in HOST_KINDS + MOVE_KINDS:
        targets = _host_targets(kind, where, shape)
    elif kind in NODE_KINDS or kind in COORD_KINDS:
        if shape.nodes == 0:
            raise ScenarioError(f"{where}.kind={kind!r} needs nodes >= 1 in the scenario")
        targets = [f"n{i + 1}" for i in range(shape.nodes)]
        if shape.training is not None:
            targets.append(LEARNERS)
    elif kind in TRAINING_KINDS:
        if shape.training is None:
            raise ScenarioError(
                f"{where}.kind={kind!r} hits the training job: add a [training] table"
            )
        if kind == "learner-kill":
            targets = [f"rank{i}" for i in range(shape.training.ranks)]
        elif kind == "disk-full":
            targets = ["rank0"]  # the rank that writes the checkpoints
        else:
            targets = [f"w{i}" for i in range(shape.training.workers)]
    elif kind in LINK_KINDS:
        if shape.training is None:
            raise ScenarioError(
                f"{where}.kind={kind!r} faults the training job's links: add a [training] table"
            )
        targets = ["all"]
        targets += [f"rank{i}" for i in range(shape.training.ranks)]
        targets += [f"w{i}" for i in range(shape.training.workers)]
    else:
        targets = ["leader", "follower", *(f"c{i + 1}" for i in range(shape.replicas))]
    if kind in NET_KINDS or kind in COORD_KINDS:
        targets.append("all")
    if target not in targets:
        raise ScenarioError(f"{where}.target={target!r} is not one of {targets}")
    at = _number(item, "at", None, 0.0, duration, where)
    spec = FaultSpec(
        kind=kind,
        target=target,
        at=at,
        duration=_number(item, "duration", 0.0, 0.0, 3600.0, where),
        recover_within_s=_number(item, "recover_within_s", bound, 0.1, 3600.0, where),
        params={k: item[k] for k in params if k in item},
    )
    if kind in NET_KINDS + COORD_KINDS + RAFT_KINDS + LINK_KINDS:
        try:
            spec.net_faults()
        except ProxyError as exc:
            raise ScenarioError(f"{where}: {exc}") from exc
    if kind == "gpu-xid":
        if shape.sim_gpus == 0:
            raise ScenarioError(f"{where}.kind='gpu-xid' needs sim_gpus >= 1 in the scenario")
        _int(item, "gpu", 0, 0, shape.sim_gpus - 1, where)
        _int(item, "xid", 79, 1, 1000, where)
    if kind == "disk-full":
        _int(item, "limit_bytes", DISK_LIMIT_BYTES, 0, 1 << 30, where)
    if kind == "host-delay":
        _number(item, "delay_ms", DEFAULT_DELAY_MS, 1.0, MAX_DELAY_MS, where)
    if kind == "clock-skew":
        offset = _number(item, "offset_s", 2.5, -3600.0, 3600.0, where)
        if abs(offset) < MIN_SKEW_S:
            raise ScenarioError(
                f"{where}.offset_s={offset!r} is too small to tell from clock noise; "
                f"use at least {MIN_SKEW_S:g} s either way"
            )
    return spec


def _host_targets(kind: str, where: str, shape: _Shape) -> list[str]:
    """A host fault names a node (its host) or the learners' one; moving the learner group
    names the learners. Both need another host to matter: a cut needs someone to be cut
    from, a killed or drained node's tasks somewhere else to run."""
    if shape.nodes < 2:
        raise ScenarioError(f"{where}.kind={kind!r} needs nodes >= 2 in the scenario")
    if kind in MOVE_KINDS:
        if shape.training is None:
            raise ScenarioError(f"{where}.kind={kind!r} moves the training job: add [training]")
        return [LEARNERS]
    targets = [f"n{i + 1}" for i in range(shape.nodes)]
    return targets + ([LEARNERS] if shape.training is not None else [])


def _no_unknown(data: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ScenarioError(f"{where}: unknown keys {unknown}; valid keys: {sorted(known)}")


def _number(
    data: dict[str, Any], key: str, default: float | None, low: float, high: float, where: str
) -> float:
    value = data.get(key, default)
    if value is None:
        raise ScenarioError(f"{where}.{key} is required (seconds, {low:g}..{high:g})")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ScenarioError(f"{where}.{key}={value!r} must be a number in {low:g}..{high:g}")
    if not low <= value <= high:
        raise ScenarioError(f"{where}.{key}={value!r} is outside {low:g}..{high:g}")
    return float(value)


def _int(data: dict[str, Any], key: str, default: int, low: int, high: int, where: str) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ScenarioError(f"{where}.{key}={value!r} must be an integer in {low}..{high}")
    return value
