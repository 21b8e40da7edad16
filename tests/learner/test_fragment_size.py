"""Fragments that fit the transport: the pure horizon fit, its bound against the real wire
encoding, a Pong-sized collector that shortens its horizon, and rollout actors over real
sockets whose fragments are accepted, or which stop with the reason when they cannot send."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import astuple
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.envs.vector import make_vector
from shoal.learner.collector import Collector
from shoal.learner.fragment import Fragment
from shoal.learner.fragment_size import (
    MIB,
    FragmentTooLarge,
    StepLayout,
    fit_horizon,
    fitted_horizon,
)
from shoal.learner.models import ModelConfig, build_model
from shoal.learner.peers import Publication
from shoal.learner.rollout import RolloutActor, RolloutSpec
from shoal.learner.sequences import fragment_from_wire
from shoal.learner.weight_plan import WeightSyncConfig
from shoal.learner.weight_sync import WeightBroadcaster, WeightSnapshot
from shoal.runtime import wire
from shoal.runtime.actor import Actor
from shoal.runtime.loop import run
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import TransportConfig, attach
from tests.support.waiting import eventually_async

TOKEN = "fragment-size-test"
PONG = "gym:ALE/Pong-v5"
SMALL_MLP = {"family": "mlp", "hidden": [8]}
"""A tiny policy on raw Pong frames: float32 observations, 403,200 bytes per environment."""
FRAME = 16 * MIB
"""A frame limit two Pong environments overflow after 20 steps (the default 256 MiB would take
~650 MB of fragments in flight to show the same)."""
WAIT_S = 90.0


# -- the pure fit ---------------------------------------------------------------------------


@given(
    wanted=st.integers(1, 1 << 16),
    step=st.integers(1, 1 << 30),
    fixed=st.integers(0, 1 << 20),
    limit=st.integers(1, 1 << 32),
)
def test_the_fitted_horizon_is_the_longest_that_fits(
    wanted: int, step: int, fixed: int, limit: int
) -> None:
    horizon = fit_horizon(wanted, step, fixed, limit)
    assert 0 <= horizon <= wanted
    if horizon:
        assert fixed + horizon * step <= limit
    if horizon < wanted:
        assert fixed + (horizon + 1) * step > limit  # one more step would not fit
    assert (horizon == 0) == (fixed + step > limit)


@pytest.mark.parametrize(("wanted", "step", "fixed"), [(0, 1, 0), (1, 0, 0), (1, 1, -1)])
def test_nonsense_sizes_are_refused(wanted: int, step: int, fixed: int) -> None:
    with pytest.raises(ValueError, match="fit_horizon needs"):
        fit_horizon(wanted, step, fixed, 1024)


@st.composite
def _layouts(draw: st.DrawFn) -> StepLayout:
    """Any observation the wire carries, discrete (int64 [T, N]) or continuous actions."""
    action_shape, action_dtype = draw(
        st.sampled_from([((), np.int64), ((1,), np.float32), ((3,), np.float32)])
    )
    return StepLayout(
        num_envs=draw(st.integers(1, 6)),
        obs_shape=tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))),
        obs_dtype=np.dtype(draw(st.sampled_from([np.float32, np.uint8, np.int64]))),
        action_shape=action_shape,
        action_dtype=np.dtype(action_dtype),
    )


def _worst_fragment(layout: StepLayout, horizon: int) -> Fragment:
    """A fragment of `layout` in which every environment ends an episode at every step."""
    tn = (horizon, layout.num_envs)
    ended = horizon * layout.num_envs
    return Fragment(
        actor_id="rollout-0-0#" + "f" * 8, seq=2**40, policy_version=2**40, env_hash="h" * 64,
        obs=np.zeros((*tn, *layout.obs_shape), layout.obs_dtype),
        actions=np.zeros((*tn, *layout.action_shape), layout.action_dtype),
        logprobs=np.zeros(tn, np.float32), values=np.zeros(tn, np.float32),
        rewards=np.zeros(tn, np.float32), dones=np.ones(tn, bool), truncated=np.zeros(tn, bool),
        bootstrap_value=np.zeros(tn[1], np.float32), final_values=np.zeros(tn, np.float32),
        episode_returns=np.zeros(ended, np.float32), episode_lengths=np.ones(ended, np.int32),
        policy_source="s" * 64,
    )  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(layout=_layouts(), wanted=st.integers(1, 64), spare=st.integers(0, 4096))
def test_a_fitted_fragment_is_one_frame_under_the_limit(
    layout: StepLayout, wanted: int, spare: int
) -> None:
    """The size bound holds for the real encoding of a push (an ask envelope with a long path)."""
    limit = layout.frame_bytes(1) + spare * layout.step_bytes // 64
    horizon = fitted_horizon(wanted, layout, limit)
    payload = _worst_fragment(layout, horizon).to_wire()
    path = "shoal://127.0.0.1:65535/" + "l" * 200
    envelope = [1, 2**62, path, "push_fragment", [payload], {}, 600.0]
    assert wire.encode(envelope, limit).nbytes <= layout.frame_bytes(horizon) <= limit


def test_a_step_that_cannot_fit_names_the_sizes_and_the_fix() -> None:
    layout = StepLayout(4096, (20481,), np.dtype(np.float32), (), np.dtype(np.int64))
    with pytest.raises(FragmentTooLarge) as caught:
        fitted_horizon(32, layout, 256 * MIB)
    message = str(caught.value)
    assert "4096 environment(s)" in message
    assert "[20481]" in message
    assert "float32" in message
    assert "256.0 MiB (max_frame_bytes)" in message
    assert "at most 3274 environments per actor (--envs" in message
    fits = StepLayout(3274, (20481,), np.dtype(np.float32), (), np.dtype(np.int64))
    assert fitted_horizon(32, fits, 256 * MIB) == 1  # the advice is exact
    with pytest.raises(FragmentTooLarge):
        fitted_horizon(32, StepLayout(3275, *astuple(fits)[1:]), 256 * MIB)
    assert "--wrapper atari" in message
    one = StepLayout(1, (210, 160, 3), np.dtype(np.float32), (), np.dtype(np.int64))
    with pytest.raises(FragmentTooLarge, match="even one environment's observation is too big"):
        fitted_horizon(32, one, 256 * 1024)


def test_the_issues_pong_fragment_shrinks_to_the_default_frame_limit() -> None:
    """32 envs x 32 steps of float32 Pong frames were 413 MB, over 256 MiB: 20 steps fit."""
    pong = StepLayout(32, (210, 160, 3), np.dtype(np.float32), (), np.dtype(np.int64))
    assert pong.frame_bytes(32) > wire.DEFAULT_MAX_FRAME_BYTES
    assert fitted_horizon(32, pong, wire.DEFAULT_MAX_FRAME_BYTES) == 20
    uint8 = StepLayout(32, (210, 160, 3), np.dtype(np.uint8), (), np.dtype(np.int64))
    assert fitted_horizon(32, uint8, wire.DEFAULT_MAX_FRAME_BYTES) == 32  # 4x smaller: fits


# -- a Pong-sized collector -----------------------------------------------------------------


def _pong_collector(horizon: int, max_frame_bytes: int | None) -> Collector:
    env = make_vector(PONG, 2, seed=3)
    cfg = ModelConfig(family="mlp", hidden=(8,))
    policy = build_model(cfg, env.single_observation_space, env.single_action_space)
    return Collector("pong", env, policy, horizon, "hash", 3, max_frame_bytes)


def test_a_pong_sized_collector_shortens_its_horizon_to_the_frame_limit() -> None:
    collector = _pong_collector(64, FRAME)
    try:
        step = 2 * (210 * 160 * 3 * 4 + 8 + 26)  # float32 frames, int64 actions, the rest
        assert collector.layout.step_bytes == step
        assert collector.wanted_horizon == 64
        assert collector.horizon == (FRAME - collector.layout.fixed_bytes) // step == 20
        fragment = collector.collect()
        assert fragment.horizon == 20
        assert fragment.obs.dtype == np.float32
        envelope = [
            1,
            7,
            "shoal://127.0.0.1:1/learner",
            "push_fragment",
            [fragment.to_wire()],
            {},
            1.0,
        ]
        assert wire.encode(envelope, FRAME).nbytes <= FRAME
    finally:
        collector.env.close()
    unlimited = _pong_collector(4, None)
    try:
        assert unlimited.horizon == 4
    finally:
        unlimited.env.close()


# -- rollout actors over real sockets -------------------------------------------------------


class Learner(Actor):
    """A learner rank's serving half: registers actors, streams weights with the real
    broadcaster and takes fragments through the learner's own check (`fragment_from_wire`)."""

    def __init__(self, broadcaster: WeightBroadcaster) -> None:
        self.broadcaster = broadcaster
        self.fragments: list[Fragment] = []

    def register(self, actor_id: str, path: str) -> dict[str, Any]:
        self.broadcaster.add(actor_id, self.context.system.ref(path))
        source = self.broadcaster.source
        return {"incarnation": source, "version": 1, "source": source}

    def push_fragment(self, payload: Any) -> dict[str, Any]:
        fragment = fragment_from_wire(payload)
        assert isinstance(fragment, Fragment)
        self.fragments.append(fragment)
        return {"incarnation": self.broadcaster.source, "admission": "accepted"}

    def ping(self) -> None:
        """The rollout actor's link check."""


