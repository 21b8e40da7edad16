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
  restart trusts), the pipeline's manifest of finished stages, a node's fault outcomes (so a
  fault it executed is not executed again), a node's id (its identity in the cluster).
* not durable: status, address, progress and ledger snapshots rewritten every few seconds,
  the task/node exchange files, a chaos clock offset, a simulated GPU's state, caches. They are
  rewritten by their next writer, or describe processes a host crash has ended anyway.

`lock_directory` is the one exclusive lock on a data directory (a node daemon's, a coordinator
replica's): two processes on one directory would corrupt its journal or fight over its tasks.

This module imports only the standard library and the error root, so any package may use it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from pathlib import Path
from typing import IO, Any

from shoal.errors import ConfigError, ShoalError


class UnreadableFile(ShoalError):
    """A file from outside that is not a regular file, cannot be read or is over its bound."""


class FileMissing(UnreadableFile):
    """Nothing at the path (a broken symbolic link is not missing: it is an UnreadableFile)."""


READ_FIXES: dict[int, str] = {
    errno.EACCES: "give this user read permission on it and search permission on its directories",
    errno.EPERM: "give this user read permission on it and search permission on its directories",
    errno.ELOOP: "it is a symbolic-link loop: point the link at a real file",
    errno.ENAMETOOLONG: "the path is too long: use a shorter one",
    errno.ENOTDIR: "a part of the path is a file, not a directory: check the path",
    errno.EIO: "the disk failed to read it: check the disk",
}
"""What to do about each way reading a path fails; any other errno says to check the path."""


def read_limited(path: Path, limit: int) -> bytes:
    """A regular file's bytes, at most `limit` of them, for a file from outside.

    A FIFO or a device would block or never end, so only a regular file is read: checked by
    stat before opening and on the open descriptor after (a file swapped in between is refused
    too), opened non-blocking so not even a FIFO swapped in can stall the open. Symlinks to
    regular files are followed (a model directory in a Hugging Face cache is links into its
    blob store). A file over `limit` is refused by its size, and never more than `limit` + 1
    bytes are read (a file growing meanwhile). Callers add what to do in their own error."""
    try:
        _check_regular(path, os.stat(path), limit)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        if os.path.islink(path):
            raise UnreadableFile(f"{path} is a broken symbolic link") from None
        raise FileMissing(f"{path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise _unreadable(path, exc) from None
    try:
        _check_regular(path, os.fstat(fd), limit)
        data = _read_at_most(fd, limit + 1)
    except OSError as exc:
        raise _unreadable(path, exc) from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise UnreadableFile(_too_large(path, limit))
    return data


def _check_regular(path: Path, info: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise UnreadableFile(f"{path} is not a regular file")
    if info.st_size > limit:
        raise UnreadableFile(_too_large(path, limit))


def _read_at_most(fd: int, size: int) -> bytes:
    """Up to `size` bytes of `fd`, in chunks, so a file that grew is never read whole."""
    chunks: list[bytes] = []
    while size > 0:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _too_large(path: Path, limit: int) -> str:
    bound = (
        f"{limit >> 20} MiB" if limit >= 1 << 20 and not limit % (1 << 20) else f"{limit:,} bytes"
    )
    return f"{path} is larger than {bound}, the most shoal reads of it: refused unread"


def _unreadable(path: Path, exc: OSError | ValueError) -> UnreadableFile:
    if isinstance(exc, ValueError):  # a NUL byte in the path
        return UnreadableFile(f"cannot read {str(path)[:200]!r}: {exc}")
    fix = READ_FIXES.get(exc.errno or 0, "check the path")
    return UnreadableFile(f"cannot read {str(path)[:200]}: {exc.strerror}; {fix}")


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


def lock_directory(directory: Path, in_use: str) -> IO[str]:
    """Take the exclusive lock on `directory/lock` without waiting, and return its open file:
    the lock lasts until that file is closed (or the process dies, even by kill -9).

    Another process holding it is a `ConfigError` with the message `in_use` (which should say
    what to do); a directory that cannot be written raises the `OSError` for the caller to word.
    """
    handle = open(directory / "lock", "w")  # noqa: SIM115 (returned: the caller closes it)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ConfigError(in_use) from None
    except BaseException:
        handle.close()
        raise
    return handle
