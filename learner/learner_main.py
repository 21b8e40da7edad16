"""A learner rank process: the shell around its training core (learner/trainer.py).

`python -m shoal.learner.learner_main --job JSON --port PORT` with the group's rank, world size
and rendezvous in `SHOAL_GROUP_*` (see group.py). The process serves one actor, `learner`, on
the real transport: rollout actors `register` with it (the current version's weights follow in
buckets, learner/weight_sync.py) and `push_fragment` to it. Training runs beside the actor: it
waits for a batch of fragments, runs the PPO update in a worker thread (so the event loop keeps
receiving fragments meanwhile), advances the policy version and streams the new weights to every
registered rollout actor. Every rank publishes to the actors that push to it, and every rank
writes its shards of each checkpoint (rank 0 the trainer state and the manifest). Each rank writes
`status-<rank>.json` (progress for `shoal train`) and appends to `events.jsonl`. A full disk
does not stop a rank: failed checkpoint writes are counted, the journal holds its lines until
there is room, and a status, ledger snapshot or checkpoint event that finds no room is skipped
(learner/diskfull.py).

Accounting across restarts: each rank writes `accounting/learner-<rank>-<incarnation>.json`
(the intake's ledger of sequence numbers, at most every LEDGER_EVERY_S and when it stops) and
appends each fragment's admission and fate to `learner-<rank>-<incarnation>.jsonl` as they
happen (learner/journal.py: a SIGKILL loses none, unless the disk is full), and
every checkpoint carries `trained_ranges`, per actor the sequence numbers trained on by every
rank up to it (the resumed checkpoint's plus what the ranks gathered at save time).

SIGUSR1 asks for a checkpoint on demand (the group writes it after the current update).
SIGTERM or SIGINT stops it gracefully: the current update finishes, the ranks agree to stop
after the same update, the group writes a final checkpoint, and the process exits 0. On start,
every rank resumes from the newest complete checkpoint in the run directory, if there is one,
read once the group has formed (see `LearnerCore.restore`). A rank's transport port and the
group's rendezvous port are fixed per job, so a rank started while its previous incarnation
is still exiting waits for them (up to `GroupSpec.retry_s`) instead of failing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from shoal.errors import ConfigError
from shoal.files import write_json_atomically
from shoal.learner.config import TrainConfig
from shoal.learner.diskfull import unless_disk_full
from shoal.learner.errors import BadFragment, LearnerError, PolicyError, RegistrationRefused
from shoal.learner.events import append_event
from shoal.learner.group import GroupError, GroupSpec, LearnerGroup, exit_after_group
from shoal.learner.job_metrics import MetricsTarget, post_forever, post_once
from shoal.learner.parallel import ParallelError
from shoal.learner.peers import LEARNER_NAME, LEARNER_ROLE, Publication, PublishedRendezvous
from shoal.learner.sequences import AnyFragment, fragment_from_wire
from shoal.learner.trainer import LearnerCore
from shoal.rundir import RunDir
from shoal.runtime.actor import Actor
from shoal.runtime.errors import ActorError, WireError
from shoal.runtime.ref import ActorRef
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import Transport, TransportConfig

log = logging.getLogger("shoal.learner")

STATUS_EVERY_S = 0.25
LEDGER_EVERY_S = 1.0
LISTEN_RETRY_PAUSE_S = 0.1
LISTEN_LOG_EVERY_S = 5.0
READY_POLL_S = 0.002
PEER_STOPPED_EXIT = 3
CLOSE_LIMIT_S = 1.0
MAX_ACTOR_CHARS = 1024
UNFIXABLE = (ParallelError, PolicyError, ConfigError)


class LearnerActor(Actor):
    """The rank's face on the transport; state lives in the core, so a restart loses nothing."""

    def __init__(self, core: LearnerCore) -> None:
        self.core = core
        lm = getattr(core.policy, "lm", None)
        self.vocab_size: int | None = None if lm is None else int(lm.config.vocab_size)
        """A causal LM's vocabulary: a sequence fragment's ids must be below it."""

    async def register(self, actor_id: str, path: str) -> dict[str, Any]:
        """A rollout actor announces itself; it gets this rank's incarnation, the current
        version and the weights' source, and the current weights follow: this rank's part, and
        each other part from the peer that publishes it (subscribed here on the actor's
        behalf). A malformed request, or a peer that cannot be told, gets `error` instead,
        and the actor registers again."""
        core = self.core
        try:
            ref = self._rollout_ref(actor_id, path)
            for peer in core.publishers:
                await self.context.system.ref(peer).tell.subscribe(actor_id, path)
        except (RegistrationRefused, ActorError, WireError) as exc:
            log.warning("refused the registration of %.100r: %s", actor_id, exc)
            return {"incarnation": core.incarnation, "error": str(exc)}
        core.actors[actor_id] = ref
        core.weights.add(actor_id, ref)
        return {
            "incarnation": core.incarnation,
            "version": core.version,
            "source": core.weights.source,
        }

    def subscribe(self, actor_id: str, path: str) -> None:
        """A peer rank's rollout actor wants this rank's weight part too (see `register`)."""
        try:
            self.core.weights.add(actor_id, self._rollout_ref(actor_id, path))
        except (RegistrationRefused, ActorError) as exc:
            log.warning("refused a subscription to this rank's weights: %s", exc)

    def _rollout_ref(self, actor_id: object, path: object) -> ActorRef:
        """The ref of a rollout actor from its id and path as it sent them."""
        for what, value in (("actor id", actor_id), ("path", path)):
            if not isinstance(value, str) or not 0 < len(value) <= MAX_ACTOR_CHARS:
                raise RegistrationRefused(
                    f"a rollout actor's {what} is 1 to {MAX_ACTOR_CHARS} characters"
                )
        return self.context.system.ref(str(path))

    async def push_fragment(self, payload: Any) -> dict[str, Any]:
        """Take one fragment; the reply waits while the intake is full (back-pressure)."""
        core = self.core
        if core.closed:
            return {"incarnation": core.incarnation, "admission": "closed", "registered": False}
        try:
            fragment = fragment_from_wire(payload, self.vocab_size)
        except BadFragment as exc:
            core.rejected += 1
            log.warning("rejected a fragment: %s", exc)
            return {"incarnation": core.incarnation, "admission": "rejected", "error": str(exc)}
        core.record(fragment)
        admission = await core.intake.put(fragment)
        registered = core.weights.serves(fragment.actor_id)
        return {
            "incarnation": core.incarnation,
            "admission": admission.value,
            "registered": registered,
        }

    def ping(self) -> None:
        """A waiting rollout actor's check that its link to this rank stands (rollout.py)."""

    def status(self) -> dict[str, Any]:
        return self.core.status()


