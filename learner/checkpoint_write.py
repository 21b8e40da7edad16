"""The writer thread's half of a checkpoint save: hash the files, publish, prune.

checkpoint.py stages a save (`dcp.async_save`) on the owner thread and hands a `Write` to its
writer thread, which waits for DCP and then runs what is here on every rank: each rank hashes a
share of the staged files, rank 0 gathers the shares, writes `trainer.json`, renames the staging
directory into place and writes the manifest LAST, so a crash at any point leaves at worst an
orphan that `latest()` skips. Kept apart from the manager so the order of that publish, which
is the whole crash-safety argument, reads in one place.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from shoal.files import fsync_directory, write_atomically
from shoal.learner.checkpoint_best import best_saved
from shoal.learner.checkpoint_dcp import causes, reason
from shoal.learner.checkpoint_files import (
    FORMAT,
    TRAINER_FILE,
    FileEntry,
    Manifest,
    MetaValue,
    check_name,
    file_sha256,
    manifest_json,
    table_digest,
)
from shoal.learner.checkpoint_layout import dir_name, manifest_name, prune, remove_tree
from shoal.learner.diskfull import is_disk_full
from shoal.learner.errors import CheckpointError

log = logging.getLogger("shoal.learner.checkpoint")


@dataclass(frozen=True)
class Write:
    """One save in flight, as the writer thread finishes it."""

    step: int
    partial: Path
    trainer: bytes
    meta: dict[str, MetaValue]
    created_unix: float
    group: dist.ProcessGroup | None
    rank: int
    world: int


@dataclass(frozen=True)
class Published:
    """What rank 0 made complete: the checkpoint's directory, manifest and its file table's hash."""

    path: Path
    manifest: Path
    sha256: str
    size: int


def hash_share(job: Write) -> list[FileEntry] | str:
    """This rank's share of the staging directory's files, hashed (or why not)."""
    try:
        names = sorted(os.listdir(job.partial))
        entries = []
        for name in names[job.rank :: job.world]:
            path = job.partial / check_name(name)
            entries.append(FileEntry(name, path.lstat().st_size, file_sha256(path)))
    except (OSError, CheckpointError) as exc:
        return f"checkpoint step {job.step}: rank {job.rank} could not hash its files: {exc}"
    return entries


def publish(directory: Path, keep: int, job: Write, parts: list[object]) -> Published | str:
    """Rank 0: trainer.json, the directory renamed into place, then the manifest LAST; then the
    checkpoints beyond `keep` go, except the best one (checkpoint_best.py). Returns why not
    when any rank failed or the disk refused."""
    failed = [part for part in parts if isinstance(part, str)]
    if failed:
        remove_tree(job.partial)
        return failed[0]
    files = [entry for part in parts if isinstance(part, list) for entry in part]
    files.append(FileEntry(TRAINER_FILE, len(job.trainer), hashlib.sha256(job.trainer).hexdigest()))
    manifest = Manifest(
        format=FORMAT,
        step=job.step,
        created_unix=job.created_unix,
        meta=job.meta,
        files=tuple(files),
        sha256=table_digest(files),
        size=sum(f.size for f in files),
        world_size=job.world,
    )
    final = directory / dir_name(job.step)
    manifest_path = directory / manifest_name(job.step)
    try:
        write_atomically(job.partial / TRAINER_FILE, job.trainer, durable=True)
        manifest_path.unlink(missing_ok=True)  # the same step again: incomplete from here
        remove_tree(final)
        os.replace(job.partial, final)
        fsync_directory(directory)
        write_atomically(manifest_path, manifest_json(manifest), durable=True)
    except OSError as exc:
        remove_tree(job.partial)
        if not manifest_path.exists():
            remove_tree(final)
        return str(write_error(directory, job.step, exc))
    try:
        best = best_saved(directory)
        prune(directory, keep, job.step, spare=None if best is None else best[1])
    except OSError as exc:  # the new checkpoint is complete; pruning waits for the next one
        log.warning("pruning old checkpoints in %s failed: %s", directory, exc)
    return Published(final, manifest_path, manifest.sha256, manifest.size)


def write_error(directory: Path, step: int, exc: BaseException) -> CheckpointError:
    """The error a failed write is reported as: a full disk named as one, and what to do."""
    os_error = next((e for e in causes(exc) if isinstance(e, OSError)), None)
    if os_error is not None and is_disk_full(os_error):
        why = f"the disk is full (or the file size limit was hit) [errno {os_error.errno}]"
        fix = "free space or point checkpoint.directory at a larger disk"
    elif os_error is not None:
        why = f"{os_error.strerror or os_error} [errno {os_error.errno}]"
        fix = "check the directory's permissions and health"
    else:
        why = reason(exc)
        fix = "check every learner rank's log for the cause"
    return CheckpointError(
        f"checkpoint step {step} could not be written to {directory}: {why}; "
        f"older checkpoints are untouched — {fix}"
    )
