"""The client workload of a chaos run: clients writing and reading registers through the real
coordinator client, a checkpoint writer, and a watcher of the newest checkpoint.

A register is a node record `chaos-reg-<k>` whose label `v` holds the value: a write is a
(re-)registration with a fresh value, a read is `GET /v1/nodes/<id>?consistent=true` (a barrier
through the log, so reads are meant to be linearizable on any replica). Every call is recorded
with invoke and completion times; a call whose outcome is unknown (the client gave up after
retrying with the same operation id) stays pending. For the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.chaos.history import HistoryRecorder
from shoal.raft.client import CoordinatorClient
from shoal.raft.errors import (
    Conflict,
    Forbidden,
    NotFound,
    RaftError,
    Unauthorized,
    ValidationError,
)
from shoal.runtime.tls import TlsFiles

# The server answered and refused: the call certainly had no effect.
REFUSED = (ValidationError, Conflict, Unauthorized, Forbidden)
JOB = "chaos-job"
REGISTER_PREFIX = "chaos-reg-"


def register_id(key: int) -> str:
    return f"{REGISTER_PREFIX}{key}"


@dataclass
class WorkloadStats:
    acknowledged: int = 0
    refused: int = 0
    unknown: int = 0
    errors: list[str] = field(default_factory=list)

    def note_error(self, exc: BaseException) -> None:
        if len(self.errors) < 20:
            self.errors.append(f"{type(exc).__name__}: {exc}")


def make_client(urls: Sequence[str], token: str, tls: TlsFiles | None = None) -> CoordinatorClient:
    """Short timeouts: a call gives up (pending) after 4 s of retrying, so clients keep going.
    `tls`: the cluster's CA, for an https API."""
    return CoordinatorClient(urls, token, timeout=4.0, request_timeout=1.5, tls=tls)


async def run_client(
    client: CoordinatorClient,
    name: str,
    keys: int,
    until: float,
    history: HistoryRecorder,
    stats: WorkloadStats,
    seed: int,
    rate: float,
) -> None:
    """Random writes (unique values) and reads until the monotonic time `until`, starting at
    most `rate` a second (an operation that takes longer delays the next, never doubles up)."""
    rng = random.Random(seed)
    count = 0
    pace = 1.0 / rate
    due = time.monotonic()
    while (now := time.monotonic()) < until:
        if due > now:
            await asyncio.sleep(due - now)
        due = max(due, now) + pace
        key = register_id(rng.randrange(keys))
        if rng.random() < 0.5:
            count += 1
            await _write(client, name, key, f"{name}-{count}", history, stats)
        else:
            await _read(client, name, key, history, stats)


async def prepare_registers(
    client: CoordinatorClient, keys: int, history: HistoryRecorder, stats: WorkloadStats
) -> None:
    """Write every register once (in the history, like any write) and cordon its node record:
    a register looks like a live node to the leader's scheduler, which must never place a
    task of the scenario's training job on it."""
    for k in range(keys):
        key = register_id(k)
        await _write(client, "setup", key, "setup-0", history, stats)
        await client.cordon(key)


async def _write(
    client: CoordinatorClient,
    name: str,
    key: str,
    value: str,
    history: HistoryRecorder,
    stats: WorkloadStats,
) -> None:
    handle = history.invoke(name, "write", key, value)
    try:
        await client.register_node(key, "127.0.0.1:1", cpus=1, memory=1, labels={"v": value})
    except REFUSED as exc:
        history.discard(handle)
        stats.refused += 1
        stats.note_error(exc)
        return
    except (RaftError, OSError, TimeoutError) as exc:
        stats.unknown += 1
        stats.note_error(exc)
        return
    history.complete(handle)
    stats.acknowledged += 1


async def _read(
    client: CoordinatorClient,
    name: str,
    key: str,
    history: HistoryRecorder,
    stats: WorkloadStats,
) -> None:
    handle = history.invoke(name, "read", key)
    try:
        node = await client.request("GET", f"/v1/nodes/{key}", params={"consistent": True})
    except NotFound:
        history.complete(handle, None)
        stats.acknowledged += 1
        return
    except (RaftError, OSError, TimeoutError) as exc:
        stats.unknown += 1
        stats.note_error(exc)
        return
    history.complete(handle, node["labels"].get("v"))
    stats.acknowledged += 1


@dataclass
class CheckpointLog:
    """Steps the writer got acknowledged, and the newest complete step each watch saw."""

    acknowledged: list[int] = field(default_factory=list)
    observed: list[int] = field(default_factory=list)


async def write_checkpoints(
    client: CoordinatorClient, until: float, log: CheckpointLog, period: float = 0.3
) -> None:
    """Record checkpoints of one job with rising steps, as a learner would."""
    step = 0
    while time.monotonic() < until:
        step += 100
        path = f"/chaos/{JOB}/{step:08d}.pt"
        digest = hashlib.sha256(path.encode()).hexdigest()
        try:
            await client.record_checkpoint(JOB, path, step, digest, complete=True)
        except (RaftError, OSError, TimeoutError):
            await asyncio.sleep(period)
            continue
        log.acknowledged.append(step)
        await asyncio.sleep(period)


async def newest_checkpoint(client: CoordinatorClient) -> int:
    reply = await client.request("GET", "/v1/checkpoints", params={"job": JOB, "consistent": True})
    return newest_step(reply["checkpoints"])


def newest_step(checkpoints: Sequence[dict[str, Any]]) -> int:
    return max((c["step"] for c in checkpoints if c["complete"]), default=0)


async def watch_checkpoints(
    client: CoordinatorClient, until: float, log: CheckpointLog, period: float = 0.2
) -> None:
    while time.monotonic() < until:
        try:
            log.observed.append(await newest_checkpoint(client))
        except (RaftError, OSError, TimeoutError):
            pass
        await asyncio.sleep(period)
