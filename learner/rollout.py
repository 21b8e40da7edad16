"""Rollout: `RolloutActor`, the actor that runs a `Collector` (collector.py: the stepping and
fragment cutting, without an event loop) and streams its fragments to a learner.

The actor registers with its learner (getting the learner's incarnation and current
version), waits until it holds a complete version from that incarnation, then loops: collect,
push. At most one push is in flight while the next fragment is collected; a push waits while the
learner's intake is full, which is the back-pressure. Weights arrive in buckets
(`weights_begin`, `weights_bucket` × n, `weights_commit`, see weight_sync.py), from a sharded
learner in one part per rank of its shard group, while the actor keeps collecting with its last
complete version; a version with every part committed is adopted between steps,
atomically, and every fragment carries the version it was collected with. A half-received
version is dropped, never adopted. When the learner restarts (a new incarnation, or a dropped
link), the actor registers again and waits for the restored weights; if none arrive within
`weights_timeout_s` it registers again.

With a `ledger_dir`, the actor records which sequence numbers it sent and, per learner
incarnation and admission, which the learner acknowledged; it writes them to
`ledger_dir/rollout-<actor id>.json` at most every LEDGER_EVERY_S and when it stops, for the
chaos checker's cross-restart accounting (`fragment_ledger` in chaos/invariants.py). Each send
and each acknowledgement is also appended to `rollout-<actor id>.jsonl` (`learner/journal.py`)
before it is acted on, so a SIGKILL loses none of them.

Each fragment must fit in one frame of the worker's transport (`max_frame_bytes`): the
collector shortens the job's horizon to the longest that fits (logged once, and shown as
`horizon` in `stats()` and the worker's published task state). A fragment that cannot be sent
at all (not even one step fits, or the transport refuses it as too big) is a configuration
error, not a reason to retry: the actor publishes it as the task's `error`, which ends the
job with that line in `shoal train` (shoal/cluster_train.py), and stops collecting; a worker no
node daemon started has no one to publish to and fails instead.

For a text environment the collector is a `SequenceCollector` (learner/sequence_collector.py):
each step is one decode step of a batch of completions, and `finish` hands the batch to its
scoring thread; the push awaits the scores, so the sandbox runs while the next batch generates.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shoal.config import load
from shoal.envs.packed_obs import PackingError
from shoal.errors import ConfigError
from shoal.files import write_atomically
from shoal.learner.buffer import Admission
from shoal.learner.collector import Collector
from shoal.learner.errors import PolicyError, WeightSyncError
from shoal.learner.fragment import Fragment
from shoal.learner.fragment_size import FragmentTooLarge, shortened
from shoal.learner.journal import Journal
from shoal.learner.models import ModelConfig, build_model
from shoal.learner.peers import Publication
from shoal.learner.seqranges import SeqRanges, ranges_json
from shoal.learner.sequence_collector import PendingSequences, SequenceCollector, settled
from shoal.learner.weight_assembler import WeightAssembler
from shoal.runtime import wire
from shoal.runtime.actor import Actor
from shoal.runtime.errors import ActorError, FrameTooLarge, MailboxFull, WireError
from shoal.runtime.ref import ActorRef

log = logging.getLogger(__name__)

AnyCollector = Collector | SequenceCollector
"""Steps of a vector environment, or sampled completions of a text one (the same interface)."""

# Asks to the learner that may wait for intake room use this timeout; back-pressure is not a failure.
PUSH_TIMEOUT_S = 600.0
REGISTER_TIMEOUT_S = 10.0
# A paced actor waits at most this long for newer weights before collecting anyway.
PACE_TIMEOUT_S = 2.0
LINK_CHECK_S = 0.1
REGISTER_RETRY_MAX_S = 0.25
# Steps between yields to the event loop (lets weight buckets and transport I/O run), and the
# longest the loop is held between yields when steps are slow (96 Atari frames and a CNN take
# ~0.5 s a step on a busy box: four of them starved the link's handshakes and heartbeats, and a
# 250 MB fragment's frame moves only while the loop turns).
YIELD_EVERY_STEPS = 4
YIELD_EVERY_S = 0.02
LEDGER_EVERY_S = 1.0
STALE_LIMIT = 4
"""Fragments refused as stale in a row, at one held version, before the actor registers again
(`StaleWatch`): with pacing, a fragment every PACE_TIMEOUT_S once weights stop."""


@dataclass(frozen=True)
class RolloutSpec:
    """What one rollout actor runs and where it sends its fragments."""

    name: str
    env_id: str
    num_envs: int
    horizon: int
    seed: int
    learner_path: str = ""
    """A fixed learner to feed; empty: the one `locate` names (see RolloutActor)."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    """The policy's `ModelConfig` fields (the job's `[model]` section); must match the learner's."""
    fragments_per_version: float = 0.0
    """This actor's share of what its learner consumes per policy version; 0 turns pacing off."""
    learner_rank: int = 0
    """The learner rank this actor feeds, found through the job's published task state."""
    weights_timeout_s: float = 120.0
    """After registering, how long to wait for a complete version before registering again."""
    text: dict[str, Any] = field(default_factory=dict)
    """A text environment's `[text]` section (learner/config.py `TextConfig`); else unused."""
    env: dict[str, Any] = field(default_factory=dict)
    """The job's `[env]` section (envs/wrappers.py `EnvConfig`): wrappers and normalisation."""
    token: dict[str, Any] = field(default_factory=dict)
    """A text environment's `[token]` section (its group size and temperature sample here)."""
    pipeline: bool = False
    """Pipeline a split vector's halves (learner/config.py `RolloutConfig.pipeline`)."""
    precision: str = "float32"
    """The dtype the policy samples in (learner/config.py `RolloutConfig.precision`)."""


