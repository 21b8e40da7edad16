"""The collector's pipelined path over the Atari C++ vector's halves (learner/collector.py):
fragments identical to the sequential path's for the same seeds and a deterministic policy
(sticky actions on: each copy's emulator depends on its own seed and actions alone), weights
adopted mid-fragment never mixing versions within a group's row, an abandoned fragment's step
dropped, and no emulator thread left after closing mid-fragment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch
from gymnasium import spaces

from shoal.envs.ale_vector import AleVector
from shoal.envs.atari import AtariOptions
from shoal.envs.vector import make_vector
from shoal.envs.wrappers import EnvConfig
from shoal.learner.collector import Collector
from shoal.learner.fragment import Fragment
from shoal.learner.models.base import PolicyModel

pytest.importorskip("ale_py.vector_env", reason="ale-py 0.10+ (the envs extra) is not installed")

GAME = "ALE/Breakout-v5"  # lives (done before a game ends), sticky actions (v5: 0.25)
ATARI = EnvConfig(wrappers=({"name": "atari", "kwargs": {}},))
LIMIT = {"max_episode_steps": 120}  # 30 steps of 4 frames: a truncation inside the test


class FramePolicy(PolicyModel):
    """Actions, log-probs and values that are exact functions of each frame stack and the
    weights' version, so two collectors agree bit for bit whatever batches they act in; the
    log-prob is minus the version, so a fragment shows which version acted on each entry."""

    family = "test-frames"

    def __init__(self, obs_space: spaces.Space[Any], action_space: spaces.Space[Any]) -> None:
        super().__init__(obs_space, action_space, np.uint8)
        self.version = 0
        self.batches: list[int] = []

    def _sums(self, obs: np.ndarray) -> np.ndarray:
        return obs.reshape(len(obs), -1).sum(axis=1, dtype=np.int64)

    def act(
        self, obs: np.ndarray, deterministic: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self.batches.append(len(obs))
        sums = self._sums(obs)
        actions = (sums // 7 + self.version) % self.action_dim
        logp = np.full(len(obs), -float(self.version), dtype=np.float32)
        return actions.astype(np.int64), logp, self.value(obs)

    def value(self, obs: np.ndarray) -> np.ndarray:
        return ((self._sums(obs) % 1009) / 1009 + self.version).astype(np.float32)

    def set_weights(self, weights: Mapping[str, np.ndarray | torch.Tensor]) -> None:
        self.version = int(weights["version"])


def _collector(groups: int, pipeline: bool, num_envs: int = 4, seed: int = 9) -> Collector:
    vec = AleVector(GAME, num_envs, AtariOptions(), LIMIT, seed=seed, groups=groups)
    policy = FramePolicy(vec.single_observation_space, vec.single_action_space)
    return Collector("t", vec, policy, 16, "hash", seed=seed, pipeline=pipeline)


def _weights(version: int) -> dict[str, torch.Tensor]:
    return {"version": torch.tensor(version)}


def _assert_same(a: Fragment, b: Fragment) -> None:
    wire_a, wire_b = a.to_wire(), b.to_wire()
    assert wire_a.keys() == wire_b.keys()
    for key, value in wire_a.items():
        if isinstance(value, np.ndarray):
            assert value.dtype == wire_b[key].dtype, key
            assert np.array_equal(value, wire_b[key]), key
        else:
            assert value == wire_b[key], key


@pytest.mark.parametrize(("groups", "num_envs"), [(2, 4), (3, 5)])
def test_pipelined_fragments_are_the_sequential_paths(groups: int, num_envs: int) -> None:
    sequential = _collector(1, pipeline=False, num_envs=num_envs)
    grouped = _collector(groups, pipeline=False, num_envs=num_envs)  # the vector's own `step`
    pipelined = _collector(groups, pipeline=True, num_envs=num_envs)
    assert not sequential.pipelined
    assert not grouped.pipelined
    assert pipelined.pipelined
    ends = truncations = 0
    try:
        for k in range(3):  # 48 steps: fragment boundaries, life losses, a time limit at 30
            if k == 1:  # a new version between fragments
                for c in (sequential, grouped, pipelined):
                    c.set_weights(1, _weights(1))
            expected = sequential.collect()
            _assert_same(expected, grouped.collect())
            _assert_same(expected, pipelined.collect())
            ends += int(expected.dones.sum())
            truncations += int(expected.truncated.sum())
        assert truncations == num_envs  # every copy cut once, its final value written
        assert ends >= truncations
        policy = pipelined.policy
        assert isinstance(policy, FramePolicy)
        sizes = {rows.stop - rows.start for rows in pipelined.env.groups}  # type: ignore[attr-defined]
        assert set(policy.batches) == sizes  # each group acted on alone, never across groups
    finally:
        for c in (sequential, grouped, pipelined):
            c.env.close()


def test_weights_arriving_mid_fragment_never_mix_versions_within_a_groups_row() -> None:
    collector = _collector(2, pipeline=True)
    try:
        buf = collector.new_buffers()
        start = collector.policy_version
        for t in range(collector.horizon):
            if t in (5, 11):  # between steps, as the rollout actor adopts them
                collector.set_weights(collector.policy_version + 1, _weights(t // 5))
            collector.step(buf, t)
        fragment = collector.finish(buf, start)
    finally:
        collector.env.close()
    versions = -fragment.logprobs  # [T, N]: the version that acted on each entry
    first, second = slice(0, 2), slice(2, 4)
    for t in range(fragment.horizon):
        for rows in (first, second):
            assert len(set(versions[t, rows].tolist())) == 1  # one version per group's row
    assert (versions >= fragment.policy_version).all()  # the fragment's version is the oldest
    assert (np.diff(versions, axis=0) >= 0).all()
    # The second group acts with a new version from the next row on; the first group's next row
    # was already stepping, so it follows one row later.
    assert versions[5, second].tolist() == [1, 1]
    assert versions[5, first].tolist() == [0, 0]
    assert versions[6, first].tolist() == [1, 1]
    assert versions[11, second].tolist() == [2, 2]
    assert versions[11, first].tolist() == [1, 1]
    assert versions[12, first].tolist() == [2, 2]
    # Each action is the policy's for the frames recorded with it (the trajectory is the env's).
    sums = fragment.obs.reshape(*fragment.obs.shape[:2], -1).sum(axis=2, dtype=np.int64)
    assert np.array_equal(fragment.actions, (sums // 7 + versions.astype(np.int64)) % 4)


def test_a_fragment_abandoned_mid_way_drops_its_step_and_the_next_one_continues() -> None:
    collector = _collector(2, pipeline=True)
    try:
        buf = collector.new_buffers()
        for t in range(5):
            collector.step(buf, t)  # the first group's row 5 is stepping when it is abandoned
        fragment = collector.collect()  # starts over at row 0 from where the copies are
    finally:
        collector.env.close()
    # A frame stack shifts by one frame a step: the second group is one step on from row 4,
    # the first two (its step in flight was received and dropped, not recorded).
    assert np.array_equal(fragment.obs[0, 2:, :3], buf.obs[4, 2:, 1:])
    assert np.array_equal(fragment.obs[0, :2, :2], buf.obs[4, :2, 2:])
    assert not np.array_equal(fragment.obs[0, :2, :3], buf.obs[4, :2, 1:])


def test_closing_mid_fragment_ends_the_step_in_flight_and_joins_every_thread() -> None:
    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    before = threads()
    vec = make_vector(f"gym:{GAME}", 4, seed=0, env=ATARI)
    assert isinstance(vec, AleVector)
    assert len(vec.groups) == 2
    policy = FramePolicy(vec.single_observation_space, vec.single_action_space)
    collector = Collector("t", vec, policy, 16, "hash", seed=0, pipeline=True)
    assert collector.pipelined
    buf = collector.new_buffers()
    collector.step(buf, 0)  # leaves the first group's row 1 in flight
    assert threads() > before
    vec.close()
    assert threads() == before


@pytest.mark.parametrize("pipeline", [False, True])
def test_the_jobs_rollout_pipeline_reaches_the_actors_collector(pipeline: bool) -> None:
    """`rollout.pipeline` travels job config -> job.json spec -> the actor's collector; off by
    default, since it pays only with a spare core (docs/envs.md)."""
    from dataclasses import replace

    from shoal.learner.config import RolloutConfig, TrainConfig
    from shoal.learner.job import rollout_specs
    from shoal.learner.models import ModelConfig
    from shoal.learner.rollout import _close, _collector
    from shoal.learner.rollout_main import spec_from_json

    assert RolloutConfig().pipeline is False
    cfg = replace(TrainConfig(), env=ATARI, rollout=RolloutConfig(num_envs=2, pipeline=pipeline))
    (entry,) = rollout_specs(cfg, f"gym:{GAME}", 0)
    spec = spec_from_json(entry)
    assert spec.pipeline is pipeline
    collector = _collector(spec, "t", ModelConfig(), 1 << 28)
    try:
        assert isinstance(collector, Collector)
        assert collector.pipelined is pipeline
    finally:
        _close(collector)
