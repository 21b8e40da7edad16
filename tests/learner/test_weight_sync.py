"""Weight sync in buckets: the planner's properties, the receiver's refusals of hostile input, and
real rollout actors receiving versions from a real broadcaster over the transport on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
import torch
from gymnasium import spaces
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import ConfigError
from shoal.learner.errors import WeightSyncError
from shoal.learner.fragment import Fragment
from shoal.learner.models import ModelConfig, PolicyModel, build_model
from shoal.learner.rollout import RolloutActor, RolloutSpec
from shoal.learner.weight_assembler import WeightAssembler
from shoal.learner.weight_plan import FRAME_HEADROOM, WeightSyncConfig, plan_buckets
from shoal.learner.weight_sync import WeightBroadcaster, WeightSnapshot
from shoal.runtime import wire
from shoal.runtime.actor import Actor
from shoal.runtime.loop import run
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import Transport, TransportConfig, attach
from tests.support.waiting import eventually_async

WAIT_S = 60.0
"""How long the loop-side waits below may take on a loaded machine: a failure detector."""

TOKEN = "weight-sync-test"
FRAME = 256 * 1024  # a small frame cap: the 512×512 layer (1 MiB) is four frames' worth
HIDDEN = (512, 512)

# -- the plan -------------------------------------------------------------------------------


@settings(deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=40), st.integers(64, 3000) | st.integers(1, 8))
def test_the_plan_covers_every_byte_once_and_no_bucket_is_over_the_limit(
    sizes: list[int], limit: int
) -> None:
    plan = plan_buckets(sizes, limit)
    covered = [np.zeros(size, dtype=np.int64) for size in sizes]
    for b, chunks in enumerate(plan):
        filled = sum(chunk.length for chunk in chunks)
        assert 0 < filled <= limit
        assert b == len(plan) - 1 or filled == limit  # only the last bucket may be short
        at = 0
        for chunk in chunks:
            assert chunk.at == at  # chunks tile their bucket in order
            assert chunk.length > 0
            at += chunk.length
            covered[chunk.tensor][chunk.start : chunk.start + chunk.length] += 1
    assert all((c == 1).all() for c in covered)


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"bucket_mb": 0}, "weight_sync.bucket_mb"),
        ({"bucket_mb": float("nan")}, "weight_sync.bucket_mb"),
        ({"wire_dtype": "float16"}, "weight_sync.wire_dtype"),
        ({"deadline_s": 0}, "weight_sync.deadline_s"),
        ({"deadline_s": True}, "weight_sync.deadline_s"),
    ],
)
def test_bad_config_names_the_key(changes: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        WeightSyncConfig(**changes)


@pytest.mark.parametrize("frame", [FRAME, wire.DEFAULT_MAX_FRAME_BYTES])
def test_a_full_bucket_message_fits_in_one_frame(frame: int) -> None:
    limit = WeightSyncConfig(bucket_mb=1024).bucket_bytes(frame)
    assert limit <= frame - FRAME_HEADROOM
    data = np.zeros(limit, dtype=np.uint8)
    path = "shoal://127.0.0.1:65535/" + "r" * 200
    envelope = ["t", path, "weights_bucket", [2**62, 1023, 2**20, data, 2**64 - 1], {}]
    assert wire.encode(envelope, frame).nbytes <= frame


# -- the receiver, pure ---------------------------------------------------------------------


def _model(hidden: tuple[int, ...] = (8, 8), seed: int = 0) -> PolicyModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(family="mlp", hidden=hidden)
    return build_model(cfg, spaces.Box(-1.0, 1.0, (4,), np.float32), spaces.Discrete(2))


def _params(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.state_dict().items())


def _deliver(assembler: WeightAssembler, snap: WeightSnapshot, source: str = "inc") -> Any:
    assembler.begin(snap.version, {**snap.manifest, "source": source})
    for index, (data, crc) in enumerate(zip(snap.buckets, snap.checksums)):
        assert assembler.bucket(snap.version, snap.part, index, data, crc)
    return assembler.commit(snap.version, snap.part)


@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16"])
def test_a_snapshot_reassembles_exactly_with_odd_tensors(wire_dtype: str) -> None:
    state = {
        "big": torch.randn(37, 41),  # spans several 1 KiB buckets
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "count": torch.tensor([7, -3], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }
    cfg = WeightSyncConfig(bucket_mb=1 / 1024, wire_dtype=wire_dtype)
    snap = WeightSnapshot.build(3, list(state.items()), lambda t: t, cfg)
    assert len(snap.buckets) >= 3
    source, weights = _deliver(WeightAssembler(state), snap)
    assert source == "inc"
    for name, tensor in state.items():
        expected = tensor
        wire = tensor.dtype
        if wire_dtype == "bfloat16" and tensor.is_floating_point():
            expected, wire = tensor.to(torch.bfloat16).to(tensor.dtype), torch.bfloat16
        assert weights[name].dtype == wire  # cast by set_weights as it copies, not here
        assert torch.equal(weights[name].to(tensor.dtype), expected), name
    model = _model((8, 8))
    snap = WeightSnapshot.build(4, _params(model), lambda t: t, cfg)
    _, weights = _deliver(WeightAssembler(model.state_dict()), snap)
    policy = _model((8, 8), seed=1)
    policy.set_weights(weights)
    for name, tensor in model.state_dict().items():
        expected = tensor.to(torch.bfloat16).float() if wire_dtype == "bfloat16" else tensor
        assert torch.equal(policy.state_dict()[name], expected), name


def test_bfloat16_on_the_wire_halves_the_floating_bytes() -> None:
    params = _params(_model((64, 64)))
    full = WeightSnapshot.build(1, params, lambda t: t, WeightSyncConfig())
    half = WeightSnapshot.build(1, params, lambda t: t, WeightSyncConfig(wire_dtype="bfloat16"))
    assert half.nbytes * 2 == full.nbytes


def test_bad_buckets_drop_the_version_and_leftovers_are_ignored() -> None:
    model = _model((32, 32))
    snap = WeightSnapshot.build(
        5, _params(model), lambda t: t, WeightSyncConfig(bucket_mb=1 / 1024)
    )
    data, crc = snap.buckets[0], snap.checksums[0]
    assembler = WeightAssembler(model.state_dict())
    cases: list[Callable[[], object]] = [
        lambda: assembler.bucket(5, 0, 1, snap.buckets[1], snap.checksums[1]),  # out of order
        lambda: assembler.bucket(5, 0, 0, data[:-1], crc),  # short
        lambda: assembler.bucket(5, 0, 0, data, crc ^ 1),  # corrupt
        lambda: assembler.bucket(5, 0, 0, data.astype(np.int16), crc),  # wrong dtype
        lambda: assembler.bucket(5, 1, 0, data, crc),  # a part that is not one
        lambda: assembler.commit(5, 0),  # incomplete
    ]
    for dropped, case in enumerate(cases, start=1):
        assembler.begin(5, snap.manifest)
        with pytest.raises(WeightSyncError):
            case()
        assert assembler.dropped == dropped
        assert assembler.bucket(5, 0, 0, data, crc) is False  # the dropped version's leftovers
        assert assembler.commit(5, 0) is None
    assert _deliver(assembler, snap) is not None  # and the next good version goes through


def test_a_manifest_for_another_model_is_refused_before_allocating() -> None:
    local = _model((8, 8))
    other = WeightSnapshot.build(1, _params(_model((16,))), lambda t: t, WeightSyncConfig())
    with pytest.raises(WeightSyncError, match=r"different models|shape"):
        WeightAssembler(local.state_dict()).begin(1, other.manifest)
    snap = WeightSnapshot.build(1, _params(local), lambda t: t, WeightSyncConfig())
    liar = {**snap.manifest, "nbytes": 10**15, "buckets": 10**9}
    with pytest.raises(WeightSyncError, match="bytes in"):
        WeightAssembler(local.state_dict()).begin(1, liar)


@functools.cache
def _small() -> tuple[PolicyModel, WeightSnapshot]:
    model = _model()
    return model, WeightSnapshot.build(2, _params(model), lambda t: t, WeightSyncConfig())


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=30,
)
_MANIFEST_KEYS = ("tensors", "bucket_bytes", "buckets", "nbytes", "source", "part", "parts")


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        _values,
        st.fixed_dictionaries({}, optional={key: _values for key in _MANIFEST_KEYS}),
    ),
    _values,
)
def test_hostile_manifests_only_raise_weight_sync_error(manifest: Any, version: Any) -> None:
    model, snap = _small()
    assembler = WeightAssembler(model.state_dict())
    with contextlib.suppress(WeightSyncError):
        assembler.begin(version, manifest)
    assert _deliver(assembler, snap) is not None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(["actor.0.weight", "critic.2.bias", "log_std", "x"]), max_size=8),
    st.lists(st.integers(-2, 70), max_size=4),
    st.sampled_from(["float32", "bfloat16", "int64", "complex"]),
)
def test_hostile_tensor_entries_are_refused(names: list[str], shape: list[int], dtype: str) -> None:
    model, snap = _small()
    tensors = [[name, dtype, shape] for name in names]
    with pytest.raises(WeightSyncError):
        WeightAssembler(model.state_dict()).begin(1, {**snap.manifest, "tensors": tensors})


# -- real actors over the real transport ------------------------------------------------------


class Learner(Actor):
    """The serving half of a learner rank: a real broadcaster registers rollout actors, and
    every fragment's policy version is recorded."""

    def __init__(self, broadcaster: WeightBroadcaster) -> None:
        self.broadcaster = broadcaster
        self.versions: list[int] = []
        self.admission = "accepted"

    def register(self, actor_id: str, path: str) -> dict[str, Any]:
        self.broadcaster.add(actor_id, self.context.system.ref(path))
        snapshot = self.broadcaster.snapshot
        return {
            "incarnation": self.broadcaster.source,
            "version": snapshot.version if snapshot else 0,
            "source": self.broadcaster.source,
        }

    def push_fragment(self, payload: Any) -> dict[str, Any]:
        self.versions.append(Fragment.from_wire(payload).policy_version)
        return {"incarnation": self.broadcaster.source, "admission": self.admission}

    def ping(self) -> None:
        """The rollout actor's link check."""