class Pacer:
    """Keeps a rollout actor from running ahead of its learner, which is what keeps lag near 1.

    Environment steps are cheap next to a PPO update here, so an unpaced actor fills the intake
    and every fragment waits there while the policy moves on. A paced actor may have produced
    `floor((v - v0 + 1) * per_version) + 1` fragments by the time it holds policy version v
    (v0: the version at registration): one fragment ready beyond the learner's consumption, so
    the learner never waits, and no more, so each fragment is about one version old when used.
    """

    def __init__(self, per_version: float) -> None:
        self.per_version = per_version
        self.start = 0
        self.produced = 0

    def reset(self, version: int) -> None:
        self.start = version
        self.produced = 0

    def allowance(self, version: int) -> int:
        return math.floor((version - self.start + 1) * self.per_version) + 1

    def allowed(self, version: int) -> bool:
        return self.per_version <= 0 or self.produced < self.allowance(version)


class StaleWatch:
    """Notices that weights stopped arriving: `limit` fragments in a row refused as stale while
    the actor held one version. A learner rank that lost this actor (a transfer's link failed,
    so that rank dropped it) sends it no part of any later version, and only registering again
    subscribes it anew; stale refusals while new versions still arrive are lag, not loss."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.reset()

    def reset(self) -> None:
        """Registered again: the refusals so far no longer count."""
        self.version, self.run = -1, 0

    def observe(self, admission: str, version: int) -> bool:
        """Take one push's admission at the held `version`; True once weights look lost."""
        stale = admission == Admission.STALE.value
        if not stale or version != self.version:
            self.version, self.run = version, 0
        self.run += stale
        return self.run >= self.limit


