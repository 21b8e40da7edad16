"""Child processes for tests: started in a process group of their own and ended with the whole
group at the end, even when the test fails, so nothing a test started outlives it.

Also the small /proc and signal probes that several tests use to check that a process (or a
sandbox user's processes) is really gone."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from tests.support.waiting import DEFAULT_TIMEOUT_S, eventually

T = TypeVar("T")

REAP_TIMEOUT_S = 30.0
"""How long a killed group's leader may take to be reaped: a failure detector, not a bound."""


def pid_alive(pid: int) -> bool:
    """Whether `pid` names a process that has not been reaped (a zombie counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, as another user
    return True


def running(pid: int) -> bool:
    """Whether `pid` is a process that still runs: not gone and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def uid_processes(uids: Sequence[int]) -> list[int]:
    """Pids of live processes running as any of `uids` (e.g. the sandbox's unprivileged users)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as handle:
                for line in handle:
                    if line.startswith("Uid:") and int(line.split()[1]) in uids:
                        found.append(int(entry))
        except OSError:
            continue
    return found


def kill_quietly(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal `pid` if it is still there; a process already gone (or not ours) is fine."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def end_group(process: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    """SIGKILL `process` and the process group it leads (if started with
    start_new_session=True), reap it and close its pipes."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # gone, or it leads no group: the kill below is what ends it
    if process.poll() is None:
        process.kill()
    process.wait(timeout=REAP_TIMEOUT_S)
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()


def eventually_while_running(
    process: subprocess.Popen[str],
    check: Callable[[], T | None],
    what: str,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> T:
    """`eventually(check)`, but failing at once, with the child's stderr, if `process` exits
    before `check` holds: a child that died is not worth waiting out the timeout for."""

    def checked() -> T | None:
        found = check()
        if found or process.poll() is None:
            return found
        _, err = process.communicate()
        args = process.args
        argv = [str(args)] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        name = shlex.join(str(arg) for arg in argv[1:4])
        raise AssertionError(f"{name} exited ({process.returncode}) before {what}: {err}")

    return eventually(checked, what, timeout)


@contextmanager
def child_process(argv: Sequence[str], **popen: Any) -> Iterator[subprocess.Popen[Any]]:
    """`argv` as a child in a process group of its own (Popen keywords as given); the whole
    group is killed and the child reaped on the way out, whether the test passed or not."""
    process = subprocess.Popen(list(argv), start_new_session=True, **popen)
    try:
        yield process
    finally:
        end_group(process)


@contextmanager
def logged_process(
    argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`argv` as a child_process, stdout and stderr appended to `log`."""
    streams = {"stderr": subprocess.STDOUT, "stdin": subprocess.DEVNULL}
    environment = None if env is None else dict(env)
    with open(log, "ab") as out, child_process(argv, stdout=out, env=environment, **streams) as p:
        yield p


@contextmanager
def announcing_process(argv: Sequence[str]) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`argv` as a child in its own process group that prints one line (its address) when it
    serves; yields the process and that line. Its stdin stays open: a child may wait on it to
    learn that the test is done. The group is killed on the way out."""
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    with child_process(argv, **pipes) as process:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        assert line, f"{argv} exited (status {process.poll()}) before it said it serves"
        yield process, line


WORKER_TOKEN = "worker-token"


@contextmanager
def worker_process(token: str = WORKER_TOKEN) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A child process serving a `worker` actor (tests/support/worker_child.py) on a transport
    that accepts `token`; yields the process and its `shoal://` address."""
    argv = [sys.executable, "-m", "tests.support.worker_child", token]
    with announcing_process(argv) as (process, address):
        assert address.startswith("shoal://127.0.0.1:"), address
        yield process, address
