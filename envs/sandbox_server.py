"""The pre-forked sandbox server: one process that forks a fresh, confined child per episode.

It runs as its own interpreter (`python -I -S sandbox_server.py CONFIG`) and imports only the
standard library, so its memory stays small and a fork costs about a millisecond. Isolation
that is costly to set up (a new network namespace, the module imports a child may need) is done
once here and inherited by every child; what is per episode (a chroot into a fresh directory,
an unprivileged uid, resource limits, a new session) is a few system calls in the child.

The server reports facts (exit status, signal, events the child wrote, captured output); the
pool decides what they mean, so the untrusted side never classifies its own result.
Protocol on stdin/stdout: frames of a 4-byte big-endian length and a UTF-8 JSON object.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import json
import os
import resource
import select
import shutil
import signal
import struct
import sys
import tempfile
import time
from typing import Any

# Modules a child may import: after the chroot nothing can be loaded from disk, so anything
# an episode imports must already be in sys.modules.
PREIMPORTED = (
    "array",
    "bisect",
    "collections",
    "copy",
    "dataclasses",
    "datetime",
    "decimal",
    "encodings.idna",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "itertools",
    "math",
    "operator",
    "random",
    "re",
    "socket",
    "statistics",
    "string",
    "struct",
    "time",
    "typing",
)

_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_RESULT_FD = 3
_READ_CHUNK = 65536
_MAX_EVENT_BYTES = 4 * 1024 * 1024

_libc = ctypes.CDLL(None, use_errno=True)


# ---------------------------------------------------------------- the child (untrusted side)


def _emit(fd: int, event: dict[str, Any]) -> None:
    data = (json.dumps(event, default=repr) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


def _describe(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "errno": getattr(exc, "errno", None),
        "message": str(exc)[:500],
    }


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return {"__repr__": repr(value)[:500]}
    return value


def _harness(source: str, calls: list[str]) -> None:
    """Run the episode's source, then each test call, reporting on fd 3 as JSON lines.

    A process the source forked returns here too; it must not report, so it exits quietly.
    """
    me = os.getpid()
    try:
        code = compile(source, "<episode>", "exec")
    except (SyntaxError, ValueError) as exc:
        _emit(_RESULT_FD, {"event": "error", "phase": "compile", **_describe(exc)})
        return
    namespace: dict[str, Any] = {"__name__": "__episode__"}
    try:
        exec(code, namespace)
    except BaseException as exc:
        if os.getpid() != me:
            os._exit(0)
        _emit(_RESULT_FD, {"event": "error", "phase": "module", **_describe(exc)})
        return
    if os.getpid() != me:
        os._exit(0)
    for index, call in enumerate(calls):
        try:
            value = eval(call, namespace)
        except BaseException as exc:
            if os.getpid() != me:
                os._exit(0)
            _emit(_RESULT_FD, {"event": "test", "index": index, "error": _describe(exc)})
            continue
        if os.getpid() != me:
            os._exit(0)
        _emit(_RESULT_FD, {"event": "test", "index": index, "value": _jsonable(value)})
    _emit(_RESULT_FD, {"event": "done"})


def _confine(workdir: str, out_w: int, err_w: int, res_w: int, config: dict[str, Any]) -> None:
    """Everything that turns a fresh fork into a sandbox, in the order the kernel needs."""
    os.setsid()
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.dup2(res_w, _RESULT_FD)
    os.closerange(_RESULT_FD + 1, 65536)
    os.chdir(workdir)
    if config["chroot"]:
        os.chroot(workdir)
        os.chdir("/")
    limits = config["limits"]
    cpu = int(limits["cpu_s"])
    for which, soft, hard in (
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_AS, limits["memory_bytes"], limits["memory_bytes"]),
        (resource.RLIMIT_FSIZE, limits["file_size_bytes"], limits["file_size_bytes"]),
        (resource.RLIMIT_NOFILE, limits["open_files"], limits["open_files"]),
        (resource.RLIMIT_NPROC, limits["processes"], limits["processes"]),
        (resource.RLIMIT_CORE, 0, 0),
    ):
        resource.setrlimit(which, (soft, hard))
    uid = config["uid"]
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if not config["netns"]:
        _block_sockets()


def _block_sockets() -> None:
    """The weak fallback where no network namespace could be made: refuse at the Python level."""
    import socket

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise PermissionError(errno.EPERM, "network access is disabled in the sandbox")

    socket.socket = refuse  # type: ignore[assignment,misc]
    socket.create_connection = refuse
    socket.socketpair = refuse


def _child(
    request: dict[str, Any], workdir: str, fds: tuple[int, int, int], config: dict[str, Any]
) -> None:
    """The forked child's whole life; it never returns into the server's loop."""
    try:
        _confine(workdir, *fds, config)
    except BaseException as exc:
        with contextlib.suppress(BaseException):
            _emit(_RESULT_FD, {"event": "error", "phase": "setup", **_describe(exc)})
        os._exit(70)
    try:
        _harness(request["source"], request["calls"])
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(0)


# ---------------------------------------------------------------- the server (trusted side)


class _Capture:
    """A bounded byte buffer: keeps the first `cap` bytes, counts the rest."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        self.data += chunk[: max(room, 0)]
        self.dropped += max(len(chunk) - max(room, 0), 0)


