"""The pre-forked sandbox server: one process that forks a fresh, confined child per episode.

It runs as its own interpreter (`python -I -S sandbox_server.py CONFIG`) and imports only the
standard library, so its memory stays small and a fork stays cheap. Isolation that is costly to
set up (a new network namespace, the code of the modules a child may import) is done once here
and inherited by every child; what is per episode (a chroot into a fresh directory,
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
import importlib.machinery
import itertools
import json
import os
import resource
import select
import signal
import struct
import sys
import time
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import importlib.abc

# Modules an episode may import. After the chroot nothing can be read from disk, so the server
# keeps their compiled code in memory (`_Preloaded`) and runs it only when an episode imports
# one; importing them all up front would make every fork dearer (the server's memory grows,
# and `random` reseeds itself in every child), for modules most episodes never use.
ALLOWED_MODULES = (
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
_CLONE_NEWNS = 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_RESULT_FD = 3
_READ_CHUNK = 65536
_MAX_EVENT_BYTES = 4 * 1024 * 1024
_FINAL_READS = 8

_libc = ctypes.CDLL(None, use_errno=True)
# Declared signatures let ctypes skip guessing argument types on each call: the child calls
# prctl once per episode, and the guessing touched (and so copied) dozens of pages.
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int
_DONE = b'{"event": "done"}\n'


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
    os.write(_RESULT_FD, _DONE)


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
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
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


# ---------------------------------------------------------------- modules for episodes


class _Preloaded:
    """A meta-path finder and loader serving modules from code compiled before the chroot."""

    def __init__(self, code: dict[str, tuple[Any, str, bool]]) -> None:
        self.code = code

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        entry = self.code.get(name)
        if entry is None:
            return None
        _, origin, is_package = entry
        loader = cast("importlib.abc.Loader", self)  # importlib.abc itself is too dear to import
        spec = importlib.machinery.ModuleSpec(name, loader, origin=origin, is_package=is_package)
        spec.has_location = True
        return spec

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        code, origin, is_package = self.code[module.__name__]
        module.__file__ = origin
        if is_package:
            module.__path__ = []
        exec(code, module.__dict__)


def _probe_dependencies(names: tuple[str, ...]) -> list[list[str]]:
    """[name, kind] of every module importing `names` loads, found in a throwaway child.

    kind is "source" (Python code we can hold in memory) or "native" (built in or an
    extension, which must be loaded in the server itself).
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            before = set(sys.modules)
            for name in names:
                with contextlib.suppress(ImportError):
                    __import__(name)
            found = []
            for name in sorted(set(sys.modules) - before):
                spec = getattr(sys.modules[name], "__spec__", None)
                origin = getattr(spec, "origin", None) or ""
                found.append([name, "source" if origin.endswith(".py") else "native"])
            os.write(write_end, json.dumps(found).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, _READ_CHUNK):
        chunks.append(chunk)
    os.close(read_end)
    os.waitpid(pid, 0)
    return list(json.loads(b"".join(chunks) or b"[]"))


def _install_preloaded(names: tuple[str, ...]) -> None:
    code: dict[str, tuple[Any, str, bool]] = {}
    for name, kind in _probe_dependencies(names):
        if kind == "native":
            with contextlib.suppress(ImportError):
                __import__(name)
            continue
        spec = importlib.machinery.PathFinder.find_spec(name, _parent_path(name))
        if spec is None or spec.loader is None or not spec.origin:
            continue
        code[name] = (
            spec.loader.get_code(name),  # type: ignore[attr-defined]
            spec.origin,
            spec.submodule_search_locations is not None,
        )
    sys.meta_path.insert(0, _Preloaded(code))


def _parent_path(name: str) -> list[str] | None:
    parent, _, _ = name.rpartition(".")
    if not parent:
        return None
    spec = importlib.machinery.PathFinder.find_spec(parent, _parent_path(parent))
    return None if spec is None else list(spec.submodule_search_locations or [])


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


