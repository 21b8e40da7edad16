"""What a process task and its node daemon exchange through the task's own directory.

A task on another host cannot read the submitter's files, and giving every task a credential
to the coordinators' API would hand a bearer token to every child process. So the node daemon
is the task's only line to the control plane, through two small files in `SHOAL_TASK_DIR`:

* `published.json`, written by the task: a flat JSON object (a learner rank's transport and
  rendezvous addresses, rank 0's progress). The agent forwards each new version to the
  coordinators (`PUT /v1/tasks/{id}/published`), where it is Raft state of that task's
  current generation.
* `peers.json`, written by the agent: what the other tasks of the same job published, as the
  heartbeat reply lists them (`peers`). Tasks poll it; a group restarted on other hosts shows
  up there with its new generation and addresses.

Both are written to a temporary name and renamed, so a reader never sees half a file. The
task is a process of ours, but what it writes is still read like outside bytes: bounded before
parsing, its shape checked, since the coordinators refuse what breaks their rules anyway and a
refused publication should be one log line here, not a retry loop.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal import boundedjson
from shoal.errors import ShoalError
from shoal.files import write_atomically, write_json_atomically

PUBLISHED = "published.json"
PEERS = "peers.json"
MAX_PUBLISHED_BYTES = 4096
MAX_KEYS = 32
MAX_KEY_CHARS = 64
MAX_TEXT_CHARS = 1024
MAX_PEERS_BYTES = 4 << 20
PEER_POLL_S = 0.05


class PublishedStateError(ShoalError, ValueError):
    """A task's published state breaks the rules the coordinators enforce; the message says which."""


def check_published(state: Any) -> dict[str, Any]:
    """`state` if it is a flat object within the limits (see the module doc), else an error."""
    if not isinstance(state, dict):
        raise PublishedStateError(
            f"published state must be a JSON object, not {type(state).__name__}"
        )
    if len(state) > MAX_KEYS:
        raise PublishedStateError(f"published state has {len(state)} keys; at most {MAX_KEYS}")
    for key, value in state.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
            raise PublishedStateError(f"key {key!r}: use a string of 1 to {MAX_KEY_CHARS} chars")
        if isinstance(value, str):
            if len(value) > MAX_TEXT_CHARS:
                raise PublishedStateError(f"{key}: text longer than {MAX_TEXT_CHARS} chars")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise PublishedStateError(f"{key}: {value} is not a finite number")
        elif value is not None and not isinstance(value, bool | int):
            raise PublishedStateError(
                f"{key}: a {type(value).__name__}; values are text, numbers, true/false or null"
            )
    encoded = json.dumps(state, separators=(",", ":")).encode()
    if len(encoded) > MAX_PUBLISHED_BYTES:
        raise PublishedStateError(
            f"published state is {len(encoded)} bytes encoded; at most {MAX_PUBLISHED_BYTES}"
        )
    return state


def parse_published(data: bytes) -> dict[str, Any]:
    """The state in a task's published.json; PublishedStateError or JsonRefused if it breaks a rule."""
    return check_published(boundedjson.loads(data, max_bytes=MAX_PUBLISHED_BYTES, max_depth=2))


def parse_peers(data: bytes) -> list[dict[str, Any]]:
    """The peer records in peers.json (each with id, generation, node, state, published);
    records of the wrong shape are left out rather than trusted."""
    value = boundedjson.loads(data, max_bytes=MAX_PEERS_BYTES, max_depth=8)
    tasks = value.get("tasks") if isinstance(value, dict) else None
    if not isinstance(tasks, list):
        return []
    return [
        t
        for t in tasks
        if isinstance(t, dict)
        and isinstance(t.get("id"), str)
        and isinstance(t.get("generation"), int)
        and isinstance(t.get("published"), dict)
    ]


# -- the task's side -----------------------------------------------------------------------


def task_dir() -> Path | None:
    """This process's task directory, when a node daemon started it (else None)."""
    value = os.environ.get("SHOAL_TASK_DIR")
    return Path(value) if value else None


def publish(state: dict[str, Any], directory: Path | None = None) -> bool:
    """Publish `state` (replacing what this task published before); False when the process
    was not started by a node daemon and so has no one to publish to."""
    directory = directory or task_dir()
    if directory is None:
        return False
    write_json_atomically(directory / PUBLISHED, check_published(state), durable=False)
    return True