def _children() -> list[int]:
    pid = os.getpid()
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(p) for p in handle.read().split()]
    except OSError:
        return []


def _reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _kill_everything(child: int) -> int:
    """Kill the episode's session, then every process reparented to us (we are a subreaper);
    returns the child's wait status.

    A descendant that escaped the session with setsid() is reparented to this server once its
    parent dies, so repeating until no child is left catches it.
    """
    try:
        os.killpg(child, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _, status = os.waitpid(child, 0)
    for _ in range(2000):
        others = _children()
        if not others:
            break
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap_all()
        time.sleep(0.001)
    _reap_all()
    return status


def _drain(fd: int, sink: Any) -> bool:
    """Read what is available now; False once the writer side is closed."""
    while True:
        try:
            chunk = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        sink(chunk)


def _collect(
    child: int, fds: tuple[int, int, int], timeout: float, config: dict[str, Any]
) -> dict[str, Any]:
    out_r, err_r, res_r = fds
    cap = config["limits"]["output_bytes"]
    out, err, res = _Capture(cap), _Capture(cap), _Capture(_MAX_EVENT_BYTES)
    sinks = {out_r: out.add, err_r: err.add, res_r: res.add}
    for fd in fds:
        os.set_blocking(fd, False)
    pidfd = os.pidfd_open(child)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    for fd in fds:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            ready = poller.poll(remaining * 1000)
            exited = False
            for fd, _ in ready:
                if fd == pidfd:
                    exited = True
                elif not _drain(fd, sinks[fd]):
                    poller.unregister(fd)
            if exited or res.dropped:
                break
        for fd in fds:
            _drain(fd, sinks[fd])
    finally:
        os.close(pidfd)
    status = _kill_everything(child)
    return {
        "events": _parse_events(bytes(res.data)),
        "events_overflow": res.dropped > 0,
        "stdout": out.data.decode("utf-8", "replace"),
        "stderr": err.data.decode("utf-8", "replace"),
        "output_dropped": out.dropped + err.dropped,
        "timed_out": timed_out,
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
    }


def _parse_events(data: bytes) -> list[dict[str, Any]]:
    events = []
    for line in data.split(b"\n"):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def _run_episode(request: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="ep-", dir=config["root"])
    if config["uid"] is not None:
        os.chown(workdir, config["uid"], config["uid"])
    pipes = [os.pipe() for _ in range(3)]
    try:
        child = os.fork()
        if child == 0:
            _child(request, workdir, (pipes[0][1], pipes[1][1], pipes[2][1]), config)
        for _, write_end in pipes:
            os.close(write_end)
        reads = (pipes[0][0], pipes[1][0], pipes[2][0])
        facts = _collect(child, reads, float(request["timeout"]), config)
    finally:
        for read_end, _ in pipes:
            os.close(read_end)
        shutil.rmtree(workdir, ignore_errors=True)
    facts["duration_s"] = time.perf_counter() - started
    return facts


def _read_exact(fd: int, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def read_frame(fd: int) -> Any:
    """One frame from `fd`, or None at end of file."""
    header = _read_exact(fd, 4)
    if header is None:
        return None
    body = _read_exact(fd, struct.unpack(">I", header)[0])
    return None if body is None else json.loads(body)


def write_frame(fd: int, obj: Any) -> None:
    body = json.dumps(obj).encode()
    data = struct.pack(">I", len(body)) + body
    while data:
        data = data[os.write(fd, data) :]


def _isolate_once(config: dict[str, Any]) -> dict[str, Any]:
    """Apply the server-wide isolation; returns what really applied, for every result."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    root = os.geteuid() == 0
    config["netns"] = root and _libc.unshare(_CLONE_NEWNET) == 0
    config["chroot"] = root
    config["uid"] = (config["uid_base"] + os.getpid()) if root else None
    for name in PREIMPORTED:
        __import__(name)
    gc.collect()
    gc.freeze()
    return {
        "network": "network namespace (no interfaces up)"
        if config["netns"]
        else "python-level socket block (weak: no namespace permitted)",
        "filesystem": "chroot into the episode directory"
        if config["chroot"]
        else "none (not root): the episode runs as the pool's user",
        "user": f"uid {config['uid']}" if root else f"uid {os.geteuid()} (could not drop)",
        "processes": f"RLIMIT_NPROC={config['limits']['processes']} for a uid of its own"
        if root
        else "RLIMIT_NPROC on the shared user (weak)",
    }


def serve(config: dict[str, Any]) -> None:
    isolation = _isolate_once(config)
    write_frame(
        1, {"ready": True, "pid": os.getpid(), "uid": config["uid"], "isolation": isolation}
    )
    while True:
        request = read_frame(0)
        if request is None:
            return
        write_frame(1, _run_episode(request, config))


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