async def _next_batch(core: LearnerCore, stopping: asyncio.Event) -> list[AnyFragment] | None:
    """The next batch of fragments, or None if a stop was requested while waiting."""
    get = asyncio.ensure_future(core.intake.get(core.cfg.intake.fragments_per_update))
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if get.done():
        return get.result()
    get.cancel()
    await asyncio.gather(get, return_exceptions=True)
    return None


async def _batch_ready(core: LearnerCore, stopping: asyncio.Event) -> bool:
    """Wait until a batch is queued (True) or a stop was requested first (False), taking
    nothing: a rank must not take fragments (which counts them trained) its group may not
    train. Polled, since the intake signals only to whoever takes."""
    count = core.cfg.intake.fragments_per_update
    while len(core.intake) < count:
        if stopping.is_set():
            return False
        await asyncio.sleep(READY_POLL_S)
    return not stopping.is_set()


async def _group_batch(core: LearnerCore, stopping: asyncio.Event) -> list[AnyFragment] | None:
    """The next batch of a rank in a group, or None when the group stops before this update.

    Every update of a group starts with one agreement: a rank asked to stop before it has a
    batch says so and the whole group stops here, with nothing taken. Without it, a stopping
    rank would have to wait for fragments that may never come (a cluster stops the rollout
    workers with the learners) while its peers wait in the update's all-reduce."""
    ready = await _batch_ready(core, stopping)
    if await asyncio.to_thread(core.group.all_agree, not ready):
        return None
    return await core.intake.get(core.cfg.intake.fragments_per_update)


