"""Which OSErrors mean "no room to write": a full file system (ENOSPC), a quota (EDQUOT) or the
process's file size limit (EFBIG, RLIMIT_FSIZE). Writers that can wait for room (checkpoints,
the accounting journal, status files) treat these apart from every other I/O error, because a
rank must keep training while an operator frees space."""

from __future__ import annotations

import errno
import logging
import re
from collections.abc import Callable

log = logging.getLogger(__name__)

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


_LOGGED_ERRNO = re.compile(r"\[Errno (\d+)\]")


def is_disk_full(exc: OSError) -> bool:
    return exc.errno in DISK_FULL_ERRNOS


def logs_disk_full(text: str) -> bool:
    """Whether a log (another process's, which only left text behind) reports an OSError
    that means no room: `[Errno 28] No space left on device` and the like."""
    return any(int(m.group(1)) in DISK_FULL_ERRNOS for m in _LOGGED_ERRNO.finditer(text))


def unless_disk_full(what: str, write: Callable[[], None]) -> None:
    """Run `write`; on a full disk only log that `what` was skipped. For writes a later one
    supersedes (status, ledger snapshots, lifecycle events); other errors propagate."""
    try:
        write()
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        log.warning("%s not written: no room (%s); training goes on", what, exc.strerror or exc)
