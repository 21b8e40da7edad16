"""The text rollout collector: CodeGen-v1 prompts sampled by a real (tiny) causal LM, scored in the
real sandbox, cut into SequenceFragments; weights arriving mid-batch; and a model trained to write
hostile programs, whose every sample scores 0 while the collector keeps producing."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from shoal.envs.codegen import CodeGenEnv
from shoal.learner.generation import SamplingConfig
from shoal.learner.models.causal_lm import CausalLMPolicy
from shoal.learner.sequence_collector import SequenceCollector, prompt_ids
from shoal.learner.sequences import SequenceFragment, fragment_from_wire
from tests.support.hostile_lm import HOSTILE, tiny_lm, trained_to_write

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 64


@pytest.fixture(scope="module")
def env() -> Iterator[CodeGenEnv]:
    with CodeGenEnv(max_new_tokens=MAX_NEW, workers=1) as made:
        yield made


def _policy(env: CodeGenEnv, seed: int = 0) -> CausalLMPolicy:
    return tiny_lm(env, seed)


def _collector(
    env: CodeGenEnv, policy: CausalLMPolicy, arrival: str = "finish", max_new: int = 16
) -> SequenceCollector:
    sampling = SamplingConfig(max_new_tokens=max_new, stop=env.stop, weight_arrival=arrival)
    return SequenceCollector(
        "actor-a", env, policy, sampling, rows=8, group_size=4,
        env_hash=env.digest(), seed=3,
    )  # fmt: skip


def _prompts(fragment: SequenceFragment) -> list[tuple[int, ...]]:
    return [tuple(row[:n].tolist()) for row, n in zip(fragment.tokens, fragment.prompt_lengths)]


def test_fragments_hold_whole_groups_with_the_contract_shapes(env: CodeGenEnv) -> None:
    collector = _collector(env, _policy(env))
    first, second = collector.collect(), collector.collect()
    assert (first.seq, second.seq) == (0, 1)
    assert first.num_envs == 8
    assert first.env_hash == env.digest()
    assert first.tokens.dtype == np.int64
    assert first.tokens.shape[0] == 8
    assert (first.completion_lengths <= 16).all()
    assert collector.env_steps == first.num_steps + second.num_steps
    for fragment in (first, second):
        prompts = _prompts(fragment)
        ids, counts = np.unique(fragment.groups, return_counts=True)
        assert len(ids) == 2
        assert (counts == 4).all()
        for group in ids:
            rows = np.flatnonzero(fragment.groups == group)
            assert len({prompts[r] for r in rows}) == 1  # a group is one prompt's samples
        assert ((fragment.rewards >= 0) & (fragment.rewards <= 1)).all()
        assert fragment.policy_version == 0
        assert (fragment.versions[fragment.completion_mask()] == 0).all()
    assert not set(first.groups) & set(second.groups)  # group ids never repeat
    again = fragment_from_wire(first.to_wire(), env.tokenizer.vocab_size)
    assert isinstance(again, SequenceFragment)
    np.testing.assert_array_equal(again.tokens, first.tokens)
    collector.close()


def test_prompts_are_bos_then_the_environments_ids(env: CodeGenEnv) -> None:
    task = env.tasks("train", 1, 0)[0]
    assert prompt_ids(task, env) == [env.tokenizer.bos_id, *env.prompt_ids(task)]


@pytest.mark.parametrize("arrival", ["finish", "interrupt"])
def test_weights_arriving_mid_batch(env: CodeGenEnv, arrival: str) -> None:
    policy = _policy(env)
    collector = _collector(env, policy, arrival, max_new=24)
    newer = _policy(env, seed=1).state_dict()
    # Greedy-free check of where each mode puts the new version: every row runs >= 2 steps
    # unless it stops at once, so swap after the first step.
    buf = collector.new_buffers()
    collector.step(buf, 0)
    collector.set_weights(1, newer, "learner-x")
    for t in range(1, collector.horizon):
        collector.step(buf, t)
    fragment = collector.finish(buf, 0).result()
    stamps = fragment.versions[fragment.completion_mask()]
    assert fragment.policy_version == 0  # the oldest stamp
    assert collector.policy_version == 1  # adopted by the end of the batch either way
    for name, value in newer.items():
        torch.testing.assert_close(policy.state_dict()[name], value)
    if arrival == "finish":
        assert (stamps == 0).all()
    else:
        first_tokens = fragment.versions[np.arange(8), fragment.prompt_lengths]
        assert (first_tokens == 0).all()
        longer = fragment.completion_lengths > 1
        assert (stamps == 1).any() == bool(longer.any())
    following = collector.collect()
    assert following.policy_version == 1
    assert following.policy_source == "learner-x"
    collector.close()


def test_hostile_programs_score_zero_and_the_collector_keeps_producing(env: CodeGenEnv) -> None:
    policy = trained_to_write(env, list(HOSTILE.values()))
    collector = _collector(env, policy, max_new=MAX_NEW)
    seen: set[str] = set()
    fragments = 0
    while seen != set(HOSTILE) and fragments < 8:
        fragment = collector.collect()
        fragments += 1
        assert fragment.seq == fragments - 1
        for row in range(fragment.num_envs):
            start = int(fragment.prompt_lengths[row])
            written = bytes(
                t for t in fragment.tokens[row, start:].tolist() if t < 256
            )  # the sampled bytes, EOS and padding left out
            kind = next((k for k, body in HOSTILE.items() if written == body), None)
            if kind is not None:
                seen.add(kind)
                assert fragment.rewards[row] == 0, (kind, collector.statuses)
    assert seen == set(HOSTILE), f"the model wrote only {seen} in {fragments} fragments"
    statuses = set(collector.statuses)
    assert {"output_limit", "syntax_error"} <= statuses
    # The loop spends its 1 s of CPU before the 2 s wall limit on an idle core, not under load.
    assert statuses & {"timeout", "cpu_limit"}
    after = collector.collect()  # still producing
    assert after.seq == fragments
    collector.close()