@contextlib.asynccontextmanager
async def _learner(frame: int) -> AsyncIterator[tuple[Learner, str]]:
    """A learner on its own system and transport (frame limit `frame`) holding version 1."""
    env = make_vector(PONG, 1, seed=0)
    policy = build_model(
        ModelConfig(family="mlp", hidden=(8,)),
        env.single_observation_space,
        env.single_action_space,
    )
    env.close()
    cfg = WeightSyncConfig()
    broadcaster = WeightBroadcaster(cfg, source="incarnation-1")
    broadcaster.publish(
        WeightSnapshot.build(
            1, list(policy.state_dict().items()), lambda t: t, cfg, max_frame_bytes=frame
        )
    )
    learner = Learner(broadcaster)
    async with ActorSystem() as system:
        transport = await attach(system, TransportConfig(token=TOKEN, max_frame_bytes=frame))
        await system.spawn(lambda: learner, name="learner")
        try:
            yield learner, f"{transport.address}/learner"
        finally:
            await broadcaster.close()
            await system.stop()
            await transport.close()


@contextlib.asynccontextmanager
async def _rollout(actor: RolloutActor, frame: int) -> AsyncIterator[None]:
    async with ActorSystem() as system:
        transport = await attach(system, TransportConfig(token=TOKEN, max_frame_bytes=frame))
        await system.spawn(lambda: actor, name="rollout")
        try:
            yield
        finally:
            await system.stop()
            await transport.close()


