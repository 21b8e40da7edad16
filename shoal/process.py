"""What a child process of shoal asks of the kernel about its own lifetime.

A learner rank or a replica started by a node daemon or an embedded cluster must not outlive
it: an orphan rank keeps its GPU memory and its rendezvous port, and the next generation of the
job cannot start. Linux can send a signal to a child when its parent dies (`prctl`
`PR_SET_PDEATHSIG`); this module is the one place that asks for it. It imports only the
standard library, so any package may use it. The sandbox server (`envs/sandbox_server.py`)
keeps its own call: it runs as `python -I -S` and imports nothing but the standard library.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal

PR_SET_PDEATHSIG = 1
"""`prctl` option from <linux/prctl.h>: the signal this process gets when its parent dies."""


def signal_on_parent_death(signum: int = signal.SIGTERM) -> None:
    """Ask Linux to send `signum` to this process when its parent dies.

    SIGTERM by default, so the child can checkpoint and exit cleanly. Safe to call between
    fork and exec (`preexec_fn`). Elsewhere than Linux, or if libc lacks `prctl`, it does
    nothing: the caller's own liveness checks are then the only guard.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)
