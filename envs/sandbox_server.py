"""The pre-forked sandbox server: one process that forks a fresh, confined child per episode.

It runs as its own interpreter (`python -I -S sandbox_server.py CONFIG`) and imports only the
standard library, so its memory stays small and a fork stays cheap. Isolation that is costly to
set up is done once here: the code of the modules a child may import, and for each of its
`slots` (the episodes it may run at once) a uid, a tmpfs, a network and an IPC namespace of its
own. A request carries up to `slots` episodes; each gets a slot, and what is per episode (a
session, the slot's namespaces, a chroot into a fresh directory, rlimits, the slot's uid) is a
few system calls in its child. All of a request's children are forked back to back and watched
together, so the server's own bookkeeping (whose writes to shared pages each cost a page copy
after every fork) is paid once per request rather than once per episode.

The server reports facts (exit status, signal, events the child wrote, captured output); the
pool decides what they mean, so the untrusted side never classifies its own result.
Protocol on stdin/stdout: frames of a 4-byte big-endian length and a UTF-8 JSON object.

Why one module of ~800 lines: it runs as a standalone script under `-I -S`, and isolated mode
leaves the script's own directory off sys.path, so it cannot import a sibling module (and an
import path of our own making is what the confinement must not depend on). It is kept readable
by its three marked sections instead: the child (untrusted side), the modules episodes may
import, and the server (trusted side).
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
_CLONE_NEWIPC = 0x08000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18
# Its own copy of shoal.process.PR_SET_PDEATHSIG: this server imports only the standard library.
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_RESULT_FD = 3
_CONTROL_FD = 4
"""Closed before the episode's code runs: what the harness says here, only the harness said."""
_READ_CHUNK = 65536
_FINAL_READS = 8
MAX_SLOTS = 64
"""Uids are `uid_base + server pid * MAX_SLOTS + slot`, so no two slots anywhere share one."""

_libc = ctypes.CDLL(None, use_errno=True)
# Declared signatures let ctypes skip guessing argument types on each call: the child calls
# prctl once per episode, and the guessing touched (and so copied) dozens of pages.
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int
_setns = _libc.setns
_setns.argtypes = [ctypes.c_int, ctypes.c_int]
_setns.restype = ctypes.c_int
_DONE = b'{"event": "done"}\n'
_RUN = b'{"phase": "run"}\n'
_DIGITS_AS_ZERO = str.maketrans("123456789", "000000000")


# ---------------------------------------------------------------- the child (untrusted side)


