"""A learner rank process: intake, PPO updates, gradient all-reduce, weight publishing, checkpoints.

`python -m shoal.learner.learner_main --run-dir DIR --port PORT` with the group's rank, world size
and rendezvous in `SHOAL_GROUP_*` (see group.py). The process serves one actor, `learner`, on
the real transport: rollout actors `register` with it (and get the current weights) and
`push_fragment` to it. Training runs beside the actor: it waits for a batch of fragments, runs
the PPO update in a worker thread (so the event loop keeps receiving fragments meanwhile),
advances the policy version and sends the new weights to every registered rollout actor. Every
rank publishes to the actors that push to it; rank 0 alone writes checkpoints. Each rank writes
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

SIGUSR1 asks for a checkpoint on demand (rank 0 writes it after the current update).
SIGTERM or SIGINT stops it gracefully: the current update finishes, the ranks agree to stop
after the same update, rank 0 writes a final checkpoint, and the process exits 0. On start,
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
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shoal.learner.buffer import Intake
from shoal.learner.checkpoint import CheckpointInfo, CheckpointManager
from shoal.learner.config import TrainConfig
from shoal.learner.diskfull import unless_disk_full
from shoal.learner.errors import BadFragment, LearnerError
from shoal.learner.fragment import Fragment
from shoal.learner.group import GroupError, GroupSpec, LearnerGroup
from shoal.learner.job import checkpoint_dir
from shoal.learner.job_metrics import MetricsTarget, loss_name, post_forever, post_once
from shoal.learner.journal import open_learner_journal
from shoal.learner.models import build_model
from shoal.learner.parallel import (
    Parallelized,
    ShardingOptions,
    full_tensor,
    parallelize,
    plan_parallelism,
    rank_memory_bytes,
    training_bytes,
)
from shoal.learner.peers import LEARNER_ROLE, Publication, PublishedRendezvous
from shoal.learner.ppo import PPOLearner
from shoal.learner.seqranges import SeqRanges, ranges_by_actor, ranges_json
from shoal.learner.train_state import model_optimizer_state, restore_model_optimizer
from shoal.learner.weight_sync import WeightBroadcaster, WeightSnapshot
from shoal.runtime.actor import Actor
from shoal.runtime.ref import ActorRef
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import Transport, TransportConfig
from shoal.task_exchange import write_json_atomically

log = logging.getLogger("shoal.learner")

LEARNER_NAME = "learner"
STATUS_EVERY_S = 0.25
PROGRESS_EVERY_S = 1.0
LEDGER_EVERY_S = 1.0
LISTEN_RETRY_PAUSE_S = 0.1
LISTEN_LOG_EVERY_S = 5.0
READY_POLL_S = 0.002
PEER_STOPPED_EXIT = 3
CLOSE_LIMIT_S = 1.0


class LearnerCore:
    """Everything one rank knows; the actor and the training loop share it on the loop thread.

    Only `train_step` (run in a worker thread) touches the model and optimiser while an update
    runs; the loop thread streams the weights of each version from a host snapshot taken
    between updates (`WeightBroadcaster`).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        env_id: str,
        group: LearnerGroup,
        run_dir: Path,
        publication: Publication | None = None,
    ) -> None:
        from shoal.envs.vector import make_vector

        self.cfg = cfg
        self.env_id = env_id
        self.group = group
        self.run_dir = run_dir
        probe = make_vector(env_id, 1, seed=cfg.seed, **cfg.env_kwargs)
        observation_space = probe.single_observation_space
        action_space = probe.single_action_space
        probe.close()
        torch.manual_seed(cfg.seed)  # every rank initialises identically (FSDP2 relies on it)
        self.device = _device(group)
        self.policy = build_model(cfg.model, observation_space, action_space).to(self.device)
        self.parallel: Parallelized | None = None
        self._ppo: PPOLearner | None = None
        self.incarnation = os.urandom(6).hex()
        self.weights = WeightBroadcaster(cfg.weight_sync, source=self.incarnation)
        self.journal = open_learner_journal(run_dir / "accounting", group.rank, self.incarnation)
        self.intake = Intake(cfg.intake.capacity, cfg.intake.max_staleness, self.journal)
        self.intake.set_lineage(self.incarnation, 0)
        self.checkpoints = CheckpointManager(checkpoint_dir(cfg, run_dir), keep=cfg.checkpoint.keep)
        self.publication = publication or Publication()
        self._progress_at = -math.inf
        self.schedule = self.checkpoints.periodic(cfg.checkpoint.interval_s)
        self.version = 0
        self.env_steps = 0  # steps received from actors (before any filtering)
        self.trained_steps = 0
        self.base_env_steps = 0  # env_steps restored from a checkpoint
        self.rejected = 0
        self.episodes = 0
        self.returns: deque[float] = deque(maxlen=cfg.target_window)
        self.actors: dict[str, ActorRef] = {}
        self.metrics: dict[str, float] = {}
        self.resumed_from: CheckpointInfo | None = None
        self.base_ranges: dict[str, SeqRanges] = {}
        self.checkpoint_requested = False
        self.closed = False  # the final ledger is written: later pushes are refused, not counted
        self.started = time.monotonic()
        self.phases: dict[str, float] = {"process": process_started_at()}
        """Wall-clock times (epoch seconds) of this incarnation's start-up steps: where a
        restart's seconds go (docs/training.md). Written to the start event and the status."""

    # -- the model across the group -------------------------------------------------------------

    def shard(self) -> None:
        """Hold the model as the group's placement allows (a collective: after `join`).
        Every rank reports its island; the plan is the same on all of them."""
        island = os.environ.get("SHOAL_TASK_ISLAND") or socket.gethostname()
        islands = [str(i) for i in self.group.all_gather(island)]
        memory = rank_memory_bytes(self.device, islands.count(island))
        learner = self.cfg.learner
        plan = plan_parallelism(learner.sharding, islands, training_bytes(self.policy), memory)
        log.info("rank %d holds the model as %s: %s", self.group.rank, plan.strategy, plan.reason)
        options = ShardingOptions(
            mixed_precision=learner.mixed_precision,
            cpu_offload=learner.cpu_offload,
            activation_checkpointing=learner.activation_checkpointing,
        )
        self.parallel = parallelize(self.policy, plan, self.device, options)
        self._ppo = PPOLearner(
            self.parallel.module, self.cfg.ppo, self.policy, self.parallel.forward_context
        )

    @property
    def ppo(self) -> PPOLearner:
        if self._ppo is None:
            raise LearnerError("shard() the model across the group before training")
        return self._ppo

    # -- checkpoints -------------------------------------------------------------------------

    def restore(self) -> CheckpointInfo | None:
        """Load the newest complete checkpoint, if any, into the model and the built optimiser.
        `serve` calls it once the group has formed: by then the previous incarnation's rank 0
        has released the group's address, so its final checkpoint is complete and every rank
        of the new group reads the same one."""
        info = self._agreed_checkpoint()
        if info is None:
            return None
        trainer = self.checkpoints.load_trainer(info)
        restore_model_optimizer(self.ppo.model, self.ppo.optimizer, self.checkpoints, info)
        self.version = int(trainer["version"])
        if self.group.is_leader:  # the group's totals; the other ranks count from 0 on top
            self.env_steps = self.base_env_steps = int(trainer["env_steps"])
            self.trained_steps = int(trainer["trained_steps"])
            self.episodes = int(trainer["episodes"])
            self.returns.extend(float(r) for r in trainer["returns"])
        self.base_ranges = ranges_by_actor(trainer.get("trained_ranges", {}))
        self.journal.append({"resumed_from": str(info.path), "base": ranges_json(self.base_ranges)})
        self.intake.set_version(self.version)
        self.intake.set_lineage(self.incarnation, self.version)
        self.resumed_from = info
        return info

    def _agreed_checkpoint(self) -> CheckpointInfo | None:
        """Rank 0's newest complete checkpoint, which every rank then loads (a collective
        load of different checkpoints would mix them). A rank that cannot see it (storage
        not yet consistent on its host) fails the group's start rather than diverge."""
        mine = self.checkpoints.latest()
        step = self.group.all_gather(None if mine is None else mine.step)[0]
        if step is None:
            return None
        if mine is not None and mine.step == step:
            return mine
        found = next((c for c in self.checkpoints.list_complete() if c.step == step), None)
        if found is None:
            raise LearnerError(
                f"rank {self.group.rank} cannot find checkpoint step {step}, which rank 0 "
                f"resumes from, in {self.checkpoints.directory}: is checkpoint.storage mounted "
                "on every host?"
            )
        return found

    def request_checkpoint(self) -> None:
        """On demand (SIGUSR1): rank 0 saves after the update in progress."""
        self.checkpoint_requested = True

    def gather_trained(self) -> dict[str, SeqRanges]:
        """Every rank's trained sequence numbers merged with the resumed checkpoint's: what a
        checkpoint saved now holds. A collective: every rank calls it after the same update."""
        parts = self.group.all_gather(ranges_json(self.intake.trained_seqs))
        merged = {actor: SeqRanges(r.to_json()) for actor, r in self.base_ranges.items()}
        for part in parts:
            for actor, ranges in ranges_by_actor(part).items():
                merged.setdefault(actor, SeqRanges()).update(ranges)
        return merged

    def ledger(self, final: bool) -> dict[str, Any]:
        """This incarnation's record for the chaos checker (`fragment_ledger`)."""
        return {
            "rank": self.group.rank,
            "incarnation": self.incarnation,
            "final": final,
            "resumed_from": None if self.resumed_from is None else str(self.resumed_from.path),
            "base": ranges_json(self.base_ranges),
            **self.intake.ledger(),
        }

    def write_ledger(self, final: bool = False) -> None:
        self.closed = final
        folder = self.run_dir / "accounting"
        folder.mkdir(exist_ok=True)
        name = f"learner-{self.group.rank}-{self.incarnation}.json"
        write_json_atomically(folder / name, self.ledger(final))

    def save_checkpoint(self, trained: dict[str, SeqRanges], block: bool = False) -> None:
        """Every rank writes its shards (a collective); rank 0 the trainer state and, once
        all are written, the manifest that makes the checkpoint complete. The step and
        episode counts are the group's: each rank counts its own actors'."""
        mine = (self.env_steps, self.trained_steps, self.episodes)
        env_steps, trained_steps, episodes = (self.group.total(n) for n in mine)
        trainer = {
            "policy_spec": self.policy.spec(),
            "version": self.version,
            "env_steps": env_steps,
            "trained_steps": trained_steps,
            "episodes": episodes,
            "returns": list(self.returns),
            "config": asdict(self.cfg),
            "env_id": self.env_id,
            "trained_ranges": ranges_json(trained),
        }
        meta: dict[str, str | int | float | bool] = {
            "env_id": self.env_id,
            "version": self.version,
            "env_steps": env_steps,
        }
        if self.returns:
            meta["mean_return"] = float(np.mean(self.returns))
        tensors = model_optimizer_state(self.ppo.model, self.ppo.optimizer)
        self.checkpoints.save(tensors, self.version, trainer, meta=meta, block=block)
        self.schedule.mark_saved()

    @property
    def complete_checkpoint(self) -> CheckpointInfo | None:
        """The newest checkpoint known to be whole on disk, the only one the status may name: a
        save only starts a write, which a full disk can still fail."""
        return self.checkpoints.last_complete or self.resumed_from

    # -- intake side (loop thread) -----------------------------------------------------------

    def record(self, fragment: Fragment) -> None:
        self.env_steps += fragment.num_steps
        self.episodes += int(fragment.episode_returns.size)
        self.returns.extend(fragment.episode_returns.tolist())

    # -- training side -----------------------------------------------------------------------

    def train_step(self, fragments: list[Fragment], stop: bool) -> tuple[bool, bool]:
        """One update (in a worker thread); returns whether the group agreed to stop after it
        and whether rank 0 wants a checkpoint (every rank then gathers its trained ranges)."""
        cfg = self.cfg
        if cfg.learner.anneal_lr and cfg.max_env_steps:
            # The group's steps, so every rank steps with the same learning rate.
            frac = max(0.0, 1.0 - self.group.total(self.env_steps) / cfg.max_env_steps)
            self.ppo.set_lr(max(cfg.ppo.lr * frac, cfg.ppo.lr * 1e-3))
        self.metrics = self.ppo.update(fragments, self.version, self.group.mean)
        self.trained_steps += sum(f.num_steps for f in fragments)
        agreed = self.group.all_agree(stop)
        due = self.group.is_leader and (self.schedule.due() or self.checkpoint_requested)
        return agreed, self.group.all_agree(due)

    def snapshot(self, version: int) -> WeightSnapshot:
        """The weights as `version`, in host buckets gathered tensor by tensor from the shards
        (call from a worker thread: for a sharded model each gather is a collective)."""
        tensors = list(self.policy.state_dict().items())
        return WeightSnapshot.build(version, tensors, full_tensor, self.cfg.weight_sync)

    def publish(self, snapshot: WeightSnapshot) -> None:
        """Advance the version and stream it to every registered rollout actor."""
        self.version = snapshot.version
        self.intake.set_version(self.version)
        self.weights.publish(snapshot)

    # -- reporting ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        wall = time.monotonic() - self.started
        complete = self.complete_checkpoint
        return {
            "rank": self.group.rank,
            "pid": os.getpid(),
            "incarnation": self.incarnation,
            "version": self.version,
            "env_steps": self.env_steps,
            "trained_steps": self.trained_steps,
            "sps": (self.env_steps - self.base_env_steps) / wall if wall > 0 else 0.0,
            "episodes": self.episodes,
            "returns": list(self.returns),
            "policy_lag_median": self.metrics.get("policy_lag_median", math.nan),
            "metrics": self.metrics,
            "intake": self.intake.totals(),
            "rejected": self.rejected,
            "actors": len(self.actors),
            "wall_s": wall,
            "checkpoint": None if complete is None else str(complete.path),
            "checkpoint_step": None if complete is None else complete.step,
            "checkpoint_failures": self.checkpoints.failures,
            "checkpoint_error": self.checkpoints.last_failure,
            "journal_full_writes": self.journal.full_writes,
            "journal_held_bytes": self.journal.held,
            "ledger": self.intake.ledger(),
            "phases": self.phases,
            "parallel": None if self.parallel is None else self.parallel.plan.strategy,
            "weight_sync": self.weights.stats(),
        }

    def mark(self, phase: str) -> None:
        self.phases.setdefault(phase, time.time())

    def publish_progress(self, final: bool = False) -> None:
        """Rank 0's progress as its task state (at most once per PROGRESS_EVERY_S, and at
        the stop with `final`): what `shoal train` reads when it cannot see the status files
        (ranks on other hosts). One rank only, so a job costs one Raft write a second."""
        now = time.monotonic()
        if not self.group.is_leader or (not final and now - self._progress_at < PROGRESS_EVERY_S):
            return
        self._progress_at = now
        window = list(self.returns)
        complete = self.complete_checkpoint
        lag = self.metrics.get("policy_lag_median", math.nan)
        wall = now - self.started
        self.publication.update(
            version=self.version,
            env_steps=self.env_steps,
            sps=(self.env_steps - self.base_env_steps) / wall if wall > 0 else 0.0,
            returns=len(window),
            recent_return=sum(window) / len(window) if window else None,
            policy_lag=lag if math.isfinite(lag) else None,
            checkpoint=None if complete is None else str(complete.path),
            checkpoint_step=None if complete is None else complete.step,
            final=final,
            **{k: v for k, v in self.metrics.items() if loss_name(k) and math.isfinite(v)},
        )


