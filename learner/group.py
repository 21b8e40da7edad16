"""A learner group: the learner ranks of one job joined in a torch.distributed process group.

Every rank trains on its own share of fragments; how the ranks hold the model (replicated by
DDP, sharded by FSDP2) is learner/parallel.py's, on the process group this module forms. Every
rank publishes weights to its own rollout actors; rank 0 leads the checkpoints. Rank, world size and
the rendezvous address come from whoever starts the process (the embedded run or a node daemon),
as `GroupSpec` arguments or `SHOAL_GROUP_*` environment variables. A group that lost a rank is not
repaired in place: its processes are replaced and the new group resumes from a checkpoint.

The rendezvous port is fixed for a job, so a replaced group can meet its predecessor there: the
old rank 0 may still hold the port while it checkpoints and exits. Rank 0 therefore retries
while the port is in use, a joining rank retries when the store it reached goes away, and
every incarnation meets under its own store prefix (its `epoch`, the task generation the node
daemon hands it) so a new rank never mistakes the old group's keys for its peers'. An epoch
can repeat (a restarted node daemon reruns its tasks at the generations they had), so a
joining rank also claims its rank in the store: a store where it was claimed before is an
old group's, let go like one that went away.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, NoReturn, Protocol

import torch
import torch.distributed as dist

from shoal.errors import ConfigError
from shoal.learner.errors import LearnerError

Backend = Literal["auto", "gloo", "nccl"]
RETRY_PAUSE_S = 0.1
LISTEN_POLL_S = 0.02
RETRY_LOG_EVERY_S = 5.0
log = logging.getLogger(__name__)


class GroupError(LearnerError):
    """The learner group could not form, or a collective failed because a rank is gone."""


@dataclass(frozen=True)
class GroupSpec:
    """Where and as whom this process joins its learner group."""

    rank: int = 0
    world_size: int = 1
    addr: str = "127.0.0.1"
    port: int = 0
    backend: Backend = "auto"
    timeout_s: float = 60.0
    epoch: str = ""
    """This incarnation's name, the same on every rank of it (the task generation)."""
    retry_s: float = 60.0
    """How long to keep trying while the rendezvous address is busy with an old group."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"group world_size = {self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"group rank = {self.rank} must be in [0, {self.world_size - 1}] for world_size "
                f"{self.world_size}"
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError(
                f"group port = {self.port} must be a TCP port (1-65535), or 0 for one that rank "
                "0 picks and publishes"
            )
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"group backend = {self.backend!r}; valid: 'auto', 'gloo', 'nccl'")
        if self.timeout_s <= 0:
            raise ConfigError(f"group timeout_s = {self.timeout_s} must be > 0")
        if self.retry_s < 0:
            raise ConfigError(f"group retry_s = {self.retry_s} must be >= 0")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GroupSpec:
        """Read SHOAL_GROUP_RANK, _WORLD_SIZE, _ADDR, _PORT, _BACKEND (defaults: a group of one;
        the address defaults to SHOAL_NODE_HOST, where this host is reached; port 0: rank 0
        picks and publishes one); the epoch is SHOAL_TASK_GENERATION, which a node daemon
        sets for every task it starts."""
        env = os.environ if environ is None else environ

        def number(key: str, default: str) -> int:
            text = env.get(key, default)
            try:
                return int(text)
            except ValueError:
                raise ConfigError(f"{key} = {text!r} must be an integer") from None

        backend = env.get("SHOAL_GROUP_BACKEND", "auto")
        if backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"SHOAL_GROUP_BACKEND = {backend!r}; valid: auto, gloo, nccl")
        return cls(
            rank=number("SHOAL_GROUP_RANK", "0"),
            world_size=number("SHOAL_GROUP_WORLD_SIZE", "1"),
            addr=env.get("SHOAL_GROUP_ADDR") or env.get("SHOAL_NODE_HOST") or "127.0.0.1",
            port=number("SHOAL_GROUP_PORT", "0"),
            backend=backend,  # type: ignore[arg-type]
            epoch=env.get("SHOAL_TASK_GENERATION", ""),
        )

    def to_env(self) -> dict[str, str]:
        """The environment variables that make a child process join as this spec says."""
        env = {
            "SHOAL_GROUP_RANK": str(self.rank),
            "SHOAL_GROUP_WORLD_SIZE": str(self.world_size),
            "SHOAL_GROUP_BACKEND": self.backend,
        }
        if self.port:  # else rank 0 serves on its own host and publishes where
            env |= {"SHOAL_GROUP_ADDR": self.addr, "SHOAL_GROUP_PORT": str(self.port)}
        return env


class Rendezvous(Protocol):
    """How the ranks of a group whose port is not fixed (`GroupSpec.port == 0`) meet: rank 0
    serves its store on a free port of its host and announces it; the others look it up. The
    coordinator's task state carries it (learner/peers.py), so a group restarted on other hosts
    meets at rank 0's new address without anyone choosing ports in advance."""

    def announce(self, addr: str, port: int) -> None:
        """Rank 0: the store of this epoch is served at addr:port."""

    def locate(self, timeout_s: float) -> tuple[str, int]:
        """Other ranks: rank 0's store of this epoch (blocks; GroupError after `timeout_s`)."""