def _report(fd: int, record: dict[str, Any]) -> None:
    """One record, one line of ASCII JSON (what the pool's parser accepts, and nothing else)."""
    data = (json.dumps(record, allow_nan=False) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


def _text(text: str, limit: int) -> str:
    """At most `limit` characters that can be printed (a lone surrogate cannot be encoded)."""
    return text[:limit].encode("utf-8", "replace").decode("utf-8")


def _describe(exc: BaseException, channel: dict[str, int]) -> dict[str, Any]:
    """An exception as plain data. Its message and errno are the program's objects, which may
    raise or be of any type, so each is taken defensively."""
    try:
        message = str(exc)
    except BaseException:
        message = "<the exception's message could not be shown>"
    try:
        code = exc.errno if isinstance(exc, OSError) else None
    except BaseException:
        code = None
    return {
        "type": _text(type(exc).__name__, channel["type_chars"]),
        "errno": code if type(code) is int and -(2**31) <= code < 2**31 else None,
        "message": _text(message if type(message) is str else "", channel["text_chars"]),
    }


def _within(value: Any, room: int) -> bool:
    """Whether `value` nests at most `room` lists, tuples and dicts deep."""
    if isinstance(value, list | tuple | dict):
        if room == 0:
            return False
        items = value.values() if isinstance(value, dict) else value
        return all(_within(item, room - 1) for item in items)
    return True


def _fits(line: str, channel: dict[str, int]) -> bool:
    """Whether the pool's parser takes `line` (sandbox_channel: size, element count, and no
    digit run longer than an integer may be, wherever it is)."""
    elements = line.count(",") + line.count("[") + line.count("{")
    digits = line.translate(_DIGITS_AS_ZERO)
    return (
        len(line) < channel["record_bytes"]
        and elements <= channel["record_elements"]
        and "0" * (channel["int_digits"] + 1) not in digits
    )


def _value_line(index: int, value: Any, channel: dict[str, int]) -> str:
    """The record of a test's value; one the pool would refuse (not finite, too deep, too long,
    too many elements, not JSON at all) is replaced by the value's repr, which fails the test
    but not the episode."""
    try:
        if _within(value, channel["value_depth"]):
            line = json.dumps({"event": "test", "index": index, "value": value}, allow_nan=False)
            if _fits(line, channel):
                return line
    except BaseException:  # the value's own methods ran: anything may come out of them
        pass
    try:
        shown = repr(value)
    except BaseException:
        shown = f"<{type(value).__name__} that could not be shown>"
    text = _text(shown if type(shown) is str else "", channel["text_chars"])
    return json.dumps({"event": "test", "index": index, "value": {"__repr__": text}})


def _harness(source: str, calls: list[str], channel: dict[str, int]) -> None:
    """Compile the source and say so on the control channel, close that channel, then run the
    code and each test call, reporting on the result channel (fd 3).

    From the moment the control channel is closed the process runs the episode's code: it can
    write to fd 3 as well, so the pool trusts nothing there (sandbox_channel). A process the
    source forked returns here too; it must not report, so it exits quietly.
    """
    me = os.getpid()
    try:
        code = compile(source, "<episode>", "exec")
    except Exception as exc:  # SyntaxError, ValueError (NUL), MemoryError, RecursionError
        _report(_CONTROL_FD, {"phase": "compile", "error": _describe(exc, channel)})
        return
    os.write(_CONTROL_FD, _RUN)
    os.close(_CONTROL_FD)
    namespace: dict[str, Any] = {"__name__": "__episode__"}
    try:
        exec(code, namespace)
    except BaseException as exc:
        if os.getpid() != me:
            os._exit(0)
        _report(_RESULT_FD, {"event": "error", "error": _describe(exc, channel)})
        return
    if os.getpid() != me:
        os._exit(0)
    for index, call in enumerate(calls):
        try:
            value = eval(call, namespace)
        except BaseException as exc:
            if os.getpid() != me:
                os._exit(0)
            _report(_RESULT_FD, {"event": "test", "index": index, "error": _describe(exc, channel)})
            continue
        if os.getpid() != me:
            os._exit(0)
        line = (_value_line(index, value, channel) + "\n").encode()
        while line:
            line = line[os.write(_RESULT_FD, line) :]
    os.write(_RESULT_FD, _DONE)


def _enter_slot(slot: _Slot) -> None:
    """A session of its own and the slot's namespaces (their descriptors are still open)."""
    os.setsid()
    if not slot.entered:
        for ns_fd, kind in ((slot.netns, _CLONE_NEWNET), (slot.ipcns, _CLONE_NEWIPC)):
            if ns_fd is not None and _setns(ns_fd, kind) != 0:
                raise OSError(ctypes.get_errno(), "setns into the slot's namespace failed")


def _take_descriptors(fds: tuple[int, ...], config: dict[str, Any]) -> None:
    """stdin from /dev/null, then stdout, stderr, the result and the control channel on fds
    1-4; every other descriptor (the server's, the siblings' pipes) is closed."""
    os.dup2(config["devnull"], 0)
    for target, fd in enumerate(fds, 1):
        os.dup2(fd, target)
    os.closerange(_CONTROL_FD + 1, 65536)


def _confine(workdir: str, slot: _Slot, config: dict[str, Any]) -> None:
    """The rest of what turns a fresh fork into a sandbox, in the order the kernel needs."""
    os.chdir(workdir)
    if config["chroot"]:
        os.chroot(workdir)
        os.chdir("/")
    for which, soft_hard in config["rlimits"]:
        resource.setrlimit(which, soft_hard)
    if slot.uid is not None:
        os.setgroups([])
        os.setgid(slot.uid)
        os.setuid(slot.uid)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if slot.netns is None:
        _block_sockets()


def _block_sockets() -> None:
    """The weak fallback where no network namespace could be made: refuse at the Python level."""
    import socket

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise PermissionError(errno.EPERM, "network access is disabled in the sandbox")

    socket.socket = refuse  # type: ignore[assignment,misc]
    socket.create_connection = refuse
    socket.socketpair = refuse


def _child(episode: _Episode, config: dict[str, Any]) -> None:
    """The forked child's whole life; it never returns into the server's loop. A failure to
    confine it goes on the control channel: where the descriptors were, then on fd 4."""
    control = episode.writes[3]
    try:
        _enter_slot(episode.slot)
        _take_descriptors(episode.writes, config)
        control = _CONTROL_FD
        _confine(episode.workdir, episode.slot, config)
    except BaseException as exc:
        with contextlib.suppress(BaseException):
            _report(control, {"phase": "setup", "error": _describe(exc, config["channel"])})
        os._exit(70)
    try:
        _harness(episode.request["source"], episode.request["calls"], config["channel"])
    finally:
        # try/except rather than contextlib.suppress: no objects made, fewer pages copied.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
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


class _Slot:
    """What each of the episodes running at once has of its own, made when the server starts:
    a directory (its own tmpfs where possible), a uid, a network and an IPC namespace. A slot
    is reused only after everything its last episode started is dead."""

    __slots__ = ("directory", "entered", "ipcns", "netns", "uid")

    def __init__(
        self, directory: str, uid: int | None, netns: int | None, ipcns: int | None
    ) -> None:
        self.directory = directory
        self.uid = uid
        self.netns = netns
        self.ipcns = ipcns
        self.entered = False
        """The server itself is in this slot's namespaces, so its children need no setns."""


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


_EPISODES = itertools.count()


class _Episode:
    """One child: its directory and pipes, what it wrote so far, its deadline, and in the end
    its wait status. Everything but the fork is prepared before any child of the request is
    forked (`_fork_all`)."""

    __slots__ = (
        "ctl",
        "deadline",
        "ended",
        "err",
        "exited",
        "fds",
        "out",
        "pid",
        "pidfd",
        "request",
        "res",
        "sinks",
        "slot",
        "started",
        "status",
        "timed_out",
        "workdir",
        "writes",
    )

    def __init__(self, slot: _Slot, request: dict[str, Any], config: dict[str, Any]) -> None:
        self.slot, self.request = slot, request
        self.started = time.perf_counter()
        self.workdir = os.path.join(slot.directory, f"ep-{os.getpid()}-{next(_EPISODES)}")
        os.mkdir(self.workdir, 0o700)
        if slot.uid is not None:
            os.chown(self.workdir, slot.uid, slot.uid)
        cap, channel = config["limits"]["output_bytes"], config["channel"]
        self.out, self.err = _Capture(cap), _Capture(cap)
        self.res = _Capture(channel["channel_bytes"])
        self.ctl = _Capture(channel["control_bytes"])
        self.deadline = 0.0
        self.timed_out = self.exited = False
        self.pid: int | None = None
        self.status: int | None = None
        self.ended = 0.0
        pipes = [os.pipe() for _ in range(4)]
        self.writes: tuple[int, ...] = tuple(write_end for _, write_end in pipes)
        sinks = (self.out.add, self.err.add, self.res.add, self.ctl.add)
        self.sinks = {read_end: sink for (read_end, _), sink in zip(pipes, sinks)}
        self.fds = [read_end for read_end, _ in pipes]
        self.pidfd = -1

    def forked(self) -> None:
        """The server's side once every child of the request is forked: its write ends go (the
        pipes end when the child's do), and a pidfd says when the child exits."""
        assert self.pid is not None
        for write_end in self.writes:
            os.close(write_end)
        self.writes = ()
        self.pidfd = os.pidfd_open(self.pid)
        self.fds.append(self.pidfd)
        self.deadline = time.monotonic() + float(self.request["timeout"])

    def read(self, fd: int, poller: select.poll) -> None:
        """One read from a pipe poll called readable (so it neither blocks nor raises); a
        pipe whose writers are all gone is forgotten."""
        chunk = os.read(fd, _READ_CHUNK)
        if chunk:
            self.sinks[fd](chunk)
        else:
            poller.unregister(fd)
            del self.sinks[fd]

    def end(self, poller: select.poll) -> None:
        """Take what is left in the pipes (bounded: a leftover descendant may keep writing),
        kill the episode's session and reap the child."""
        poller.unregister(self.pidfd)
        for _ in range(_FINAL_READS):
            ready = False
            for fd, _ in poller.poll(0):
                if fd in self.sinks:
                    ready = True
                    self.read(fd, poller)
            if not ready:
                break
        for fd in self.sinks:
            poller.unregister(fd)
        self.sinks = {}
        self._reap()

    def _reap(self) -> None:
        if self.pid is None:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _, self.status = os.waitpid(self.pid, 0)
        self.ended = time.perf_counter()

    def close(self) -> None:
        if self.status is None:
            self._reap()
        for fd in (*self.fds, *self.writes):
            os.close(fd)

    def facts(self) -> dict[str, Any]:
        """The raw result, unparsed: this process forks, so every page it touches after a fork
        is copied, and parsing belongs to the pool, which never forks."""
        status = self.status or 0
        return {
            "control": self.ctl.data.decode("latin-1"),
            "events": self.res.data.decode("latin-1"),
            "events_overflow": self.res.dropped > 0,
            "stdout": self.out.data.decode("utf-8", "replace"),
            "stderr": self.err.data.decode("utf-8", "replace"),
            "output_dropped": self.out.dropped + self.err.dropped,
            "timed_out": self.timed_out,
            "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "duration_s": self.ended - self.started,
        }


def _watch(episodes: list[_Episode]) -> None:
    """Gather every child's output until it exits, overflows its result channel or runs out
    of time, and end each as soon as it does; one poll watches them all."""
    poller = select.poll()
    owners = {}
    for episode in episodes:
        for fd in episode.fds:
            poller.register(fd, select.POLLIN)
            owners[fd] = episode
    live = list(episodes)
    # Plain loops, no generators: whatever this loop touches after the forks is copied.
    while live:
        now = time.monotonic()
        first = live[0].deadline
        for episode in live:
            episode.timed_out = episode.deadline <= now
            first = min(first, episode.deadline)
        if first > now:
            for fd, _ in poller.poll((first - now) * 1000):
                episode = owners[fd]
                if fd == episode.pidfd:
                    episode.exited = True
                elif fd in episode.sinks:
                    episode.read(fd, poller)
        for episode in live[:]:
            if episode.timed_out or episode.exited or episode.res.dropped:
                episode.end(poller)
                live.remove(episode)


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


def _sweep() -> None:
    """Kill every process still our child once all episodes are reaped: descendants that left
    their episode's session with setsid() are reparented to this server (a subreaper) when
    their parent dies, so repeating until none is left catches them all."""
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


def _fork_all(episodes: list[_Episode], config: dict[str, Any]) -> None:
    """Fork every child in a tight loop. After each fork, every page the server writes is
    copied (or at least faulted) again, so between forks it writes as few as it can; a child
    closes its siblings' pipes before anything untrusted runs."""
    for episode in episodes:
        episode.pid = os.fork()
        if episode.pid == 0:
            _child(episode, config)
    for episode in episodes:
        episode.forked()


def _run_batch(
    requests: list[dict[str, Any]], slots: list[_Slot], config: dict[str, Any]
) -> list[dict[str, Any]]:
    """Fork one child per request, each in a slot of its own, watch them all, then make sure
    nothing any of them started is left before the slots are used again."""
    if len(requests) > len(slots):
        raise ValueError(f"{len(requests)} episodes in one request, but only {len(slots)} slots")
    episodes: list[_Episode] = []
    try:
        for slot, request in zip(slots, requests):
            episodes.append(_Episode(slot, request, config))
        _fork_all(episodes, config)
        _watch(episodes)
    finally:
        for episode in episodes:
            episode.close()
        _sweep()
        for episode in episodes:
            _remove_tree(episode.workdir)
    return [episode.facts() for episode in episodes]


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


def _private_mounts() -> bool:
    """A mount namespace of our own whose mounts never propagate back to the machine's."""
    if _libc.unshare(_CLONE_NEWNS) != 0:
        return False
    return bool(_libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) == 0)


