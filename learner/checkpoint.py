"""Sharded checkpoints that are either complete and verified or ignored: never half a checkpoint.

A checkpoint (format 2, docs/checkpoints.md) is a directory `ckpt-<step>/` that
torch.distributed.checkpoint (DCP) fills, every rank writing its own shards, plus
`trainer.json` (the JSON trainer state), and beside it the manifest `ckpt-<step>.json` that
lists every file with its size and sha256. `save` is a collective: each rank stages a copy of
its shards in host memory at once (`dcp.async_save`; training may go on changing the tensors)
and the write runs in the background on a gloo group of its own, so it never shares a group
with the training collectives. Once every rank's files are written the ranks hash them, rank 0
writes `trainer.json`, renames the staging directory into place and writes the manifest LAST.
A checkpoint is complete when its manifest exists and every file matches it, so a crash at any
point leaves at worst an orphan that `latest()` skips with a warning. Old checkpoints are pruned
only after a new one is complete, so a full disk costs the new checkpoint, never the old ones;
the best one (highest recent mean return, `best()`) is never pruned.

A failed background write is counted (`failures`, `last_failure`) and logged the moment it
happens, so a trainer keeps training through a full disk and its status can say so. `wait()`
raises only when the newest finished write failed. Format 1 (one `ckpt-<step>.pt` written by
torch.save, from before DCP) is still found by `latest()` and read by `load_legacy`.

Concurrency: one owner thread calls save/wait/latest/load/close; the writer thread only writes.
One write is in flight at a time (a save first waits for the previous one), so the collectives
of two writes never interleave on the checkpoint group.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import stat
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from shoal.config import check_int
from shoal.learner.checkpoint_best import rank
from shoal.learner.checkpoint_dcp import (
    TensorsOnlyPlanner,
    VerifiedReader,
    causes,
    check_tensors,
    reason,
)
from shoal.learner.checkpoint_files import (
    FORMAT,
    LEGACY_FORMAT,
    MAX_MANIFEST_BYTES,
    MAX_TRAINER_BYTES,
    METADATA_FILE,
    TRAINER_FILE,
    FileEntry,
    Manifest,
    MetaValue,
    file_sha256,
    meta_dict,
    parse_manifest,
    parse_trainer,
    plain_directory,
    read_bounded,
)
from shoal.learner.checkpoint_layout import (
    DATA,
    DIR,
    dir_name,
    manifest_name,
    manifest_steps,
    partial_name,
    remove_tree,
)
from shoal.learner.checkpoint_schedule import SaveSchedule
from shoal.learner.checkpoint_write import Write, hash_share, publish, write_error
from shoal.learner.errors import CheckpointError

log = logging.getLogger(__name__)
# Without torch.distributed a checkpoint is a group of one on purpose, not a mistake to warn of.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable")

GROUP_TIMEOUT = timedelta(minutes=10)
"""How long a checkpoint collective waits for a peer (a rank that died mid-save)."""

__all__ = ["CheckpointInfo", "CheckpointManager", "MetaValue", "SaveSchedule"]


@dataclass(frozen=True)
class CheckpointInfo:
    """Where one checkpoint lives and the hash that proves it complete: format 2, the digest of
    its manifest's file table (`path` is the directory); format 1, the sha256 of its .pt file."""

    step: int
    path: Path
    manifest: Path
    sha256: str
    size: int
    created_unix: float
    meta: dict[str, MetaValue] = field(default_factory=dict)
    format: int = FORMAT


def _trainer_bytes(trainer: object) -> bytes:
    if not isinstance(trainer, dict):
        raise CheckpointError(f"trainer state must be a dict, got {type(trainer).__name__}")
    try:
        data = json.dumps(trainer, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"trainer state is not plain JSON ({exc}): store numbers, strings, lists and "
            "dicts (e.g. dataclasses.asdict(cfg)); tensors go in the tensors argument"
        ) from None
    if len(data) > MAX_TRAINER_BYTES:
        raise CheckpointError(f"trainer state is {len(data)} bytes, over {MAX_TRAINER_BYTES}")
    return data