def read_peers(directory: Path | None = None) -> list[dict[str, Any]]:
    """What the job's tasks published, as the node last heard it (empty before the first)."""
    directory = directory or task_dir()
    if directory is None:
        return []
    try:
        return parse_peers((directory / PEERS).read_bytes())
    except (OSError, boundedjson.JsonRefused):
        return []


def wait_for_peer(
    match: Callable[[dict[str, Any]], bool],
    stopped: Callable[[], bool],
    directory: Path | None = None,
) -> dict[str, Any] | None:
    """Block until a peer record satisfies `match` (returned) or `stopped()` (None). Blocking
    on purpose: callers are start-up code in a thread (the group rendezvous)."""
    while not stopped():
        found = next((p for p in read_peers(directory) if match(p)), None)
        if found is not None:
            return found
        time.sleep(PEER_POLL_S)
    return None


# -- the node daemon's side ----------------------------------------------------------------


def host_of(address: str) -> str:
    """The host part of a transport address (`shoal://10.0.0.2:7000` -> `10.0.0.2`): where
    this node's tasks listen so that other hosts reach them."""
    rest = address.split("://", 1)[-1]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return host.strip("[]") or "127.0.0.1"


class NodeExchange:
    """The agent's half: task directories, what each task last published, and the peers each
    job's tasks were last shown. Files only; the agent talks to the coordinators."""

    def __init__(self, jobs_dir: Path, node_host: str) -> None:
        self.jobs_dir = jobs_dir
        self.node_host = node_host
        self._seen: dict[tuple[str, int], tuple[int, int]] = {}
        self._peers: dict[str, bytes] = {}
        self._shown: dict[Path, bytes] = {}

    def directory(self, job_id: str, task_name: str) -> Path:
        return self.jobs_dir / job_id / "tasks" / task_name

    def prepare(self, job_id: str, task_name: str, gpus: tuple[int, ...]) -> dict[str, str]:
        """Make the task's directory afresh for a new generation (nothing an earlier one
        published may be forwarded under the new one) and return the variables it gets."""
        directory = self.directory(job_id, task_name)
        directory.mkdir(parents=True, exist_ok=True)
        for name in (PUBLISHED, PEERS):
            (directory / name).unlink(missing_ok=True)
        self._shown.pop(directory, None)
        self._show(directory, self._peers.get(job_id))
        return {
            "SHOAL_TASK_DIR": str(directory),
            "SHOAL_JOB_DIR": str(directory.parent.parent),
            "SHOAL_NODE_HOST": self.node_host,
            "SHOAL_TASK_GPUS": ",".join(str(g) for g in gpus),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }

    def fresh(self, task_id: str, generation: int, directory: Path) -> bytes | None:
        """The bytes of the task's published.json if they changed since last taken."""
        path = directory / PUBLISHED
        try:
            stat = path.stat()
        except OSError:
            return None
        signature = (stat.st_mtime_ns, stat.st_size)
        if self._seen.get((task_id, generation)) == signature:
            return None
        try:
            data = path.read_bytes()[: MAX_PUBLISHED_BYTES + 1]
        except OSError:
            return None
        self._seen[(task_id, generation)] = signature
        return data

    def retry(self, task_id: str, generation: int) -> None:
        """Forget that the current file was taken: it could not be forwarded yet."""
        self._seen.pop((task_id, generation), None)

    def show_peers(self, peers: dict[str, Any], directories: dict[Path, str]) -> None:
        """Write each job's peers (the heartbeat reply's `peers`) into the directories of its
        tasks here (`directories`: task directory -> job id), where they changed."""
        self._peers = {
            job: json.dumps({"tasks": records}, separators=(",", ":"), sort_keys=True).encode()
            for job, records in peers.items()
            if isinstance(job, str) and isinstance(records, list)
        }
        for directory, job in directories.items():
            self._show(directory, self._peers.get(job))

    def _show(self, directory: Path, data: bytes | None) -> None:
        if data is None or self._shown.get(directory) == data or not directory.is_dir():
            return
        write_atomically(directory / PEERS, data, durable=False)
        self._shown[directory] = data
