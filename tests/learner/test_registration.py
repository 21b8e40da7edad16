"""A learner rank's `register` and `subscribe` over a real socket: malformed requests and an
unreachable shard-group peer get a specific refusal (not a crash or a restarted actor), and
the rank then serves the next rollout actor its weights."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from shoal.learner.config import TrainConfig
from shoal.learner.group import GroupSpec, LearnerGroup
from shoal.learner.learner_main import LearnerActor
from shoal.learner.trainer import LearnerCore
from shoal.learner.weight_assembler import WeightAssembler
from shoal.ports import free_port
from shoal.runtime.actor import Actor
from shoal.runtime.loop import run
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import Transport, TransportConfig, attach
from tests.support.waiting import eventually_async

TOKEN = "registration-test"


class Receiver(Actor):
    """What a rollout actor does with weights, without collecting: assemble them."""

    def __init__(self, core: LearnerCore) -> None:
        self.assembler = WeightAssembler(core.policy.state_dict())
        self.versions: list[int] = []

    def weights_begin(self, version: int, manifest: dict[str, Any]) -> None:
        self.assembler.begin(version, manifest)

    def weights_bucket(self, version: int, part: int, index: int, data: Any, crc: int) -> None:
        self.assembler.bucket(version, part, index, data, crc)

    def weights_commit(self, version: int, part: int) -> None:
        if self.assembler.commit(version, part) is not None:
            self.versions.append(version)


@contextlib.asynccontextmanager
async def node() -> AsyncIterator[tuple[ActorSystem, Transport]]:
    async with ActorSystem() as system:
        transport = await attach(system, TransportConfig(token=TOKEN))
        try:
            yield system, transport
        finally:
            await system.stop()
            await transport.close()


@pytest.fixture
def core(tmp_path: Path) -> Iterator[LearnerCore]:
    core = LearnerCore(TrainConfig(), "CartPole-v1", LearnerGroup(GroupSpec()), tmp_path)
    yield core
    core.checkpoints.close()


MALFORMED = [
    (None, "receiver"),
    ("actor", None),
    ("a" * 5000, "receiver"),
    ("actor", "r" * 5000),
    ("actor", "shoal://no host/x"),
    (7, 8),
]


def test_malformed_registrations_are_refused_and_the_next_actor_is_served(
    core: LearnerCore,
) -> None:
    async def main() -> None:
        await core.stream(0)
        async with node() as (learners, transport), node() as (workers, _):
            await learners.spawn(LearnerActor, core, name="learner")
            receiver = Receiver(core)
            ref = await workers.spawn(lambda: receiver, name="receiver")
            learner = workers.ref(f"{transport.address}/learner")
            for actor_id, path in MALFORMED:
                reply = await learner.ask(timeout=30).register(actor_id, path)
                assert set(reply) == {"incarnation", "error"}, reply
            await learner.tell.subscribe(None, ["not", "a", "path"])
            reply = await learner.ask(timeout=30).register("rollout-0#1", ref.path)
            assert reply == {"incarnation": core.incarnation, "version": 0,
                             "source": core.weights.source}  # fmt: skip
            await eventually_async(lambda: receiver.versions == [0], "version 0 at the receiver")
            assert list(core.actors) == ["rollout-0#1"]
        await core.weights.close()

    run(main())


def test_a_shard_group_peer_that_cannot_be_told_refuses_the_registration(
    core: LearnerCore,
) -> None:
    core.publishers = [f"shoal://127.0.0.1:{free_port()}/learner"]  # nobody listens there

    async def main() -> None:
        await core.stream(0)
        async with node() as (learners, transport), node() as (workers, _):
            await learners.spawn(LearnerActor, core, name="learner")
            ref = await workers.spawn(lambda: Receiver(core), name="receiver")
            learner = workers.ref(f"{transport.address}/learner")
            reply = await learner.ask(timeout=60).register("rollout-0#1", ref.path)
            assert set(reply) == {"incarnation", "error"}, reply
            assert not core.actors  # nothing half registered: the actor registers again
            assert await learner.ask(timeout=30).status()
        await core.weights.close()

    run(main())
