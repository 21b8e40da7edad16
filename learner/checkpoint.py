"""Checkpoints that are either complete and verified or ignored: never half a checkpoint.

`save` serialises the state on the caller (that is the copy to host memory: tensors on a GPU are
written out as CPU bytes, so training may go on changing them) and hashes it; a single background
thread then does the slow part — temp file, fsync, atomic rename, fsync of the directory — and
writes the small JSON manifest LAST. A checkpoint is complete when its manifest exists and the
data file's sha256 matches it, so a crash at any point leaves at worst an orphan file that
`latest()` skips with a warning. Old checkpoints are pruned only after a new one is complete, so a
full disk costs the new checkpoint, never the previous ones.

A failed background write is counted (`failures`, `last_failure`) and logged the moment it
happens, so a trainer keeps training through a full disk and its status can say so; the next
save after space is freed writes a complete checkpoint again. `wait()` raises only when the
newest finished write failed: a failure that a later complete checkpoint superseded no longer
matters to the caller (the trainer's final blocking save must not die of a healed disk-full).

Concurrency: one owner thread calls save/wait/latest/load/close; the writer thread only writes.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shoal.config import check_int, check_number
from shoal.learner.diskfull import is_disk_full
from shoal.learner.errors import CheckpointError

log = logging.getLogger(__name__)

FORMAT = 1
_MANIFEST = re.compile(r"^ckpt-(\d{12})\.json$")
_DATA = re.compile(r"^ckpt-(\d{12})\.pt$")
MetaValue = str | int | float | bool


@dataclass(frozen=True)
class CheckpointInfo:
    """Where one checkpoint lives and the content hash that proves it complete."""

    step: int
    path: Path
    manifest: Path
    sha256: str
    size: int
    created_unix: float
    meta: dict[str, MetaValue] = field(default_factory=dict)


def _data_name(step: int) -> str:
    return f"ckpt-{step:012d}.pt"


def _manifest_name(step: int) -> str:
    return f"ckpt-{step:012d}.json"


def _storable(value: object, where: str) -> object:
    """The value with numpy arrays turned into tensors; refuses what weights_only can't load."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        out: dict[Any, object] = {}
        for key, item in value.items():
            if not isinstance(key, str | int):
                raise CheckpointError(
                    f"{where} has key {key!r}: checkpoint dict keys must be str or int"
                )
            out[key] = _storable(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, list | tuple):
        items = [_storable(item, f"{where}[{i}]") for i, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise CheckpointError(
        f"{where} is a {type(value).__name__}, which a checkpoint cannot hold: store tensors, "
        "numpy arrays, numbers, strings and dicts/lists of them (e.g. dataclasses.asdict(cfg))"
    )


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, payload: bytes) -> None:
    """temp file → write → fsync → rename over `path` → fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class CheckpointManager:
    """Writes checkpoints into `directory` in the background and keeps the newest `keep` complete ones."""

    def __init__(self, directory: str | os.PathLike[str], keep: int = 3) -> None:
        self.directory = Path(directory)
        self.keep = check_int("checkpoint.keep", keep, 1)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"cannot create checkpoint directory {self.directory}: {exc.strerror}; "
                "choose a writable checkpoint.directory"
            ) from exc
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: dict[Future[None], int] = {}
        self.failures = 0
        """Writes that failed since this manager was opened (disk full, I/O error)."""
        self.last_failure: str | None = None
        self.last_complete: CheckpointInfo | None = None
        """The newest checkpoint this manager wrote completely."""
        self._unsuperseded: str | None = None  # the newest write's failure, until one succeeds

    def __repr__(self) -> str:
        return (
            f"<CheckpointManager {self.directory} keep={self.keep} pending={len(self._pending)} "
            f"failures={self.failures}>"
        )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing ---------------------------------------------------------------------------

    def save(
        self,
        state: dict[str, Any],
        step: int,
        meta: dict[str, MetaValue] | None = None,
        block: bool = False,
    ) -> CheckpointInfo:
        """Snapshot `state` now and write it in the background (or before returning, if `block`).

        The returned info is final (hash included) but the checkpoint is complete only once the
        write is done: `wait()` flushes and raises CheckpointError if a write failed.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"checkpoint step must be an integer >= 0, got {step!r}")
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint state must be a dict, got {type(state).__name__}")
        buffer = io.BytesIO()
        torch.save(_storable(state, "state"), buffer)
        payload = buffer.getvalue()
        info = CheckpointInfo(
            step=step,
            path=self.directory / _data_name(step),
            manifest=self.directory / _manifest_name(step),
            sha256=hashlib.sha256(payload).hexdigest(),
            size=len(payload),
            created_unix=time.time(),
            meta=dict(meta or {}),
        )
        self._pending = {f: s for f, s in self._pending.items() if not f.done()}
        self._pending[self._writer.submit(self._write_counted, info, payload)] = step
        if block:
            self.wait()
        return info

    def _write_counted(self, info: CheckpointInfo, payload: bytes) -> None:
        """The writer thread's job: write, and record the outcome instead of raising it, so a
        failed write holds no traceback (and no payload) until someone waits."""
        try:
            self._write(info, payload)
        except CheckpointError as exc:
            self.failures += 1
            self.last_failure = self._unsuperseded = str(exc)
            log.warning("%s (%d failed writes so far)", exc, self.failures)
            return
        self.last_complete = info
        self._unsuperseded = None

    def _write(self, info: CheckpointInfo, payload: bytes) -> None:
        if self._already_written(info):
            return
        manifest = {
            "format": FORMAT,
            "step": info.step,
            "file": info.path.name,
            "sha256": info.sha256,
            "size": info.size,
            "created_unix": info.created_unix,
            "meta": info.meta,
        }
        try:
            write_atomically(info.path, payload)
        except OSError as exc:
            raise self._write_error(info, exc) from exc
        try:
            write_atomically(info.manifest, json.dumps(manifest, indent=1).encode())
        except OSError as exc:
            info.path.unlink(missing_ok=True)
            raise self._write_error(info, exc) from exc
        self._prune()

    def _already_written(self, info: CheckpointInfo) -> bool:
        """The same step with the same content is complete on disk (a stop right after a periodic save)."""
        existing = self._verified(info.step, warn=False)
        return existing is not None and existing.sha256 == info.sha256

    def _write_error(self, info: CheckpointInfo, exc: OSError) -> CheckpointError:
        if is_disk_full(exc):
            reason = "the disk is full (or the file size limit was hit)"
            fix = "free space or point checkpoint.directory at a larger disk"
        else:
            reason = exc.strerror or str(exc)
            fix = "check the directory's permissions and health"
        return CheckpointError(
            f"checkpoint step {info.step} ({info.size} bytes) could not be written to "
            f"{self.directory}: {reason} [errno {exc.errno}]; older checkpoints are untouched — {fix}"
        )

    def _prune(self) -> None:
        """Drop checkpoints beyond `keep` and temp files a crashed writer left (writer thread only).

        Only the writer prunes: a manager opened just to read (`latest`, `load`) from another
        process must never delete a temp file the owning writer is filling.
        """
        steps = sorted(self._manifest_steps(), reverse=True)
        for old in steps[self.keep :]:
            (self.directory / _manifest_name(old)).unlink(missing_ok=True)
            (self.directory / _data_name(old)).unlink(missing_ok=True)
        for stale in self.directory.glob(".ckpt-*.tmp"):
            stale.unlink(missing_ok=True)

    def wait(self) -> None:
        """Block until every write so far is done; raise CheckpointError (once) if the newest
        one failed. Failures before a later complete write are only counted."""
        pending, self._pending = self._pending, {}
        for future in pending:
            future.result()
        failure, self._unsuperseded = self._unsuperseded, None
        if failure is not None:
            raise CheckpointError(failure)

    def close(self) -> None:
        """Flush pending writes and stop the writer thread (raises like `wait`)."""
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)

    # -- reading ---------------------------------------------------------------------------

    def _manifest_steps(self) -> list[int]:
        return [int(m.group(1)) for p in self.directory.iterdir() if (m := _MANIFEST.match(p.name))]

    def list_complete(self) -> list[CheckpointInfo]:
        """Every verified checkpoint, newest first (reads and hashes every data file)."""
        return [
            info
            for step in sorted(self._manifest_steps(), reverse=True)
            if (info := self._verified(step))
        ]

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint; half-written or corrupt ones are skipped with a warning."""
        found: CheckpointInfo | None = None
        for step in sorted(self._manifest_steps(), reverse=True):
            found = self._verified(step)
            if found is not None:
                break
        for path in self.directory.iterdir():
            m = _DATA.match(path.name)
            if m and not (path.with_suffix(".json")).exists():
                orphan = int(m.group(1))
                if orphan not in self._pending.values() and (found is None or orphan > found.step):
                    log.warning(
                        "skipping checkpoint %s: its manifest is missing (write not finished)", path
                    )
        return found

    def _verified(self, step: int, warn: bool = True) -> CheckpointInfo | None:
        """The checkpoint of `step` if its manifest and hash check out, else None (logged if `warn`)."""
        report = log.warning if warn else log.debug
        manifest_path = self.directory / _manifest_name(step)
        try:
            manifest = json.loads(manifest_path.read_text())
            path = self.directory / manifest["file"]
            if manifest["format"] != FORMAT or manifest["step"] != step:
                raise ValueError(f"format {manifest['format']!r} step {manifest['step']!r}")
            digest = _sha256_file(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            report("skipping checkpoint step %d: unreadable (%s)", step, exc)
            return None
        if digest != manifest["sha256"]:
            report(
                "skipping checkpoint step %d: %s's sha256 does not match its manifest", step, path
            )
            return None
        return CheckpointInfo(
            step=step,
            path=path,
            manifest=manifest_path,
            sha256=digest,
            size=int(manifest["size"]),
            created_unix=float(manifest["created_unix"]),
            meta=dict(manifest.get("meta") or {}),
        )

    def load(self, info: CheckpointInfo) -> dict[str, Any]:
        """The state saved as `info`, after checking its hash; tensors come back on the CPU."""
        try:
            payload = info.path.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint {info.path}: {exc.strerror}") from exc
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


class SaveSchedule:
    """Decides when a periodic checkpoint is due: `interval_s` after the last save (or the start)."""

    def __init__(
        self, interval_s: float = 900.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = check_number("checkpoint.interval_s", interval_s, above=0, unit="seconds")
        self._clock = clock
        self._last = clock()

    def __repr__(self) -> str:
        return f"<SaveSchedule every {self.interval_s:g}s, due in {self.remaining():.1f}s>"

    def remaining(self) -> float:
        """Seconds until the next save is due (0 when it is already due)."""
        return max(0.0, self._last + self.interval_s - self._clock())

    def due(self) -> bool:
        return self.remaining() == 0.0

    def mark_saved(self) -> None:
        """Restart the interval: call after each save, periodic or on demand."""
        self._last = self._clock()
