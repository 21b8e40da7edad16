"""Which OSErrors mean "no room to write": a full file system (ENOSPC), a quota (EDQUOT) or the
process's file size limit (EFBIG, RLIMIT_FSIZE). Writers that can wait for room (checkpoints,
the accounting journal, status files) treat these apart from every other I/O error, because a
rank must keep training while an operator frees space."""

from __future__ import annotations

import errno
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
NO_ROOM_BYTES = 1 << 20
"""Free space under which a file system counts as full when a process died without saying
why: a coordinator replica's journal append or snapshot is larger than the few hundred KiB a
nearly full disk still has, and its traceback went to a log on that disk (seen with 200 KiB
left: the replica's log ended mid-run with no error)."""


_LOGGED_ERRNO = re.compile(r"\[Errno (\d+)\]")


def is_disk_full(exc: OSError) -> bool:
    return exc.errno in DISK_FULL_ERRNOS


def logs_disk_full(text: str) -> bool:
    """Whether a log (another process's, which only left text behind) reports an OSError
    that means no room: `[Errno 28] No space left on device` and the like."""
    return any(int(m.group(1)) in DISK_FULL_ERRNOS for m in _LOGGED_ERRNO.finditer(text))


def has_no_room(path: Path) -> bool:
    """Whether the file system holding `path` is full now. A process that died of a full disk
    often could not log why (its log is on the same disk), so its silence is read with this."""
    try:
        return shutil.disk_usage(path).free < NO_ROOM_BYTES
    except OSError:
        return False


def unless_disk_full(what: str, write: Callable[[], None]) -> None:
    """Run `write`; on a full disk only log that `what` was skipped. For writes a later one
    supersedes (status, ledger snapshots, lifecycle events); other errors propagate."""
    try:
        write()
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        log.warning("%s not written: no room (%s); training goes on", what, exc.strerror or exc)
