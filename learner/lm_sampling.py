"""A policy as an evaluation `Sampler`: n completions per task through the KV-cache Generator.

Prompts are encoded the way every stage encodes them (BOS + prompt,
learner/sequence_collector.py's `prompt_ids`), repeated n times and generated in batches of `BATCH_ROWS` rows so memory stays
flat however many tasks a split has.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shoal.learner.generation import Generator, SamplingConfig
from shoal.learner.lm_config import EvalStageConfig
from shoal.learner.lm_eval import Sampler
from shoal.learner.models.causal_lm import CausalLMPolicy
from shoal.learner.sequence_collector import prompt_ids

BATCH_ROWS = 128
"""Rows generated together: large enough to amortise each decode step's Python overhead on a
CPU, small enough that the KV cache stays a few MB for a few-M-parameter model."""


def sampler(policy: CausalLMPolicy, env: Any, cfg: EvalStageConfig, *, seed: int) -> Sampler:
    """n completions per task at `cfg.temperature` (top-p 1), at most `cfg.max_new_tokens`,
    ending at EOS or the environment's stop strings."""
    sampling = SamplingConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                              stop=tuple(env.stop))  # fmt: skip
    return sampler_for(policy, env, sampling, seed=seed)


def sampler_for(
    policy: CausalLMPolicy, env: Any, sampling: SamplingConfig, *, seed: int
) -> Sampler:
    """n completions per task with `sampling`, generated BATCH_ROWS rows at a time."""
    policy.eval()
    generator = Generator(policy, env.tokenizer, sampling, seed=seed)

    def sample(tasks: Sequence[Any], n: int) -> list[list[str]]:
        prompts = [prompt_ids(task, env) for task in tasks for _ in range(n)]
        texts: list[str] = []
        with torch.no_grad():
            for start in range(0, len(prompts), BATCH_ROWS):
                texts.extend(generator.generate(prompts[start : start + BATCH_ROWS], 0).texts)
        return [texts[i * n : (i + 1) * n] for i in range(len(tasks))]

    return sample