class HeldRollout(RolloutActor):
    """A rollout actor whose buckets of `held` versions wait for `gate`: a receiver that stops
    answering (its mailbox and the link's credit fill, and the sender blocks)."""

    def __init__(self, spec: RolloutSpec, gate: asyncio.Event, held: set[int]) -> None:
        super().__init__(spec)
        self.gate = gate
        self.held = held
        self.holding = asyncio.Event()

    async def weights_bucket(
        self, version: int, part: int, index: int, data: np.ndarray, checksum: int
    ) -> None:
        if version in self.held and not self.gate.is_set():
            self.holding.set()
            await self.gate.wait()
        await super().weights_bucket(version, part, index, data, checksum)


@contextlib.asynccontextmanager
async def node(**options: Any) -> AsyncIterator[tuple[ActorSystem, Transport]]:
    async with ActorSystem() as system:
        transport = await attach(
            system, TransportConfig(token=TOKEN, max_frame_bytes=FRAME, **options)
        )
        try:
            yield system, transport
        finally:
            await system.stop()  # actors first: none re-registers through a closed transport
            await transport.close()


@contextlib.asynccontextmanager
async def learner(cfg: WeightSyncConfig) -> AsyncIterator[tuple[Learner, WeightBroadcaster, str]]:
    broadcaster = WeightBroadcaster(cfg, source="incarnation-1")
    actor = Learner(broadcaster)
    async with node() as (system, transport):
        await system.spawn(lambda: actor, name="learner")
        try:
            yield actor, broadcaster, f"{transport.address}/learner"
        finally:
            await broadcaster.close()