class RolloutActor(Actor):
    """Streams fragments to the learner at `spec.learner_path`; runs in a rollout worker process.

    `failed` (optional) receives the exception if the collection loop dies of a bug, so the
    process that hosts the actor can exit with an error instead of idling. `locate` (optional)
    names the learner's current path, asked again at every registration: a learner group
    restarted on another host is found there (None: not known yet, asked again shortly).
    `max_frame_bytes` is the hosting transport's frame limit, which every fragment must fit;
    `publication` is the worker's published task state (the horizon, a fatal `error`).
    """

    def __init__(
        self,
        spec: RolloutSpec,
        failed: asyncio.Future[None] | None = None,
        ledger_dir: Path | None = None,
        locate: Callable[[], str | None] | None = None,
        *,
        max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
        publication: Publication | None = None,
    ) -> None:
        self.spec = spec
        self.max_frame_bytes = max_frame_bytes
        self.publication = publication or Publication()
        self.error: str | None = None
        """Why this actor stopped collecting (a fragment that cannot be sent), else None."""
        self._locate = locate or (lambda: spec.learner_path or None)
        self.ledger_dir = ledger_dir
        self.sent = SeqRanges()
        self.acked: dict[str, dict[str, SeqRanges]] = {}
        """Per learner incarnation, per admission ("accepted", "stale", ...): acknowledged seqs."""
        self._ledger_written = 0.0
        self._journal: Journal | None = None
        self._failed = failed
        self._pending: tuple[int, str, dict[str, torch.Tensor]] | None = None
        """A complete version not adopted yet: (version, its source, weights)."""
        self._assembler: WeightAssembler | None = None
        self._held_source = ""
        """The source (learner group incarnation) the collector's weights came from ("": none)."""
        self.weights_received = 0
        self.weights_refused = 0
        self._task: asyncio.Task[None] | None = None
        self._in_flight: asyncio.Task[bool] | None = None
        self._weights_arrived = asyncio.Event()
        self._lost = False
        self.pacer = Pacer(spec.fragments_per_version)
        self._stale = StaleWatch(STALE_LIMIT)
        self._collector: AnyCollector | None = None
        self._incarnation = ""
        self._source = ""
        """The weights source the learner registered with named: its shard group's incarnation."""
        self.registrations = 0
        self.pushed = 0

    async def on_start(self) -> None:
        spec = self.spec
        # A fresh id per incarnation: sequence numbers restart at 0, so the learner's
        # exactly-once accounting must see a new actor, not duplicates.
        actor_id = f"{spec.name}#{os.urandom(4).hex()}"
        try:
            cfg = load(ModelConfig, spec.model, source="the rollout spec", environ={})
            collector = _collector(spec, actor_id, cfg, self.max_frame_bytes)
        except (ConfigError, PolicyError) as exc:
            raise ActorError(f"{spec.name}: no policy for {spec.env_id}: {exc}") from exc
        except (FragmentTooLarge, PackingError) as exc:
            self._give_up(exc)
            return
        self._collector = collector
        self._announce_horizon(collector)
        self._assembler = WeightAssembler(collector.policy.state_dict())
        if self.ledger_dir is not None:
            self.ledger_dir.mkdir(parents=True, exist_ok=True)
            self._journal = Journal(self.ledger_dir / f"rollout-{actor_id}.jsonl")
            self._journal.append({"actor_id": actor_id, "sent": [], "acked": {}})
        self._task = asyncio.create_task(self._run(collector), name=f"rollout {spec.name}")

    async def on_stop(self) -> None:
        for task in (self._task, self._in_flight):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._collector is not None:
            _close(self._collector)
            self.write_ledger()
        if self._journal is not None:
            self._journal.close()

    def weights_begin(self, version: int, manifest: dict[str, Any]) -> None:
        """A part of a version starts arriving (a sharded learner's ranks each send one); a
        newer version drops a half-received one. A version this actor already holds from the
        same learner group is ignored."""
        assembler = self._assembler
        if assembler is None:
            return
        source = manifest.get("source") if isinstance(manifest, dict) else None
        if source == self._newest_source() and _le(version, self._newest_version()):
            return
        try:
            assembler.begin(version, manifest)
        except WeightSyncError as exc:
            self._refused(exc)

    async def weights_bucket(
        self, version: int, part: int, index: int, data: np.ndarray, checksum: int
    ) -> None:
        """One bucket of the version being received; a bad one drops that version. Checked
        and copied in a worker thread (the checksum and numpy copies release the GIL): hundreds of
        MB per bucket would otherwise hold the event loop, and with it the link's pings and
        the environment steps, for a fraction of a second each."""
        if self._assembler is None:
            return
        try:
            await asyncio.to_thread(self._assembler.bucket, version, part, index, data, checksum)
        except WeightSyncError as exc:
            self._refused(exc)

    async def weights_commit(self, version: int, part: int) -> None:
        """A part is complete; once every part is, the version becomes the pending one, adopted
        between steps (its tensors are cast to the local dtypes as they are copied in)."""
        if self._assembler is None:
            return
        try:
            done = await asyncio.to_thread(self._assembler.commit, version, part)
        except WeightSyncError as exc:
            self._refused(exc)
            return
        if done is not None:
            source, weights = done
            self._pending = (version, source, weights)
            self.weights_received += 1
            self._weights_arrived.set()

    def _refused(self, exc: WeightSyncError) -> None:
        self.weights_refused += 1
        version = 0 if self._collector is None else self._collector.policy_version
        log.error("%s: weights refused (%s); keeping version %d", self.spec.name, exc, version)

    def _newest_source(self) -> str:
        return self._held_source if self._pending is None else self._pending[1]

    def _newest_version(self) -> int:
        if self._pending is not None:
            return self._pending[0]
        return 0 if self._collector is None else self._collector.policy_version

    def ledger(self) -> dict[str, Any]:
        """What this actor sent and what each learner incarnation acknowledged, as ranges."""
        collector = self._collector
        by_incarnation = {inc: ranges_json(kinds) for inc, kinds in self.acked.items()}
        return {
            "actor_id": "" if collector is None else collector.actor_id,
            "sent": self.sent.to_json(),
            "acked": by_incarnation,
        }

    def write_ledger(self) -> None:
        collector = self._collector
        if self.ledger_dir is None or collector is None:
            return
        self._ledger_written = time.monotonic()
        self.ledger_dir.mkdir(parents=True, exist_ok=True)
        path = self.ledger_dir / f"rollout-{collector.actor_id}.json"
        write_atomically(path, json.dumps(self.ledger()), durable=False)

    def stats(self) -> dict[str, Any]:
        collector = self._collector
        return {
            "actor_id": "" if collector is None else collector.actor_id,
            "horizon": 0 if collector is None else collector.horizon,
            "error": self.error,
            "env_steps": 0 if collector is None else collector.env_steps,
            "fragments": self.pushed,
            "policy_version": 0 if collector is None else collector.policy_version,
            "registrations": self.registrations,
            "weights_received": self.weights_received,
            "weights_refused": self.weights_refused,
            "weights_dropped": 0 if self._assembler is None else self._assembler.dropped,
        }

    def _announce_horizon(self, collector: AnyCollector) -> None:
        """Log a horizon shortened to fit the frame limit, and publish the one in use."""
        wanted = self.spec.horizon
        if isinstance(collector, Collector) and collector.horizon < wanted:
            why = shortened(wanted, collector.horizon, collector.layout, self.max_frame_bytes)
            log.info("%s: %s", self.spec.name, why)
        self.publication.update(role="rollout", horizon=collector.horizon, horizon_asked=wanted)

    def _give_up(self, exc: FragmentTooLarge | PackingError) -> None:
        """An error no restart can fix (a fragment this actor cannot send, an observation that
        does not fit its space): stop, and say why where the job's driver reads it (the task's
        published `error`); with no one to tell, fail the worker."""
        self.error = f"{self.spec.name}: {exc}"
        log.error("%s", self.error)
        if self.publication.fail(self.error):
            return
        if self._failed is not None and not self._failed.done():
            self._failed.set_exception(exc)

    async def _run(self, collector: AnyCollector) -> None:
        try:
            await self._loop(collector)
        except asyncio.CancelledError:
            raise
        except (FragmentTooLarge, PackingError) as exc:
            self._give_up(exc)
        except Exception as exc:
            log.exception("rollout actor %s failed", self.spec.name)
            if self._failed is not None and not self._failed.done():
                self._failed.set_exception(exc)
            raise

    async def _loop(self, collector: AnyCollector) -> None:
        learner = await self._register(collector)
        while True:
            if self._lost:  # register before collecting with weights the learner lost
                self._lost = False
                if self._in_flight is not None:
                    await self._in_flight  # failed or refused: the learner it went to is gone
                    self._in_flight = None
                learner = await self._register(collector)
            buf: Any = collector.new_buffers()  # the collector's own kind of buffers
            self._adopt()
            version = collector.policy_version
            yielded = time.monotonic()
            for t in range(collector.horizon):
                if t % YIELD_EVERY_STEPS == 0 or time.monotonic() - yielded >= YIELD_EVERY_S:
                    await asyncio.sleep(0)
                    self._adopt()
                    yielded = time.monotonic()
                collector.step(buf, t)
            fragment = collector.finish(buf, version)
            if self._in_flight is not None and not await self._in_flight:
                learner = await self._register(collector)
            if self._journal is not None:
                self._journal.append({"sent": fragment.seq})
            self._in_flight = asyncio.create_task(self._push(learner, fragment))
            self.sent.add(fragment.seq)
            self.pacer.produced += 1
            if time.monotonic() - self._ledger_written >= LEDGER_EVERY_S:
                self.write_ledger()
            await self._wait_for_turn(collector, learner)

    async def _wait_for_turn(self, collector: AnyCollector, learner: ActorRef) -> None:
        """Hold off the next fragment until the learner has consumed enough (see `Pacer`).

        Newer weights are the signal; without them for PACE_TIMEOUT_S (a lost message, a slow
        update) the actor goes on. Every LINK_CHECK_S of waiting it checks that its link to
        the learner still stands: a learner that died sends no weights, and waiting out the
        pace timeout before noticing made every learner restart 2 s longer (the new rank
        trained only once the actor had registered with it and sent a fragment).
        """
        self._adopt()
        waited = 0.0
        while not self.pacer.allowed(collector.policy_version):
            if not _link_stands(learner):
                log.info("%s: the link to its learner is down; registering again", self.spec.name)
                self._lost = True
                return
            self._weights_arrived.clear()
            try:
                await asyncio.wait_for(self._weights_arrived.wait(), LINK_CHECK_S)
            except TimeoutError:
                waited += LINK_CHECK_S
                if waited >= PACE_TIMEOUT_S:
                    log.info(
                        "%s: no new weights for %.0f s (%d fragments at version %d); going on",
                        self.spec.name,
                        PACE_TIMEOUT_S,
                        self.pacer.produced,
                        collector.policy_version,
                    )
                    return
                continue
            self._adopt()

    def _adopt(self) -> None:
        """Swap to the pending complete version if it came from the learner registered with."""
        pending, self._pending = self._pending, None
        collector = self._collector
        if pending is None or collector is None or pending[1] != self._source:
            return
        version, source, weights = pending
        if source != self._held_source or version > collector.policy_version:
            collector.set_weights(version, weights, source)
            self._held_source = source

    async def _push(self, learner: ActorRef, item: Fragment | PendingSequences) -> bool:
        """Send one fragment (a text batch once it is scored); False when the learner is gone,
        a new incarnation, or no longer publishing weights to this actor."""
        fragment = await settled(item)
        try:
            reply = await learner.ask(timeout=PUSH_TIMEOUT_S).push_fragment(fragment.to_wire())
        except FrameTooLarge as exc:
            raise FragmentTooLarge(
                f"its fragment of {fragment.horizon} steps x {fragment.num_envs} envs cannot be "
                f"sent ({exc}); use fewer environments per actor (--envs, rollout.num_envs) or "
                "a shorter horizon (rollout.horizon)"
            ) from exc
        except (ActorError, WireError) as exc:
            log.warning("push to %s failed (%s); registering again", learner.path, exc)
            return False
        self.pushed += 1
        if isinstance(reply, dict):
            incarnation, admission = str(reply.get("incarnation")), str(reply.get("admission"))
            if self._journal is not None:  # on record before anything acts on the ack
                self._journal.append(
                    {"acked": fragment.seq, "incarnation": incarnation, "admission": admission}
                )
            kinds = self.acked.setdefault(incarnation, {})
            kinds.setdefault(admission, SeqRanges()).add(fragment.seq)
            if self._stale.observe(admission, self._newest_version()):
                log.warning(
                    "%s: %d fragments in a row refused as stale at version %d, and no newer "
                    "weights: registering again", self.spec.name, self._stale.run,
                    self._newest_version(),
                )  # fmt: skip
                return False
        # A new learner incarnation, or one that stopped sending us weights: register again.
        return (
            isinstance(reply, dict)
            and reply.get("incarnation") == self._incarnation
            and reply.get("registered", True) is True
        )

    async def _register(self, collector: AnyCollector) -> ActorRef:
        """Register until the learner answers and its weights arrive complete within
        `weights_timeout_s`; the learner's path is looked up again before every try."""
        while True:
            learner, version = await self._register_once(collector)
            if await self._await_weights(collector, learner, version):
                self.pacer.reset(collector.policy_version)
                self._stale.reset()
                log.info(
                    "%s: registered with learner incarnation %s; collecting with version %d",
                    self.spec.name,
                    self._incarnation,
                    collector.policy_version,
                )
                return learner

    async def _register_once(self, collector: AnyCollector) -> tuple[ActorRef, int]:
        """One registration: the learner's ref and the version it holds now."""
        delay = 0.05
        while True:
            path = self._locate()
            if path is None:
                log.info(
                    "%s: no address for learner rank %d yet", self.spec.name, self.spec.learner_rank
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, REGISTER_RETRY_MAX_S)
                continue
            learner = self.context.system.ref(path)
            try:
                reply = await learner.ask(timeout=REGISTER_TIMEOUT_S).register(
                    collector.actor_id, self.ref.path
                )
                if isinstance(reply, dict) and {"incarnation", "version", "source"} <= set(reply):
                    break
                log.info("learner %s refused the registration (%.200s)", path, reply)
            except (ActorError, WireError) as exc:
                log.info("learner %s not ready (%s)", path, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, REGISTER_RETRY_MAX_S)
        self._incarnation = str(reply["incarnation"])
        self._source = str(reply["source"])
        self.registrations += 1
        return learner, int(reply["version"])

    async def _await_weights(
        self, collector: AnyCollector, learner: ActorRef, version: int
    ) -> bool:
        """Wait until the collector holds a complete version >= `version` from the incarnation
        registered with; False when the link drops or `weights_timeout_s` passes first."""
        deadline = time.monotonic() + self.spec.weights_timeout_s
        while True:
            self._adopt()
            if self._held_source == self._source and collector.policy_version >= version:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not _link_stands(learner):
                log.warning(
                    "%s: no complete weights (version >= %d) from learner incarnation %s within "
                    "%.0f s or its link dropped; registering again",
                    self.spec.name,
                    version,
                    self._incarnation,
                    self.spec.weights_timeout_s,
                )
                return False
            self._weights_arrived.clear()
            try:
                await asyncio.wait_for(self._weights_arrived.wait(), min(LINK_CHECK_S, remaining))
            except TimeoutError:
                continue