def _spec(learner_path: str, **changes: Any) -> RolloutSpec:
    fields: dict[str, Any] = {
        "name": "rollout-0-0", "env_id": PONG, "num_envs": 2, "horizon": 64, "seed": 5,
        "learner_path": learner_path, "model": SMALL_MLP, **changes,
    }  # fmt: skip
    return RolloutSpec(**fields)


@pytest.mark.timeout(180)
def test_a_pong_rollout_adapts_and_its_fragments_are_accepted_over_the_transport(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SHOAL_TASK_DIR", str(tmp_path))  # as a node daemon starts a worker
    caplog.set_level(logging.INFO, logger="shoal.learner.rollout")

    async def main() -> None:
        async with _learner(FRAME) as (learner, path):
            actor = RolloutActor(_spec(path), max_frame_bytes=FRAME)
            async with _rollout(actor, FRAME):
                await eventually_async(
                    lambda: len(learner.fragments) >= 2, "two Pong fragments accepted", WAIT_S
                )
            assert {f.horizon for f in learner.fragments} == {20}
            assert {f.policy_version for f in learner.fragments} == {1}
            assert actor.stats()["horizon"] == 20
            assert actor.stats()["error"] is None
            assert actor.registrations == 1

    run(main())
    published = json.loads((tmp_path / "published.json").read_text())
    assert published == {"role": "rollout", "horizon": 20, "horizon_asked": 64}
    adapted = [r.getMessage() for r in caplog.records if "frame limit" in r.getMessage()]
    assert len(adapted) == 1
    assert "64 steps x 2 envs" in adapted[0]
    assert "20 steps x 2 envs" in adapted[0]


@pytest.mark.timeout(180)
def test_a_fragment_the_transport_refuses_fails_the_worker_instead_of_retrying() -> None:
    """The actor is told a bigger limit than its transport has: its push is refused as too
    big, which ends the actor (and, with no node to publish to, its worker) at once."""

    async def main() -> None:
        async with _learner(FRAME // 2) as (learner, path):
            failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            actor = RolloutActor(_spec(path), failed, max_frame_bytes=FRAME)
            async with _rollout(actor, FRAME // 2):  # the learner's limit is FRAME // 2 too
                with pytest.raises(FragmentTooLarge) as caught:
                    await asyncio.wait_for(failed, WAIT_S)
            assert "its fragment of 20 steps x 2 envs cannot be sent" in str(caught.value)
            assert "--envs" in str(caught.value)
            assert learner.fragments == []
            assert actor.registrations == 1  # refused, not registered again and again
            assert actor.stats()["error"] == f"rollout-0-0: {caught.value}"

    run(main())


@pytest.mark.timeout(120)
def test_a_step_that_cannot_fit_is_published_as_the_worker_error_and_nothing_is_collected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHOAL_TASK_DIR", str(tmp_path))
    frame = 128 * 1024  # under one GridWorld size-64 observation (81,924 bytes) + envelope

    async def main() -> None:
        failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        publication = Publication(role="rollout")
        spec = _spec("shoal://127.0.0.1:1/learner", env_id="GridWorld-v1", env_kwargs={"size": 64})
        actor = RolloutActor(spec, failed, max_frame_bytes=frame, publication=publication)
        async with _rollout(actor, frame):
            assert actor.stats()["env_steps"] == 0
            assert actor.registrations == 0
        assert not failed.done()  # published instead: the job's driver ends the run

    run(main())
    error = json.loads((tmp_path / "published.json").read_text())["error"]
    assert error.startswith("rollout-0-0: one step of 2 environment(s) with float32")
    assert "even one environment's observation is too big" in error