def _spec(name: str, learner_path: str, **changes: Any) -> RolloutSpec:
    return RolloutSpec(
        name=name, env_id="CartPole-v1", num_envs=2, horizon=4, seed=1,
        learner_path=learner_path, model={"hidden": list(HIDDEN)}, **changes,
    )  # fmt: skip


def _snapshot(
    version: int, cfg: WeightSyncConfig, hidden: tuple[int, ...] = HIDDEN
) -> WeightSnapshot:
    return WeightSnapshot.build(
        version, _params(_model(hidden, seed=version)), lambda t: t, cfg, max_frame_bytes=FRAME
    )


def _weights(actor: RolloutActor) -> dict[str, torch.Tensor]:
    assert actor._collector is not None
    return actor._collector.policy.state_dict()


def _stats(actor: RolloutActor) -> dict[str, Any]:
    return actor.stats()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16"])
def test_a_model_bigger_than_a_bucket_arrives_intact_over_the_transport(wire_dtype: str) -> None:
    cfg = WeightSyncConfig(wire_dtype=wire_dtype)

    async def main() -> None:
        async with learner(cfg) as (learn, broadcaster, path), node() as (system, _):
            snap = _snapshot(1, cfg)
            # the 512×512 layer alone is over the 256 KiB frame cap, in either dtype
            assert len(snap.buckets) >= 6
            broadcaster.publish(snap)
            actor = RolloutActor(_spec("r", path))
            await system.spawn(lambda: actor, name="rollout")
            await eventually_async(
                lambda: learn.versions, "a fragment from the rollout actor", WAIT_S
            )
            assert set(learn.versions) == {1}
            sent = _model(HIDDEN, seed=1).state_dict()
            for name, tensor in _weights(actor).items():
                expected = sent[name]
                if wire_dtype == "bfloat16":
                    expected = expected.to(torch.bfloat16).float()
                assert torch.equal(tensor, expected), name
            stats = broadcaster.stats()
            assert stats["completed"] == 1
            assert stats["bytes"] == snap.nbytes

    run(main())