def _read_ready(poller: select.poll, sinks: dict[int, Any], timeout_ms: float) -> bool:
    """One read from each pipe `poll` reports readable, so no read blocks or raises; a pipe
    whose writers are all gone is forgotten. True when the child (its pidfd) has exited."""
    exited = False
    for fd, _ in poller.poll(timeout_ms):
        if fd not in sinks:
            exited = True
            continue
        chunk = os.read(fd, _READ_CHUNK)
        if chunk:
            sinks[fd](chunk)
        else:
            poller.unregister(fd)
            del sinks[fd]
    return exited


def _collect(
    child: int, fds: tuple[int, int, int], timeout: float, config: dict[str, Any]
) -> dict[str, Any]:
    """Gather the child's output until it exits, overflows or runs out of time.

    The result lines go back unparsed: this process forks, so every page it touches after a
    fork is copied, and parsing belongs to the pool, which never forks.
    """
    out_r, err_r, res_r = fds
    cap = config["limits"]["output_bytes"]
    out, err, res = _Capture(cap), _Capture(cap), _Capture(_MAX_EVENT_BYTES)
    sinks = {out_r: out.add, err_r: err.add, res_r: res.add}
    pidfd = os.pidfd_open(child)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    for fd in fds:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    timed_out = exited = False
    try:
        while not (exited or res.dropped):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            exited = _read_ready(poller, sinks, remaining * 1000)
        poller.unregister(pidfd)
        for _ in range(_FINAL_READS):  # bounded: a leftover descendant may keep writing
            if not sinks or not poller.poll(0):
                break
            _read_ready(poller, sinks, 0)
    finally:
        os.close(pidfd)
    status = _kill_everything(child)
    return {
        "events": res.data.decode("utf-8", "replace"),
        "events_overflow": res.dropped > 0,
        "stdout": out.data.decode("utf-8", "replace"),
        "stderr": err.data.decode("utf-8", "replace"),
        "output_dropped": out.dropped + err.dropped,
        "timed_out": timed_out,
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
    }


_EPISODES = itertools.count()


def _remove_tree(top: str) -> None:
    """Delete what an episode left, never following its symlinks out of the directory."""
    stack, dirs = [top], []
    while stack:
        path = stack.pop()
        dirs.append(path)
        try:
            entries = list(os.scandir(path))
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
    for path in reversed(dirs):
        with contextlib.suppress(OSError):
            os.rmdir(path)


def _run_episode(request: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    workdir = os.path.join(config["root"], f"ep-{os.getpid()}-{next(_EPISODES)}")
    os.mkdir(workdir, 0o700)
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
        _remove_tree(workdir)
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


def _private_disk(config: dict[str, Any]) -> bool:
    """Mount a small tmpfs of our own over the episode root, in a mount namespace of our own.

    Without it, episodes share the machine's /dev/shm or /tmp and one of them could fill it
    (RLIMIT_FSIZE bounds a file, not how many). The mount vanishes with the server.
    """
    if _libc.unshare(_CLONE_NEWNS) != 0:
        return False
    if _libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return False
    options = f"size={config['limits']['disk_bytes']},nr_inodes=4096,mode=0711".encode()
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    return bool(_libc.mount(b"tmpfs", config["root"].encode(), b"tmpfs", flags, options) == 0)


def _isolate_once(config: dict[str, Any]) -> dict[str, Any]:
    """Apply the server-wide isolation; returns what really applied, for every result."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    root = os.geteuid() == 0
    config["netns"] = root and _libc.unshare(_CLONE_NEWNET) == 0
    config["chroot"] = root
    config["uid"] = (config["uid_base"] + os.getpid()) if root else None
    disk = root and _private_disk(config)
    _install_preloaded(ALLOWED_MODULES)
    gc.collect()
    gc.freeze()
    mib = config["limits"]["disk_bytes"] // (1024 * 1024)
    return {
        "network": "network namespace (no interfaces up)"
        if config["netns"]
        else "python-level socket block (weak: no namespace permitted)",
        "filesystem": "chroot into the episode directory"
        if config["chroot"]
        else "none (not root): the episode runs as the pool's user",
        "disk": f"private {mib} MiB tmpfs (noexec) in a mount namespace"
        if disk
        else "shared temp directory (no quota: only RLIMIT_FSIZE per file)",
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
