"""Files that other processes read, written whole: a reader sees the old file or the new one.

Every write goes to a temporary name in the same directory and is renamed over the target, so
a reader (the node daemon polling a task's `published.json`, a test reading `status-0.json`, a
restart reading a checkpoint manifest) never sees half a file. The temporary name carries the
writer's pid, so two processes writing the same path cannot clobber each other's half-written
file; on any failure it is removed.

Atomic is not durable. The rename survives the writer's death (even kill -9: the page cache
holds it), but after a host crash or power loss the file may be empty or old unless it was
fsynced, together with its directory. That costs a disk flush per write, so only writes whose
loss would be wrong after a reboot pay it, and every caller says which it wants (`durable`):

* durable: a checkpoint's trainer state and its manifest (the manifest is the commit point a
  restart trusts), the pipeline's manifest of finished stages, a node's fault ledger (so a
  fault it executed is not executed again), a node's id (its identity in the cluster).
* not durable: status, address, progress and ledger snapshots rewritten every few seconds,
  the task/node exchange files, a chaos clock offset, a simulated GPU's state, caches. They are
  rewritten by their next writer, or describe processes a host crash has ended anyway.

This module imports only the standard library, so any package may use it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def temp_path(path: Path) -> Path:
    """Where this process writes `path`'s next version before renaming it into place."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def write_atomically(path: Path, data: bytes | str, *, durable: bool) -> None:
    """Replace `path` with `data` (str as UTF-8) in one rename; with `durable`, fsync the file
    before the rename and the directory after it, so the new version survives a host crash."""
    payload = data.encode() if isinstance(data, str) else data
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as handle:
            handle.write(payload)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_directory(path.parent)


def write_json_atomically(path: Path, value: Any, *, durable: bool) -> None:
    """`write_atomically` of `value` as compact JSON."""
    write_atomically(path, json.dumps(value, separators=(",", ":")), durable=durable)


def fsync_directory(directory: Path) -> None:
    """Flush `directory`'s entries, so a rename (or a new file) in it survives a host crash."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