@pytest.mark.timeout(120)
def test_a_corrupt_or_foreign_version_is_refused_and_the_last_one_kept() -> None:
    cfg = WeightSyncConfig()

    async def main() -> None:
        async with learner(cfg) as (learn, broadcaster, path), node() as (system, _):
            broadcaster.publish(_snapshot(1, cfg))
            actor = RolloutActor(_spec("r", path))
            await system.spawn(lambda: actor, name="rollout")
            await eventually_async(lambda: learn.versions, "fragments at version 1", WAIT_S)
            good = {k: v.clone() for k, v in _weights(actor).items()}

            corrupt = _snapshot(2, cfg)
            corrupt.checksums[3] ^= 0xFFFF
            broadcaster.publish(corrupt)
            await eventually_async(
                lambda: _stats(actor)["weights_refused"] == 1, "the corrupt version refused", WAIT_S
            )
            broadcaster.publish(_snapshot(3, cfg, hidden=(64, 64)))  # another model's manifest
            await eventually_async(
                lambda: _stats(actor)["weights_refused"] == 2, "the foreign version refused", WAIT_S
            )
            hostile = learn.context.system.ref(actor.ref.path)  # a peer sending garbage
            await hostile.tell.weights_begin(9, {"tensors": "x" * 1000, "source": "incarnation-1"})
            await hostile.tell.weights_begin(-1, [1, 2])
            await hostile.tell.weights_bucket(9, 0, 0, np.zeros(10, np.uint8), 0)
            await hostile.tell.weights_bucket(9, "0", [], None, 0)
            await hostile.tell.weights_commit("9", 0)
            await hostile.tell.weights_commit(9, 2**40)
            await eventually_async(
                lambda: _stats(actor)["weights_refused"] == 4, "the garbage refused", WAIT_S
            )
            count = len(learn.versions)
            await eventually_async(
                lambda: len(learn.versions) > count + 2, "collecting on version 1", WAIT_S
            )
            assert set(learn.versions) == {1}
            assert all(torch.equal(good[k], v) for k, v in _weights(actor).items())

            broadcaster.publish(_snapshot(4, cfg))  # and the next good version is adopted
            await eventually_async(
                lambda: learn.versions[-1] == 4, "fragments at version 4", WAIT_S
            )
            assert set(learn.versions) == {1, 4}
            assert _stats(actor)["weights_dropped"] >= 1  # the corrupt one, half received

    run(main())


