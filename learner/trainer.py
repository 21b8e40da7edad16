"""One learner rank's training state and step, apart from the process that runs it.

`LearnerCore` owns what a rank knows: the policy as the group holds it (learner/parallel.py),
PPO and its optimiser, the intake, the sharded checkpoints (saved and restored in one place,
with learner/train_state.py), the weight snapshots its broadcaster streams, and the counts and
status other processes read. The process around it (learner/learner_main.py) owns the event
loop, the transport, signals and the training loop; the core is driven from there:
`train_step` in a worker thread, `advance` and `stream` on the loop (they cut buckets in a
worker thread).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import socket
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shoal.files import write_json_atomically
from shoal.learner.buffer import Intake
from shoal.learner.checkpoint import CheckpointInfo, CheckpointManager
from shoal.learner.config import TrainConfig
from shoal.learner.errors import LearnerError
from shoal.learner.group import LearnerGroup
from shoal.learner.job import checkpoint_dir
from shoal.learner.job_metrics import loss_name
from shoal.learner.journal import open_learner_journal
from shoal.learner.materialize import build_policy
from shoal.learner.parallel import (
    Parallelized,
    ShardingOptions,
    check_fits,
    owned_rows,
    parallelize,
    plan_parallelism,
    publishing_row,
    rank_memory_bytes,
    training_bytes,
)
from shoal.learner.peers import Publication
from shoal.learner.ppo import PPOLearner
from shoal.learner.seqranges import SeqRanges, ranges_by_actor, ranges_json
from shoal.learner.sequences import AnyFragment
from shoal.learner.train_state import model_optimizer_state, restore_model_optimizer
from shoal.learner.weight_sync import WeightBroadcaster, WeightSnapshot
from shoal.rundir import RunDir
from shoal.runtime.ref import ActorRef

log = logging.getLogger("shoal.learner")

PROGRESS_EVERY_S = 1.0


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
        from shoal.learner.text_job import job_spaces

        self.cfg = cfg
        self.env_id = env_id
        self.group = group
        self.run_dir = run_dir
        observation_space, action_space = job_spaces(env_id, cfg)
        torch.manual_seed(cfg.seed)  # every rank initialises identically (FSDP2 relies on it)
        self.device = _device(group)
        # a causal LM is built on the meta device: `shard` gives it storage, unit by unit
        self.policy = build_policy(cfg.model, observation_space, action_space, self.device)
        self.parallel: Parallelized | None = None
        self._ppo: PPOLearner | None = None
        self.incarnation = os.urandom(6).hex()
        self.weights = WeightBroadcaster(cfg.weight_sync, source=self.incarnation)
        self.publisher_ranks: tuple[int, ...] = (group.rank,)
        """The ranks whose weight-sync parts together make a version for this rank's actors
        (its shard group; `shard` sets it), in part order."""
        self.publishers: list[str] = []
        """Their learner actors' paths, but this rank's own (`meet` sets them)."""
        accounting = RunDir(run_dir).accounting
        self.journal = open_learner_journal(accounting, group.rank, self.incarnation)
        self.intake = Intake(cfg.intake.capacity, cfg.intake.max_staleness, self.journal)
        self.intake.set_lineage(self.weights.source, 0)
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
        train_bytes = training_bytes(self.policy)
        plan = plan_parallelism(learner.sharding, islands, train_bytes, memory)
        log.info("rank %d holds the model as %s: %s", self.group.rank, plan.strategy, plan.reason)
        if not learner.cpu_offload:  # offloaded, the state lives in host memory instead
            check_fits(plan, train_bytes, memory)
        options = ShardingOptions(
            mixed_precision=learner.mixed_precision,
            cpu_offload=learner.cpu_offload,
            activation_checkpointing=learner.activation_checkpointing,
        )
        self.parallel = parallelize(self.policy, plan, self.device, options, self.cfg.seed)
        self.publisher_ranks = publishing_row(plan, self.group.rank)
        if self.parallel.autocast is not None:
            log.info(
                "rank %d computes in bf16 (%s autocast)", self.group.rank, self.parallel.autocast
            )
        self._ppo = PPOLearner(
            self.parallel.module, self.cfg.ppo, self.policy, self.parallel.forward_context
        )
        self._ppo.token_cfg = self.cfg.token

    def meet(self, path: str) -> None:
        """Learn where the other publishers of this rank's weight parts serve (`path`: this
        rank's learner actor) and take its shard group's weights source, the first rank's
        incarnation, which the parts share and the fragments collected with them carry (the
        intake's lineage). A collective: every rank calls it after `shard`."""
        met = self.group.all_gather((path, self.incarnation))
        row = self.publisher_ranks
        self.publishers = [str(met[r][0]) for r in row if r != self.group.rank]  # type: ignore[index]
        self.weights.source = str(met[row[0]][1])  # type: ignore[index]
        self.intake.set_lineage(self.weights.source, self.version)

    @property
    def part(self) -> tuple[int, int]:
        """This rank's weight-sync part and the number of parts."""
        return self.publisher_ranks.index(self.group.rank), len(self.publisher_ranks)

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
        self.intake.set_lineage(self.weights.source, self.version)
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
        folder = RunDir(self.run_dir).accounting
        folder.mkdir(exist_ok=True)
        name = f"learner-{self.group.rank}-{self.incarnation}.json"
        write_json_atomically(folder / name, self.ledger(final), durable=False)

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

    def record(self, fragment: AnyFragment) -> None:
        self.env_steps += fragment.num_steps
        self.episodes += int(fragment.episode_returns.size)
        self.returns.extend(fragment.episode_returns.tolist())

    # -- training side -----------------------------------------------------------------------

    def train_step(self, fragments: list[AnyFragment], stop: bool) -> tuple[bool, bool]:
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

    async def advance(self) -> None:
        """The update is done: the next version, streamed to every registered actor."""
        self.version += 1
        self.intake.set_version(self.version)
        await self.stream(self.version)

    async def stream(self, version: int) -> None:
        """Publish this rank's part of the model's weights as `version` and cut it into host
        buckets in a worker thread, tensor by tensor: a sharded rank's part is the rows it
        holds, so it gathers nothing and keeps 1/N of the version (a tensor not sharded on
        dim 0 is gathered, a collective, so every rank calls this in step); the transfers send
        each bucket as soon as it is ready, so sending overlaps cutting."""
        tensors = list(self.policy.state_dict().items())
        part, parts = self.part
        snapshot = WeightSnapshot.plan_for(
            version, tensors, self.cfg.weight_sync, part=part, parts=parts
        )
        snapshot.attach(asyncio.get_running_loop())
        self.weights.publish(snapshot)
        take = functools.partial(owned_rows, part=part, parts=parts)
        await asyncio.to_thread(snapshot.fill, tensors, take)

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