SIOCGIFADDR = 0x8915


def interface_of(address: str) -> str | None:
    """The name of this host's network interface whose IPv4 address is `address`, if any."""
    import fcntl
    import struct

    try:
        wanted = socket.inet_aton(address)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
            except OSError:
                continue
            if answer[20:24] == wanted:
                return name
    return None


def bind_collectives_to(address: str) -> None:
    """Make gloo's and NCCL's own sockets use the interface that holds `address` (where this
    node is reached), unless the operator chose one (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME).
    Left to themselves they resolve the host name, which on a host with several networks (or
    none in DNS) names an address the peers cannot reach, or waits out a resolver first."""
    name = interface_of(address)
    if name is None:
        return
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(variable, name)


def resolve_backend(backend: Backend) -> Literal["gloo", "nccl"]:
    """NCCL where CUDA is there, gloo on CPUs; an explicit choice is checked, not overridden."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise GroupError(
            "backend 'nccl' needs CUDA, which this machine lacks; use 'gloo' or 'auto'"
        )
    return backend


def assign(actor_ids: Sequence[str], world_size: int) -> list[list[str]]:
    """Split rollout actors across ranks round-robin, in the given order (each rank's share)."""
    if world_size < 1:
        raise GroupError(f"world_size must be >= 1, got {world_size}")
    return [list(actor_ids[rank::world_size]) for rank in range(world_size)]


class LearnerGroup:
    """This process's membership in the group; a group of one needs no torch.distributed at all.

    Call from the thread that runs the PPO update: collectives block until every rank joins.
    """

    def __init__(self, spec: GroupSpec, rendezvous: Rendezvous | None = None) -> None:
        if spec.world_size > 1 and spec.port == 0 and rendezvous is None:
            raise ConfigError(
                "a group of more than one rank needs a rendezvous port (SHOAL_GROUP_PORT) or a "
                "node daemon to publish rank 0's through the coordinators"
            )
        self.spec = spec
        self.backend = resolve_backend(spec.backend)
        self.rendezvous = rendezvous if spec.port == 0 else None
        self._addr, self._port = spec.addr, spec.port
        self._joined = False

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def is_leader(self) -> bool:
        return self.spec.rank == 0

    def __repr__(self) -> str:
        state = "joined" if self._joined else "not joined"
        return f"<LearnerGroup rank={self.rank}/{self.world_size} {self.backend} {state}>"

    def join(self) -> None:
        """Rendezvous with the other ranks (blocks until all have joined or the timeout passes)."""
        if self.world_size == 1 or self._joined:
            return
        timeout = timedelta(seconds=self.spec.timeout_s)
        store = self._store(timeout)
        bind_collectives_to(self.spec.addr)
        try:
            dist.init_process_group(
                backend=self.backend,
                store=dist.PrefixStore(f"shoal/{self.spec.epoch}/", store),
                rank=self.rank,
                world_size=self.world_size,
                timeout=timeout,
            )
        except (RuntimeError, ValueError) as exc:
            raise GroupError(
                f"rank {self.rank} could not join the group at {self._where} within "
                f"{self.spec.timeout_s:.0f} s: {exc}"
            ) from exc
        self._joined = True

    @property
    def _where(self) -> str:
        return f"{self._addr}:{self._port or '(published)'}"

    def _store(self, timeout: timedelta) -> dist.Store:
        """This incarnation's rendezvous store, retried for up to `retry_s` while the address
        is busy with an old group (before the process group exists: torch names a group by
        how many were created, so a retried `init_process_group` would not meet its peers)."""
        deadline = time.monotonic() + self.spec.retry_s
        logged = -math.inf
        while True:
            try:
                return self._store_once(timeout)
            except (RuntimeError, _OldGroupStore) as exc:
                if not _transient(exc):
                    raise GroupError(
                        f"rank {self.rank} could not join the group at {self._where}: its store "
                        f"did not answer within {self.spec.timeout_s:.0f} s: {exc}"
                    ) from exc
                if time.monotonic() >= deadline:
                    raise GroupError(
                        f"rank {self.rank} could not join the group at {self._where}: the "
                        f"address stayed busy for {self.spec.retry_s:.0f} s ({exc}); is another "
                        "job using that rendezvous port?"
                    ) from exc
                if time.monotonic() >= logged + RETRY_LOG_EVERY_S:
                    logged = time.monotonic()
                    log.info(
                        "rank %d: rendezvous at %s busy (%s); retrying", self.rank, self._where, exc
                    )
                time.sleep(RETRY_PAUSE_S)

    def _store_once(self, timeout: timedelta) -> dist.Store:
        """Rank 0 serves the store and marks it this epoch's; the others connect, wait for
        that mark and claim their rank in it. A store still served by an old rank 0 is never
        taken for the new one: one of another epoch never gets the mark (it closes under the
        waiting rank instead, a transient error), and one of the same epoch (a node daemon
        restarted before its node was declared dead runs its tasks again at the generation
        they had) already has the rank claimed by the old group's member."""
        if self.rank != 0 and self.rendezvous is not None:
            self._reach_published(self.rendezvous, timeout.total_seconds())
        elif self.rank != 0:
            _wait_listening(self._addr, self._port, timeout.total_seconds())
        store = dist.TCPStore(
            self._addr,
            self._port,
            self.world_size,
            self.rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        prefix = f"shoal/{self.spec.epoch}"
        if self.rank == 0:
            store.set(f"{prefix}/ready", "1")
            if self.rendezvous is not None:
                self.rendezvous.announce(self._addr, store.port)
            return store
        store.wait([f"{prefix}/ready"])
        claims = store.add(f"{prefix}/rank{self.rank}", 1)
        if claims != 1:
            raise _OldGroupStore(
                f"the store there belongs to an older group of epoch {self.spec.epoch!r}: "
                f"rank {self.rank} joined it {claims - 1} time(s) before"
            )
        return store

    def _reach_published(self, rendezvous: Rendezvous, limit_s: float) -> None:
        """Find rank 0's store where it published it, looking again while nothing answers
        there: a rank 0 restarted at the same epoch (its node daemon came back before the
        node was declared dead) publishes a new port, and until it does the old rank 0's
        address is what this epoch shows."""
        deadline = time.monotonic() + limit_s
        while True:
            left = max(deadline - time.monotonic(), LISTEN_POLL_S)
            self._addr, self._port = rendezvous.locate(left)
            try:
                socket.create_connection((self._addr, self._port), timeout=1.0).close()
                return
            except OSError:
                if time.monotonic() >= deadline:
                    raise GroupError(
                        f"rank {self.rank}: nothing answers at {self._where}, where rank 0 of "
                        f"epoch {self.spec.epoch!r} published its store, after {limit_s:.0f} s"
                    ) from None
                time.sleep(LISTEN_POLL_S * 5)

    def leave(self) -> None:
        """Destroy the process group. Its gloo worker threads may still be releasing the last
        collective's tensors afterwards, so a rank ends its process with `exit_after_group`."""
        if self._joined:
            dist.destroy_process_group()
            self._joined = False

    def all_gather(self, value: object) -> list[object]:
        """Every rank's `value`, in rank order (a collective; [value] in a group of one)."""
        if self.world_size == 1:
            return [value]
        parts: list[object] = [None] * self.world_size
        self._collective(lambda: dist.all_gather_object(parts, value))
        return parts

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of `value` over the ranks (PPO's `kl_sync`: every rank stops at the same
        epoch); `value` itself in a group of one."""
        if self.world_size == 1:
            return value
        total = value.detach().clone()
        self._collective(lambda: dist.all_reduce(total, op=dist.ReduceOp.SUM))
        return total / self.world_size

    def total(self, count: int) -> int:
        """The sum of `count` over the ranks (every rank gets the same number)."""
        if self.world_size == 1:
            return count
        value = torch.tensor([count], dtype=torch.int64, device=self._device)
        self._collective(lambda: dist.all_reduce(value, op=dist.ReduceOp.SUM))
        return int(value.item())

    def all_agree(self, flag: bool) -> bool:
        """True on every rank if `flag` is True on any rank (e.g. "stop now")."""
        if self.world_size == 1:
            return flag
        value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self._device)
        self._collective(lambda: dist.all_reduce(value, op=dist.ReduceOp.MAX))
        return bool(value.item())

    @property
    def _device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def _collective(self, call: Callable[[], object]) -> None:
        if not self._joined:
            raise GroupError("join() the group before any collective")
        try:
            call()
        except RuntimeError as exc:
            raise GroupError(
                f"collective on rank {self.rank} failed (a peer rank is probably gone): {exc}"
            ) from exc


def _wait_listening(addr: str, port: int, limit_s: float) -> None:
    """Return once something accepts connections at addr:port (or after `limit_s`; the store's
    own connect then fails with its time-out). torch's store client retries a refused connect
    with growing pauses, so a rank that started before its rank 0 served the store met it up
    to 2 s late; a plain connect every LISTEN_POLL_S costs nothing."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((addr, port), timeout=LISTEN_POLL_S * 10).close()
            return
        except OSError:
            time.sleep(LISTEN_POLL_S)


class _OldGroupStore(Exception):
    """The store reached is an older incarnation's of the same epoch (its rank 0 is exiting)."""


def _transient(exc: BaseException) -> bool:
    """An error worth another try: the port is still bound, or the store we reached is an old
    group's (it went away, or it is still there). A time-out is not: peers that never came
    will not come sooner."""
    if isinstance(exc, _OldGroupStore):
        return True
    text = str(exc).lower()
    return isinstance(exc, dist.DistNetworkError) and "timed out" not in text


def exit_after_group(code: int) -> NoReturn:
    """End a process that used torch.distributed, with `code`, without finalizing Python.

    A gloo worker thread drops its reference to a finished collective after the caller's
    `wait` returned, so it can free the last reference to a tensor Python saw a moment later,
    and that takes the GIL. If the interpreter is finalizing by then, the thread is ended with
    `pthread_exit`, whose unwinding through a noexcept destructor calls std::terminate: the
    process dies of SIGABRT ("terminate called without an active exception") after all its
    work was done and written, and its node would report the rank failed. Under load it
    happened to rank 0 of a two-rank test group, once in a full suite, twice in all. Exiting
    with `os._exit` skips finalization; what finalization would have done that matters here,
    flushing logs and standard streams, is done first.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