class CheckpointEvents:
    """Rank 0's `checkpoint` events, each written only once its checkpoint is complete
    (manifest published): readers (`shoal train`, the chaos checks) take an event as "this
    step can be resumed from". A save only starts an asynchronous write, completed by the time
    the next save (or the final one) returns, so the event follows then."""

    def __init__(self, core: LearnerCore) -> None:
        self.core = core
        self.reasons: dict[int, str] = {}
        self.announced = -1

    def started(self, step: int, reason: str) -> None:
        self.reasons[step] = reason

    def announce(self) -> None:
        done = self.core.checkpoints.last_complete
        if not self.core.group.is_leader or done is None or done.step <= self.announced:
            return
        self.announced = done.step
        reason = self.reasons.get(done.step, "periodic")
        self.reasons = {s: r for s, r in self.reasons.items() if s > done.step}
        event = {"event": "checkpoint", "step": done.step, "reason": reason}
        unless_disk_full("a checkpoint event", partial(append_event, self.core.run_dir, event))


async def train(core: LearnerCore, stopping: asyncio.Event, events: CheckpointEvents) -> None:
    """The rank's training loop; returns after the update at which the group agreed to stop
    (or, in a group, before the update at which a rank had no batch when asked to stop)."""
    last_status = last_ledger = 0.0
    while True:
        if core.group.world_size == 1:
            fragments = None if stopping.is_set() else await _next_batch(core, stopping)
        else:
            fragments = await _group_batch(core, stopping)
        if fragments is None:
            return
        agreed, checkpoint = await asyncio.to_thread(core.train_step, fragments, stopping.is_set())
        await core.advance()
        core.mark("trained")
        if checkpoint:
            trained = await asyncio.to_thread(core.gather_trained)
            reason = "on demand" if core.checkpoint_requested else "periodic"
            core.checkpoint_requested = False
            events.started(core.version, reason)
            await asyncio.to_thread(core.save_checkpoint, trained)
            events.announce()
        now = time.monotonic()
        if now - last_ledger >= LEDGER_EVERY_S:
            last_ledger = now
            unless_disk_full("the ledger snapshot", core.write_ledger)
        if now - last_status >= STATUS_EVERY_S:
            last_status = now
            write = partial(RunDir(core.run_dir).write_status, core.group.rank, core.status())
            unless_disk_full("the status", write)
        core.publish_progress()
        if agreed:
            return