@pytest.mark.timeout(120)
def test_a_receiver_that_stops_answering_times_out_and_others_are_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = WeightSyncConfig(deadline_s=1.0)
    slow_link = {"credit_frames": 4, "credit_bytes": 256 * 1024}

    async def main() -> None:
        gate = asyncio.Event()
        async with (
            learner(cfg) as (learn, broadcaster, path),
            node(**slow_link) as (slow_system, _),
            node() as (system, _),
        ):
            broadcaster.publish(_snapshot(1, cfg))
            held = HeldRollout(_spec("held", path, weights_timeout_s=600.0), gate, {1, 2})
            await slow_system.spawn(lambda: held, name="held", mailbox_size=2)
            await eventually_async(
                lambda: broadcaster.stats()["timed_out"] == 1, "the transfer's deadline", WAIT_S
            )
            actor = RolloutActor(_spec("r", path))
            await system.spawn(lambda: actor, name="rollout")
            await eventually_async(lambda: learn.versions, "the other actor collecting", WAIT_S)
            broadcaster.publish(_snapshot(2, cfg))
            await eventually_async(
                lambda: learn.versions[-1] == 2, "the other actor on version 2", WAIT_S
            )
            await eventually_async(
                lambda: broadcaster.stats()["timed_out"] == 2, "version 2's deadline too", WAIT_S
            )
            assert held.stats()["policy_version"] == 0  # it never collected on half a version
            gate.set()

    with caplog.at_level(logging.ERROR, logger="shoal.learner.weight_sync"):
        run(main())
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("version 1" in m and "held#" in m and "timed out" in m for m in errors)


@pytest.mark.timeout(120)
def test_a_newer_version_supersedes_a_half_sent_one() -> None:
    cfg = WeightSyncConfig()
    slow_link = {"credit_frames": 4, "credit_bytes": 256 * 1024}

    async def main() -> None:
        gate = asyncio.Event()
        async with learner(cfg) as (learn, broadcaster, path), node(**slow_link) as (system, _):
            broadcaster.publish(_snapshot(1, cfg))
            held = HeldRollout(_spec("held", path, weights_timeout_s=600.0), gate, {1})
            await system.spawn(lambda: held, name="held", mailbox_size=2)
            await held.holding.wait()
            await eventually_async(
                lambda: broadcaster.stats()["in_flight"] == 1, "version 1 in flight", WAIT_S
            )
            broadcaster.publish(_snapshot(2, cfg))
            gate.set()
            await eventually_async(lambda: learn.versions, "fragments", WAIT_S)
            assert set(learn.versions) == {2}
            stats = held.stats()
            assert stats["weights_received"] == 1  # version 1 never completed
            assert stats["weights_dropped"] == 1
            assert broadcaster.stats()["superseded"] == 1
            sent = _model(HIDDEN, seed=2).state_dict()
            assert all(torch.equal(sent[k], v) for k, v in _weights(held).items())

    run(main())


@pytest.mark.timeout(120)
def test_an_actor_without_weights_registers_again_and_collects_only_once_they_arrive() -> None:
    cfg = WeightSyncConfig()

    async def main() -> None:
        async with learner(cfg) as (learn, broadcaster, path), node() as (system, _):
            actor = RolloutActor(_spec("r", path, weights_timeout_s=0.3))
            await system.spawn(lambda: actor, name="rollout")  # nothing published yet
            await eventually_async(
                lambda: actor.registrations >= 3, "registering again without weights", WAIT_S
            )
            assert not learn.versions
            broadcaster.publish(_snapshot(1, cfg))
            await eventually_async(
                lambda: learn.versions, "fragments once version 1 arrived", WAIT_S
            )
            assert set(learn.versions) == {1}

    run(main())