def process_started_at() -> float:
    """When this process started (epoch seconds, 10 ms resolution), from /proc: the time a
    restarted rank spends starting Python and importing torch counts too. Now, without /proc."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)


def assigned_gpu(environ: dict[str, str] | None = None) -> int | None:
    """The first GPU the scheduler gave this task (SHOAL_TASK_GPUS, NVML order), if any."""
    text = (os.environ if environ is None else environ).get("SHOAL_TASK_GPUS", "")
    first = text.split(",", 1)[0].strip()
    return int(first) if first.isdigit() else None


def _device(group: LearnerGroup) -> torch.device:
    """NCCL groups train on the GPU the scheduler assigned this rank (the node daemon sets
    CUDA_DEVICE_ORDER=PCI_BUS_ID, so CUDA's numbering is NVML's); gloo trains on CPU. A rank
    started by hand, with no assignment, takes GPU rank % count."""
    if group.backend != "nccl":
        return torch.device("cpu")
    index = assigned_gpu()
    device = torch.device(
        "cuda", group.rank % torch.cuda.device_count() if index is None else index
    )
    torch.cuda.set_device(device)
    return device


class LearnerActor(Actor):
    """The rank's face on the transport; state lives in the core, so a restart loses nothing."""

    def __init__(self, core: LearnerCore) -> None:
        self.core = core

    def register(self, actor_id: str, path: str) -> dict[str, Any]:
        """A rollout actor announces itself; it gets the current weights, version, incarnation."""
        core = self.core
        ref = self.context.system.ref(path)
        core.actors[actor_id] = ref
        core.weights.add(actor_id, ref)
        return {"incarnation": core.incarnation, "version": core.version}

    async def push_fragment(self, payload: Any) -> dict[str, Any]:
        """Take one fragment; the reply waits while the intake is full (back-pressure)."""
        core = self.core
        if core.closed:
            return {"incarnation": core.incarnation, "admission": "closed", "registered": False}
        try:
            fragment = Fragment.from_wire(payload)
        except BadFragment as exc:
            core.rejected += 1
            log.warning("rejected a fragment: %s", exc)
            return {"incarnation": core.incarnation, "admission": "rejected", "error": str(exc)}
        core.record(fragment)
        admission = await core.intake.put(fragment)
        registered = fragment.actor_id in core.actors
        return {
            "incarnation": core.incarnation,
            "admission": admission.value,
            "registered": registered,
        }

    def ping(self) -> None:
        """A waiting rollout actor's check that its link to this rank stands (rollout.py)."""

    def status(self) -> dict[str, Any]:
        return self.core.status()