def _mount_tmpfs(directory: str, config: dict[str, Any]) -> bool:
    """A small tmpfs of a slot's own: without it, episodes share the machine's /dev/shm or
    /tmp and one of them could fill it (RLIMIT_FSIZE bounds a file, not how many), or fill it
    for an episode running beside it. The mount vanishes with the server."""
    options = f"size={config['limits']['disk_bytes']},nr_inodes=4096,mode=0711".encode()
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    return bool(_libc.mount(b"tmpfs", directory.encode(), b"tmpfs", flags, options) == 0)


def _new_namespace(flag: int, name: str) -> int | None:
    """Move into a new namespace and keep a descriptor on it, so that a child can enter it
    later with one setns(); None where we may not create one."""
    if _libc.unshare(flag) != 0:
        return None
    return os.open(f"/proc/self/ns/{name}", os.O_RDONLY)


def _make_slot(index: int, config: dict[str, Any], root: bool, private: bool) -> tuple[_Slot, bool]:
    directory = os.path.join(config["root"], f"slot-{os.getpid()}-{index}")
    os.mkdir(directory, 0o711)
    disk = private and _mount_tmpfs(directory, config)
    if not root:
        return _Slot(directory, None, None, None), disk
    uid = config["uid_base"] + os.getpid() * MAX_SLOTS + index
    netns = _new_namespace(_CLONE_NEWNET, "net")
    return _Slot(directory, uid, netns, _new_namespace(_CLONE_NEWIPC, "ipc")), disk