def _collector(
    spec: RolloutSpec, actor_id: str, model: ModelConfig, max_frame_bytes: int
) -> AnyCollector:
    """The actor's collector: sampled completions for a text environment, steps otherwise,
    in fragments that fit in a frame of `max_frame_bytes` (the environments are closed when
    not even one step does)."""
    from shoal.envs.hashing import env_hash
    from shoal.envs.vector import make_vector
    from shoal.envs.wrappers import EnvConfig
    from shoal.learner.text_job import is_text_job, text_collector

    if is_text_job(spec.env_id):
        return text_collector(
            spec, actor_id, lambda obs, act: build_model(model, obs, act).run_in(spec.precision)
        )
    wrappers = EnvConfig.from_json(spec.env, source=f"{actor_id}'s [env]")
    env = make_vector(spec.env_id, spec.num_envs, seed=spec.seed, env=wrappers, **spec.env_kwargs)
    try:
        policy = build_model(model, env.single_observation_space, env.single_action_space)
        policy.run_in(spec.precision)
    except (ConfigError, PolicyError):
        env.close()
        raise
    digest = env_hash(spec.env_id, dict(spec.env_kwargs), spec.seed, wrappers=wrappers)
    try:
        return Collector(actor_id, env, policy, spec.horizon, digest, spec.seed, max_frame_bytes,
                         pipeline=spec.pipeline)  # fmt: skip
    except FragmentTooLarge:
        env.close()
        raise


def _close(collector: AnyCollector) -> None:
    if isinstance(collector, SequenceCollector):
        collector.close()
    else:
        collector.env.close()


def _le(version: object, held: int) -> bool:
    """Whether a received version number is one the actor already holds (or older)."""
    return type(version) is int and version <= held


def _link_stands(learner: ActorRef) -> bool:
    """Whether the link to the learner is up, by a `ping` that fails at once when it is not
    (a busy link is up)."""
    try:
        learner.tell_nowait.ping()
    except MailboxFull:
        return True
    except (ActorError, WireError):
        return False
    return True