class CheckpointManager:
    """Writes checkpoints into `directory` in the background and keeps the newest `keep` complete
    ones. `process_group` is the group whose ranks save together (None: the default group when
    torch.distributed is initialised, else a group of one)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep: int = 3,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.keep = check_int("checkpoint.keep", keep, 1)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"cannot create checkpoint directory {self.directory}: {exc.strerror}; "
                "choose a writable checkpoint.directory"
            ) from exc
        self._process_group = process_group
        self._group_for: object = None
        self._checkpoint_group: dist.ProcessGroup | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: Future[None] | None = None
        self._pending_step: int | None = None
        self._digests: dict[tuple[str, int, int, int, int], str] = {}
        self.failures = 0
        """Writes that failed since this manager was opened (disk full, I/O error)."""
        self.last_failure: str | None = None
        self.last_complete: CheckpointInfo | None = None
        """The newest checkpoint this manager wrote completely."""
        self._unsuperseded: str | None = None  # the newest write's failure, until one succeeds

    def __repr__(self) -> str:
        pending = int(self._pending is not None and not self._pending.done())
        return (
            f"<CheckpointManager {self.directory} keep={self.keep} pending={pending} "
            f"failures={self.failures}>"
        )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the checkpoint group ----------------------------------------------------------------

    def _group(self) -> dist.ProcessGroup | None:
        """The gloo group the saves and loads run on, made once per process group (a
        collective: every rank of the group calls save/load_tensors together); None without
        torch.distributed (a group of one)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        base = self._process_group or dist.group.WORLD
        if self._checkpoint_group is None or self._group_for is not base:
            self._checkpoint_group = dist.new_group(
                ranks=dist.get_process_group_ranks(base),
                backend="gloo",
                timeout=GROUP_TIMEOUT,
                use_local_synchronization=True,
            )
            self._group_for = base
        return self._checkpoint_group

    @staticmethod
    def _nonce(group: dist.ProcessGroup | None) -> str:
        """A staging name every rank agrees on, fresh per save (rank 0's, broadcast)."""
        box = [os.urandom(6).hex()]
        if group is not None:
            dist.broadcast_object_list(box, group=group, group_src=0)
        return str(box[0])

    # -- writing ---------------------------------------------------------------------------

    def save(
        self,
        tensors: dict[str, Any],
        step: int,
        trainer: dict[str, Any],
        meta: Mapping[str, MetaValue] | None = None,
        block: bool = False,
    ) -> Path:
        """COLLECTIVE: stage this rank's `tensors` (plain tensors or DTensor shards) now and write
        them in the background with the JSON `trainer` state (rank 0's is the one written), or
        before returning if `block`. Returns the checkpoint's directory, complete only once the
        write is done: `wait()` flushes and raises CheckpointError if it failed."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"checkpoint step must be an integer >= 0, got {step!r}")
        check_tensors(tensors, "tensors")
        trainer_json = _trainer_bytes(trainer)
        checked_meta = meta_dict(meta)
        self._settle()
        group = self._group()
        rank, world = (0, 1) if group is None else (dist.get_rank(group), group.size())
        partial = self.directory / partial_name(step, self._nonce(group))
        job = Write(step, partial, trainer_json, checked_meta, time.time(), group, rank, world)
        try:
            started = dcp.async_save(
                tensors, checkpoint_id=partial, process_group=group, no_dist=group is None
            )
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(
                f"checkpoint step {step} could not be staged in host memory: {reason(exc)}"
            ) from None
        upload = started.upload_completion if isinstance(started, AsyncSaveResponse) else started
        self._pending = self._writer.submit(self._finish_counted, job, upload)
        self._pending_step = step
        if block:
            self.wait()
        return self.directory / dir_name(step)

    def _finish_counted(self, job: Write, upload: Future[Any]) -> None:
        """The writer thread's job: finish, and record the outcome instead of raising it."""
        try:
            info = self._finish(job, upload)
        except CheckpointError as exc:
            self.failures += 1
            self.last_failure = self._unsuperseded = str(exc)
            log.warning("%s (%d failed writes so far)", exc, self.failures)
            return
        self.last_complete = info
        self._unsuperseded = None

    def _finish(self, job: Write, upload: Future[Any]) -> CheckpointInfo:
        """Every rank: wait for DCP, hash a share of the files, gather; rank 0 publishes and
        tells the others how it went (so every rank's `last_complete` agrees)."""
        try:
            upload.result()  # DCP raises on every rank when any rank's write failed
        except (Exception, CheckpointException) as exc:
            if job.rank == 0:
                remove_tree(job.partial)
            raise write_error(self.directory, job.step, exc) from None
        share = hash_share(job)
        parts: list[Any] = [share]
        outcome: list[Any] = [None]
        try:
            if job.group is not None:
                parts = [None] * job.world
                dist.all_gather_object(parts, share, group=job.group)
            outcome = [self._publish(job, parts) if job.rank == 0 else None]
            if job.group is not None:
                dist.broadcast_object_list(outcome, group=job.group, group_src=0)
        except RuntimeError as exc:  # a peer rank died or timed out mid-save
            raise CheckpointError(
                f"checkpoint step {job.step}: rank {job.rank} lost its peers while finishing "
                f"the write ({reason(exc)}); no manifest was written — the group restarts "
                "from the newest complete checkpoint"
            ) from None
        if isinstance(outcome[0], str):
            raise CheckpointError(outcome[0])
        info: CheckpointInfo = outcome[0]
        return info

    def _publish(self, job: Write, parts: list[Any]) -> CheckpointInfo | str:
        """Rank 0: publish (checkpoint_write.py) and describe what became complete."""
        done = publish(self.directory, self.keep, job, parts)
        if isinstance(done, str):
            return done
        return CheckpointInfo(
            step=job.step,
            path=done.path,
            manifest=done.manifest,
            sha256=done.sha256,
            size=done.size,
            created_unix=job.created_unix,
            meta=job.meta,
        )

    def _settle(self) -> None:
        """Wait for the write in flight; its failure stays recorded for `wait()`."""
        pending, self._pending, self._pending_step = self._pending, None, None
        if pending is not None:
            pending.result()

    def wait(self) -> None:
        """Block until the write in flight is done; raise CheckpointError (once) if the newest
        write failed. Failures before a later complete write are only counted."""
        self._settle()
        failure, self._unsuperseded = self._unsuperseded, None
        if failure is not None:
            raise CheckpointError(failure)

    def close(self) -> None:
        """Flush the pending write and stop the writer thread (raises like `wait`)."""
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)

    # -- finding ---------------------------------------------------------------------------

    def list_complete(self) -> list[CheckpointInfo]:
        """Every verified checkpoint, newest first (hashes every file, once per manager)."""
        return [
            info
            for step in sorted(manifest_steps(self.directory), reverse=True)
            if (info := self._verified(step))
        ]

    def best(self) -> CheckpointInfo | None:
        """The verified checkpoint saved at the highest recent mean return (the newest on a
        tie; checkpoint_best.py), which rotation spares; None when none recorded a return."""
        ranked = [(r, info) for info in self.list_complete() if (r := rank(info.meta, info.step))]
        return max(ranked, key=lambda pair: pair[0])[1] if ranked else None

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint (either format); half-written or corrupt ones are
        skipped with a warning."""
        found: CheckpointInfo | None = None
        for step in sorted(manifest_steps(self.directory), reverse=True):
            found = self._verified(step)
            if found is not None:
                break
        for path in self.directory.iterdir():
            m = DATA.match(path.name) or DIR.match(path.name)
            if m is None or (self.directory / manifest_name(int(m.group(1)))).exists():
                continue
            orphan = int(m.group(1))
            if orphan != self._pending_step and (found is None or orphan > found.step):
                log.warning(
                    "skipping checkpoint %s: its manifest is missing (write not finished)", path
                )
        return found

    def _verified(self, step: int, warn: bool = True) -> CheckpointInfo | None:
        """The checkpoint of `step` if its manifest and every file check out, else None."""
        try:
            return self._check(self._manifest(step))
        except CheckpointError as exc:
            (log.warning if warn else log.debug)("skipping checkpoint step %d: %s", step, exc)
            return None

    def _manifest(self, step: int) -> Manifest:
        path = self.directory / manifest_name(step)
        return parse_manifest(read_bounded(path, MAX_MANIFEST_BYTES), step)

    def _check(self, manifest: Manifest) -> CheckpointInfo:
        """CheckpointInfo of a manifest whose files all exist, are plain and match it."""
        if manifest.format == LEGACY_FORMAT:
            path = self.directory / manifest.file
            self._match(path, FileEntry(manifest.file, manifest.size, manifest.sha256), size=False)
        else:
            path = self.directory / dir_name(manifest.step)
            plain_directory(path)
            for entry in manifest.files:
                self._match(path / entry.path, entry)
        return CheckpointInfo(
            step=manifest.step,
            path=path,
            manifest=self.directory / manifest_name(manifest.step),
            sha256=manifest.sha256,
            size=manifest.size,
            created_unix=manifest.created_unix,
            meta=manifest.meta,
            format=manifest.format,
        )

    def _match(self, path: Path, entry: FileEntry, size: bool = True) -> None:
        """Raise unless `path` is a regular file with `entry`'s size and sha256 (hashes are
        remembered per inode, size and times, so a file is read once per manager)."""
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise CheckpointError(f"unreadable: {path} is missing ({exc.strerror})") from exc
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path} is not a regular file (a symlink?): refused")
        if size and st.st_size != entry.size:
            raise CheckpointError(f"{path}'s sha256 does not match its manifest (size differs)")
        key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        digest = self._digests.get(key) or file_sha256(path)
        if digest != entry.sha256:
            raise CheckpointError(f"{path}'s sha256 does not match its manifest")
        self._digests[key] = digest

    def _pinned(self, info: CheckpointInfo) -> Manifest:
        """The manifest of `info`, re-read and required to be the one `info` was found with."""
        manifest = self._manifest(info.step)
        if manifest.format != info.format or manifest.sha256 != info.sha256:
            raise CheckpointError(
                f"checkpoint step {info.step} changed since it was found (its manifest no longer "
                "matches): use latest() again"
            )
        return manifest

    # -- reading ---------------------------------------------------------------------------

    def load_trainer(self, info: CheckpointInfo) -> dict[str, Any]:
        """The JSON trainer state of `info` (format 1: the saved state without its tensors)."""
        if info.format == LEGACY_FORMAT:
            state = self.load_legacy(info)
            return {k: v for k, v in state.items() if k not in ("model", "optimizer")}
        manifest = self._pinned(info)
        entry = next(f for f in manifest.files if f.path == TRAINER_FILE)
        path = info.path / TRAINER_FILE
        data = read_bounded(path, MAX_TRAINER_BYTES)
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise CheckpointError(
                f"{path} does not match its manifest's sha256: the checkpoint is corrupt; "
                "use latest() to find the newest intact one"
            )
        return parse_trainer(data, path)

    def load_tensors(self, info: CheckpointInfo, template: dict[str, Any]) -> None:
        """COLLECTIVE (in a group): fill `template`'s tensors in place from `info`, resharded to
        the template's layout whatever world size saved it. Every file is verified first."""
        if info.format != FORMAT:
            raise CheckpointError(
                f"checkpoint {info.path} is format 1 (a single .pt file): read it with "
                "load_legacy(), or restore_model_optimizer(), which reads both formats"
            )
        check_tensors(template, "template")
        self._settle()
        manifest = self._pinned(info)
        self._check(manifest)
        names = frozenset(f.path for f in manifest.files)
        metadata_sha = next(f.sha256 for f in manifest.files if f.path == METADATA_FILE)
        group = self._group()
        reader = VerifiedReader(info.path, metadata_sha, names)
        try:
            dcp.load(
                template,
                storage_reader=reader,
                planner=TensorsOnlyPlanner(),
                process_group=group,
                no_dist=group is None,
            )
        except (Exception, CheckpointException) as exc:
            ours = reader.refused or next(
                (e for e in causes(exc) if isinstance(e, CheckpointError)), None
            )
            if ours is not None:
                raise CheckpointError(str(ours)) from None
            raise CheckpointError(
                f"checkpoint {info.path} does not fit what is being restored ({reason(exc)}); "
                "resume with the model and config it was saved with"
            ) from None

    def load_legacy(self, info: CheckpointInfo) -> dict[str, Any]:
        """The state of a format-1 checkpoint (one torch.save file), after checking its hash;
        tensors come back on the CPU and nothing but tensors and plain data is unpickled."""
        if info.format != LEGACY_FORMAT:
            raise CheckpointError(
                f"checkpoint {info.path} is format {info.format} (a DCP directory): read it with "
                "load_trainer() and load_tensors()"
            )
        payload = read_bounded(info.path, info.size)
        if hashlib.sha256(payload).hexdigest() != info.sha256:
            raise CheckpointError(
                f"checkpoint {info.path} does not match its recorded sha256: it is corrupt; "
                "use latest() to find the newest intact one"
            )
        try:
            state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises pickle/runtime errors of several kinds here
            raise CheckpointError(f"checkpoint {info.path} cannot be loaded: {exc}") from exc
        if not isinstance(state, dict):
            raise CheckpointError(
                f"checkpoint {info.path} holds a {type(state).__name__}, not a dict"
            )
        return state

    def periodic(
        self, interval_s: float = 900.0, clock: Callable[[], float] = time.monotonic
    ) -> SaveSchedule:
        """A schedule that says when the next periodic save is due (default every 15 minutes)."""
        return SaveSchedule(interval_s, clock)