def append_event(run_dir: Path, event: dict[str, Any]) -> None:
    """One line per lifecycle event (start, resume, checkpoint, stop) in events.jsonl."""
    with (run_dir / "events.jsonl").open("a") as handle:
        handle.write(json.dumps({"time": time.time(), **event}) + "\n")


async def _next_batch(core: LearnerCore, stopping: asyncio.Event) -> list[Fragment] | None:
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


async def _group_batch(core: LearnerCore, stopping: asyncio.Event) -> list[Fragment] | None:
    """The next batch of a rank in a group, or None when the group stops before this update.

    Every update of a group starts with one agreement: a rank asked to stop before it has a
    batch says so and the whole group stops here, with nothing taken. Without it, a stopping
    rank would have to wait for fragments that may never come (a cluster stops the rollout
    workers with the learners) while its peers wait in the update's all-reduce."""
    ready = await _batch_ready(core, stopping)
    if await asyncio.to_thread(core.group.all_agree, not ready):
        return None
    return await core.intake.get(core.cfg.intake.fragments_per_update)


async def train(core: LearnerCore, stopping: asyncio.Event) -> None:
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
        core.publish(await asyncio.to_thread(core.snapshot, core.version + 1))
        core.mark("trained")
        if checkpoint:
            trained = await asyncio.to_thread(core.gather_trained)
            reason = "on demand" if core.checkpoint_requested else "periodic"
            core.checkpoint_requested = False
            await asyncio.to_thread(core.save_checkpoint, trained)
            if core.group.is_leader:
                event = {"event": "checkpoint", "step": core.version, "reason": reason}
                unless_disk_full("a checkpoint event", partial(append_event, core.run_dir, event))
        now = time.monotonic()
        if now - last_ledger >= LEDGER_EVERY_S:
            last_ledger = now
            unless_disk_full("the ledger snapshot", core.write_ledger)
        if now - last_status >= STATUS_EVERY_S:
            last_status = now
            status = core.run_dir / f"status-{core.group.rank}.json"
            unless_disk_full("the status", partial(write_json_atomically, status, core.status()))
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
            await asyncio.to_thread(core.shard)
            resumed = await asyncio.to_thread(core.restore)
            core.mark("restored")
            core.weights.publish(await asyncio.to_thread(core.snapshot, core.version))
            core.mark("ready")
            await system.spawn(LearnerActor, core, name=LEARNER_NAME, mailbox_size=4096)
            write_json_atomically(
                run_dir / f"learner-{group.rank}.addr", {"address": transport.address}
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
            poster = (
                asyncio.ensure_future(post_forever(metrics, core.status, cfg.target_window))
                if metrics is not None and group.is_leader
                else None
            )
            try:
                await train(core, stopping)
            finally:
                if poster is not None:
                    poster.cancel()
                    await asyncio.gather(poster, return_exceptions=True)
            if metrics is not None and group.is_leader:
                await post_once(metrics, core.status(), cfg.target_window)
            trained = await asyncio.to_thread(core.gather_trained)
            await asyncio.to_thread(core.save_checkpoint, trained, True)
            if group.is_leader:
                append_event(run_dir, {"event": "stop", "rank": group.rank, "step": core.version})
            write_json_atomically(run_dir / f"status-{group.rank}.json", core.status())
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
        return run(serve(task.cfg, task.env_id, task.run_dir, listen_at, spec, task.token, metrics))
    except (ShoalError, OSError) as exc:
        print(f"shoal-learner: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