@pytest.mark.timeout(120)
def test_an_actor_that_dies_is_dropped_and_one_no_longer_sent_weights_registers_again() -> None:
    cfg = WeightSyncConfig()

    async def main() -> None:
        async with learner(cfg) as (learn, broadcaster, path), node() as (system, _):
            broadcaster.publish(_snapshot(1, cfg))
            async with node() as (doomed_system, _):
                doomed = RolloutActor(_spec("doomed", path))
                await doomed_system.spawn(lambda: doomed, name="doomed")
                await eventually_async(lambda: learn.versions, "the doomed actor collecting")
            doomed_id = next(a for a in broadcaster._actors if a.startswith("doomed#"))
            broadcaster.publish(_snapshot(2, cfg))  # its process is gone: the link fails
            await eventually_async(
                lambda: not broadcaster.serves(doomed_id), "the dead actor dropped", WAIT_S
            )
            assert broadcaster.stats()["failed"] == 1

            actor = RolloutActor(_spec("r", path))
            await system.spawn(lambda: actor, name="rollout")
            await eventually_async(lambda: actor.registrations == 1, "registered", WAIT_S)
            actor_id = next(a for a in broadcaster._actors if a.startswith("r#"))
            await eventually_async(lambda: actor.pushed >= 1, "collecting", WAIT_S)
            learn.admission = "stale"  # the learner moves on ...
            broadcaster.remove(actor_id)  # ... without this actor: as if a link had failed
            await eventually_async(
                lambda: actor.registrations >= 2, "registering again after stale refusals", WAIT_S
            )
            assert broadcaster.serves(actor_id)
            learn.admission = "accepted"

    run(main())


@pytest.mark.timeout(120)
def test_a_restarted_learner_at_an_older_version_is_followed_not_its_predecessor() -> None:
    cfg = WeightSyncConfig()

    async def main() -> None:
        async with learner(cfg) as (learn, old, path), node() as (system, _):
            old.publish(_snapshot(5, cfg))
            actor = RolloutActor(_spec("r", path))
            await system.spawn(lambda: actor, name="rollout")
            await eventually_async(lambda: learn.versions, "fragments at version 5", WAIT_S)
            restarted = WeightBroadcaster(cfg, source="incarnation-2")
            restarted.publish(_snapshot(2, cfg))  # restored from an older checkpoint
            learn.broadcaster = restarted
            await eventually_async(
                lambda: learn.versions[-1] == 2, "fragments at the restored version 2", WAIT_S
            )
            await restarted.close()
            assert actor.registrations == 2
            sent = _model(HIDDEN, seed=2).state_dict()
            assert all(torch.equal(sent[k], v) for k, v in _weights(actor).items())

    run(main())


def test_buckets_are_sent_as_they_are_cut_and_equal_a_whole_build() -> None:
    """A transfer may start before the snapshot is filled: it waits bucket by bucket and gets
    exactly what a whole build holds (when each bucket is handed out is the scheduler's)."""
    cfg = WeightSyncConfig(bucket_mb=0.25)
    params = list(_model(HIDDEN, seed=3).state_dict().items())
    whole = WeightSnapshot.build(1, params, lambda t: t, cfg)

    async def main() -> list[tuple[np.ndarray, int]]:
        streamed = WeightSnapshot.plan_for(1, params, cfg)
        streamed.attach(asyncio.get_running_loop())
        assert streamed.manifest == whole.manifest

        async def consume() -> list[tuple[np.ndarray, int]]:
            got = []
            for index in range(len(streamed.buckets)):
                got.append(await streamed.bucket(index))
            return got

        consumer = asyncio.create_task(consume())
        await asyncio.to_thread(streamed.fill, params, lambda t: t)
        return await consumer

    got = run(main())
    assert len(got) == len(whole.buckets) > 2
    for (data, crc), expected, expected_crc in zip(got, whole.buckets, whole.checksums):
        assert np.array_equal(data, expected)
        assert crc == expected_crc


def test_a_fill_that_fails_ends_the_waiting_transfers() -> None:
    cfg = WeightSyncConfig(bucket_mb=0.25)
    params = list(_model(HIDDEN).state_dict().items())

    def broken(tensor: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a peer rank is gone")

    async def main() -> None:
        snapshot = WeightSnapshot.plan_for(1, params, cfg)
        snapshot.attach(asyncio.get_running_loop())
        waiting = asyncio.create_task(snapshot.bucket(len(snapshot.buckets) - 1))
        with pytest.raises(RuntimeError, match="peer rank is gone"):
            await asyncio.to_thread(snapshot.fill, params, broken)
        with pytest.raises(WeightSyncError, match="building version 1 failed"):
            await waiting

    run(main())