async def serve(
    cfg: TrainConfig,
    env_id: str,
    run_dir: Path,
    listen_at: tuple[str, int],
    spec: GroupSpec,
    token: str,
    metrics: MetricsTarget | None = None,
) -> int:
    """Run one rank until it is told to stop; returns the exit status. It listens at
    `listen_at` (host, port; port 0 picks one) and publishes that address as its task state,
    rank 0 its group's rendezvous too (learner/peers.py). Rank 0 posts `job_metrics` events to
    `metrics`' coordinators meanwhile, when given."""
    torch.set_num_threads(cfg.learner.threads)
    publication = Publication(
        role=LEARNER_ROLE,
        rank=spec.rank,
        epoch=spec.epoch,
        gpus=os.environ.get("SHOAL_TASK_GPUS", ""),  # what its node handed it, for all to see
    )
    group = LearnerGroup(spec, PublishedRendezvous(publication, spec.epoch))
    with published_if_unfixable(publication, spec.rank):
        core = LearnerCore(cfg, env_id, group, run_dir, publication)
    core.mark("built")
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    loop.add_signal_handler(signal.SIGUSR1, core.request_checkpoint)
    async with ActorSystem(f"learner-{group.rank}") as system:
        host, port = listen_at
        config = TransportConfig(token=token, host=host, port=port)
        transport = await listen(system, config, spec.retry_s)
        publication.update(address=transport.address)
        core.mark("listening")
        try:
            if not await join_unless_stopped(group, stopping):
                log.info("rank %d: asked to stop before its group formed", group.rank)
                core.checkpoints.close()
                return 0
            core.mark("joined")
            with published_if_unfixable(publication, spec.rank):
                await asyncio.to_thread(core.shard)
            await asyncio.to_thread(core.meet, f"{transport.address}/{LEARNER_NAME}")
            resumed = await asyncio.to_thread(core.restore)
            core.mark("restored")
            await core.stream(core.version)
            core.mark("ready")
            await system.spawn(LearnerActor, core, name=LEARNER_NAME, mailbox_size=4096)
            write_json_atomically(
                RunDir(run_dir).address(group.rank), {"address": transport.address}, durable=False
            )
            append_event(
                run_dir,
                {
                    "event": "start",
                    "process": "learner",
                    "rank": group.rank,
                    "pid": os.getpid(),
                    "incarnation": core.incarnation,
                    "step": core.version,
                    "env_steps": core.env_steps,
                    "resumed_from": None if resumed is None else str(resumed.path),
                    "phases": core.phases,
                },
            )
            events = CheckpointEvents(core)
            poster = (
                asyncio.ensure_future(post_forever(metrics, core.status, cfg.target_window))
                if metrics is not None and group.is_leader
                else None
            )
            try:
                await train(core, stopping, events)
            finally:
                if poster is not None:
                    poster.cancel()
                    await asyncio.gather(poster, return_exceptions=True)
            if metrics is not None and group.is_leader:
                await post_once(metrics, core.status(), cfg.target_window)
            trained = await asyncio.to_thread(core.gather_trained)
            events.started(core.version, "final")
            await asyncio.to_thread(core.save_checkpoint, trained, True)
            events.announce()
            if group.is_leader:
                append_event(run_dir, {"event": "stop", "rank": group.rank, "step": core.version})
            RunDir(run_dir).write_status(group.rank, core.status())
            core.publish_progress(final=True)
            core.write_ledger(final=True)
        except GroupError as exc:
            log.error("rank %d: the group broke (%s); leaving", group.rank, exc)
            raise
        finally:
            await core.weights.close()
            await close_transport(transport)
    core.checkpoints.close()
    group.leave()
    if stopping.is_set():
        return 0
    # Not asked to stop: a peer was (its node went away, say). Exiting non-zero makes the
    # node report this rank failed, so the leader restarts the group instead of leaving it
    # half stopped.
    print(
        f"shoal-learner: rank {group.rank} stopped with its group because a peer rank was "
        "asked to stop; this rank was not",
        file=sys.stderr,
    )
    return PEER_STOPPED_EXIT


@contextlib.contextmanager
def published_if_unfixable(publication: Publication, rank: int) -> Iterator[None]:
    """An error no restart of the group can fix (a model that does not fit the ranks' memory,
    a model directory that does not hold the LM, a bad setting) is published as the task's
    `error`, which ends the job at once with it, instead of five restarts of the same
    refusal; then it is raised, as any other error."""
    try:
        yield
    except UNFIXABLE as exc:
        publication.fail(f"learner rank {rank}: {exc}")
        raise