def _rehearse(channel: dict[str, int]) -> None:
    """Run the harness's harmless steps here a few times (encode test values, flush the
    streams), so that every child finds their method lookups cached and their bytecode
    specialised, instead of writing both again on pages the fork made it copy."""
    for value in (0, -1.5, "x", [1, "2"], {"k": (3, None)}, True):
        for _ in range(4):
            _value_line(0, value, channel)
    for _ in range(4):
        for stream in (sys.stdout, sys.stderr):
            stream.flush()


def _rlimits(limits: dict[str, int]) -> list[tuple[int, tuple[int, int]]]:
    """Every child's resource limits, built once so that a child only makes the calls."""
    cpu = int(limits["cpu_s"])
    return [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"])),
        (resource.RLIMIT_FSIZE, (limits["file_size_bytes"], limits["file_size_bytes"])),
        (resource.RLIMIT_NOFILE, (limits["open_files"], limits["open_files"])),
        (resource.RLIMIT_NPROC, (limits["processes"], limits["processes"])),
        (resource.RLIMIT_CORE, (0, 0)),
    ]


def _isolate_once(config: dict[str, Any]) -> tuple[dict[str, str], list[_Slot]]:
    """Apply the server-wide isolation and make the slots; returns what really applied, for
    every result, and the slots."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    root = os.geteuid() == 0
    config["chroot"] = root
    config["devnull"] = os.open("/dev/null", os.O_RDONLY)  # opened once: a child just dup2s it
    config["rlimits"] = _rlimits(config["limits"])
    private = root and _private_mounts()
    # Slot 0 last: the server stays in its namespaces, so a request of one (`run`) needs no
    # setns at all.
    made = [_make_slot(i, config, root, private) for i in reversed(range(config["slots"]))]
    made.reverse()
    slots = [slot for slot, _ in made]
    slots[0].entered = True
    disk = all(mounted for _, mounted in made)
    _install_preloaded(ALLOWED_MODULES)
    _rehearse(config["channel"])
    gc.collect()
    gc.freeze()
    mib = config["limits"]["disk_bytes"] // (1024 * 1024)
    netns = all(slot.netns is not None for slot in slots)
    ipcns = all(slot.ipcns is not None for slot in slots)
    uids = [slot.uid for slot in slots if slot.uid is not None]
    return {
        "network": "network namespace per slot (no interfaces up)"
        if netns
        else "python-level socket block (weak: no namespace permitted)",
        "ipc": "IPC namespace per slot" if ipcns else "the machine's (System V IPC is shared)",
        "filesystem": "chroot into the episode directory"
        if root
        else "none (not root): the episode runs as the pool's user",
        "disk": f"private {mib} MiB tmpfs (noexec) per slot in a mount namespace"
        if disk
        else "shared temp directory (no quota: only RLIMIT_FSIZE per file)",
        "user": f"a uid per slot ({uids[0]}-{uids[-1]})"
        if uids
        else f"uid {os.geteuid()} (could not drop)",
        "processes": f"RLIMIT_NPROC={config['limits']['processes']} for a uid of its own"
        if root
        else "RLIMIT_NPROC on the shared user (weak)",
    }, slots


def serve(config: dict[str, Any]) -> None:
    isolation, slots = _isolate_once(config)
    uids = [slot.uid for slot in slots if slot.uid is not None]
    write_frame(1, {"ready": True, "pid": os.getpid(), "uids": uids, "isolation": isolation})
    while True:
        request = read_frame(0)
        if request is None:
            return
        write_frame(1, {"results": _run_batch(request["episodes"], slots, config)})


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