async def join_unless_stopped(group: LearnerGroup, stopping: asyncio.Event) -> bool:
    """Join the group; False if the rank is asked to stop first. A rank whose peer died while
    the group formed waits in the rendezvous for the group's time-out (60 s), and the node
    that stops it for the next incarnation SIGKILLs it only after its stop timeout (20 s).
    Nothing is lost by leaving then: the rank has not resumed or trained. The join runs in a
    daemon thread, which the process does not wait for when it exits (an executor's would)."""
    loop = asyncio.get_running_loop()
    joined: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if joined.done():
            return
        if error is None:
            joined.set_result(None)
        else:
            joined.set_exception(error)

    def join() -> None:
        error: BaseException | None = None
        try:
            group.join()
        except BaseException as exc:  # handed to the loop, raised there
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed: the rank left without us
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=join, name=f"join-rank-{group.rank}", daemon=True).start()
    stop: asyncio.Future[Any] = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait([joined, stop], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if joined.done():
        joined.result()
        return True
    return False


async def close_transport(transport: Transport) -> None:
    """Close the links, waiting at most CLOSE_LIMIT_S: by now the rank has nothing left to
    say (its final checkpoint and ledger are written, or its group broke), and its node
    starts the group's next incarnation only once this process is gone. A rollout actor
    that reconnects while the links close leaves a handshake that the transport's close
    would otherwise wait out (5 s, its handshake timeout)."""
    try:
        await asyncio.wait_for(transport.close(), CLOSE_LIMIT_S)
    except TimeoutError:
        log.info("the transport did not close within %.1f s; exiting anyway", CLOSE_LIMIT_S)


async def listen(system: ActorSystem, config: TransportConfig, retry_s: float) -> Transport:
    """Attach the transport on its fixed port, retrying for up to `retry_s` while the port is
    in use: the previous incarnation of this rank may still be checkpointing on it."""
    from shoal.runtime.transport import attach

    deadline = time.monotonic() + retry_s
    logged = -math.inf
    while True:
        try:
            return await attach(system, config)
        except OSError as exc:
            busy = exc.errno == errno.EADDRINUSE and config.port != 0
            if busy and time.monotonic() < deadline:
                if time.monotonic() >= logged + LISTEN_LOG_EVERY_S:
                    logged = time.monotonic()
                    log.info("port %d in use (an old incarnation exiting?); retrying", config.port)
                await asyncio.sleep(LISTEN_RETRY_PAUSE_S)
                continue
            why = f"it stayed in use for {retry_s:.0f} s" if busy else str(exc)
            raise LearnerError(
                f"cannot listen on {config.host}:{config.port}: {why}; free the port or give "
                "the rank another one (--port)"
            ) from exc


def main(argv: list[str] | None = None) -> int:
    """Run one rank. A rank that ran to its end (checkpoints closed, group left) ends its
    process with `exit_after_group`, so a gloo thread cannot abort it as Python finalizes; one
    that failed returns 2 and exits normally, which lets a checkpoint still being written
    finish."""
    from shoal.errors import ShoalError
    from shoal.learner.job import add_task_arguments, listen_host, read_task
    from shoal.runtime.logs import configure_logging
    from shoal.runtime.loop import run

    parser = argparse.ArgumentParser(prog="shoal-learner", description="one learner rank")
    add_task_arguments(parser)
    parser.add_argument("--port", type=int, default=0, help="transport port (0: any free port)")
    args = parser.parse_args(argv)
    configure_logging(os.environ.get("SHOAL_LOG_LEVEL", "INFO"))
    try:
        task = read_task(args)
        entry = task.coordinator
        metrics = None if entry is None else MetricsTarget.from_job(entry)
        spec = GroupSpec.from_env()
        listen_at = (listen_host(), args.port)
        code = run(serve(task.cfg, task.env_id, task.run_dir, listen_at, spec, task.token, metrics))
    except (ShoalError, OSError) as exc:
        print(f"shoal-learner: error: {exc}", file=sys.stderr)
        return 2
    exit_after_group(code)


if __name__ == "__main__":
    sys.exit(main())
