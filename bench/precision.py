"""`shoal bench precision`: what bfloat16 saves on this CPU, per policy family, beside float32
measured in the same run.

Three places use it: a rollout worker's forward with `rollout.precision = "bfloat16"` (the
policy cast by `PolicyModel.run_in`), a CPU learner's PPO update under bf16 autocast
(`learner.mixed_precision`, which shoal applies only to families that declare `cpu_autocast`
and only on a CPU with bf16 instructions: the rows for the other families show why), and the
language-model pipeline's SFT and distillation steps (`pipeline.mixed_precision`, on such a
CPU: the causal-LM rows, at the pipeline's model sizes). Each
figure is thread CPU time per call with one torch thread, so the machine's load matters less;
the variants alternate in rounds and the median round counts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from gymnasium import spaces

from shoal.bench.report import Row
from shoal.learner.cpu_features import native_bf16
from shoal.learner.distill import lm_logits, pack, sft_loss
from shoal.learner.fragment import Fragment
from shoal.learner.models import ModelConfig, build_model
from shoal.learner.models.base import PolicyModel
from shoal.learner.ppo import PPOConfig, PPOLearner

PONG = spaces.Box(0, 255, (4, 84, 84), np.uint8)
MINATAR = spaces.Box(0, 255, (10, 10, 4), np.uint8)
CARTPOLE = spaces.Box(-np.inf, np.inf, (4,), np.float32)
MUJOCO = spaces.Box(-np.inf, np.inf, (17,), np.float32)


@dataclass(frozen=True)
class Case:
    """One family's shapes: an update trains on a fragment of `steps` x `envs`."""

    name: str
    obs_space: spaces.Box
    action_space: spaces.Space[Any]
    steps: int
    envs: int


CASES = (
    Case("Nature CNN, Pong frames", PONG, spaces.Discrete(6), 32, 8),
    Case("MinAtar CNN, 10x10 grids", MINATAR, spaces.Discrete(3), 32, 8),
    Case("MLP, CartPole", CARTPOLE, spaces.Discrete(2), 32, 8),
    Case("MLP, HalfCheetah", MUJOCO, spaces.Box(-1, 1, (6,), np.float32), 32, 8),
)


@dataclass(frozen=True)
class LMCase:
    """A Qwen2 causal LM's sizes; a step trains on 32 CodeGen-v1-long examples in bytes."""

    name: str
    hidden: int
    layers: int
    intermediate: int


LM_CASES = (
    LMCase("0.25M, the pipeline's default student", 96, 2, 256),
    LMCase("0.42M, the pipeline's default teacher", 128, 2, 336),
    LMCase("1.3M", 192, 3, 512),
    LMCase("3.1M", 256, 4, 704),
)
LM_VOCAB, LM_PROMPT, LM_COMPLETION, LM_BATCH = 259, 73, 24, 32
"""The byte tokenizer's vocabulary and CodeGen-v1's mean prompt and reference lengths in it."""


def _observations(space: spaces.Box, shape: tuple[int, ...], rng: np.random.Generator) -> Any:
    if space.dtype == np.uint8:
        return rng.integers(0, 256, (*shape, *space.shape), dtype=np.uint8)
    return rng.normal(size=(*shape, *space.shape)).astype(np.float32)


def _fragment(case: Case, policy: PolicyModel, rng: np.random.Generator) -> Fragment:
    t, n = case.steps, case.envs
    obs = _observations(case.obs_space, (t, n), rng)
    actions = np.stack([policy.act(row)[0] for row in obs])
    return Fragment(
        actor_id="bench", seq=0, policy_version=0, env_hash="bench", obs=obs, actions=actions,
        logprobs=np.full((t, n), -1.0, np.float32), values=np.zeros((t, n), np.float32),
        rewards=rng.normal(size=(t, n)).astype(np.float32), dones=np.zeros((t, n), bool),
        truncated=np.zeros((t, n), bool), bootstrap_value=np.zeros(n, np.float32),
        final_values=np.zeros((t, n), np.float32), episode_returns=np.zeros(0, np.float32),
        episode_lengths=np.zeros(0, np.int32),
    )  # fmt: skip


def _cpu_ms(call: Callable[[], object], repeats: int) -> float:
    started = time.thread_time()
    for _ in range(repeats):
        call()
    return (time.thread_time() - started) / repeats * 1e3


def _alternating(
    calls: dict[str, Callable[[], object]], repeats: int, rounds: int
) -> dict[str, float]:
    """The median over `rounds` of each call's CPU ms, the calls taking turns each round."""
    for call in calls.values():
        call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name].append(_cpu_ms(call, repeats))
    return {name: statistics.median(values) for name, values in samples.items()}


def _act_rows(case: Case, repeats: int, rounds: int) -> list[Row]:
    torch.manual_seed(0)
    full = build_model(ModelConfig(), case.obs_space, case.action_space)
    half = build_model(ModelConfig(), case.obs_space, case.action_space).run_in("bfloat16")
    half.set_weights(full.get_weights())
    obs = _observations(case.obs_space, (case.envs // 2,), np.random.default_rng(0))
    ms = _alternating(
        {"bf16": lambda: half.act(obs), "fp32": lambda: full.act(obs)}, repeats, rounds
    )
    metric = f"{case.name}: act on {case.envs // 2}, rollout.precision bfloat16"
    return [Row(metric, "CPU ms", ms["bf16"], ms["fp32"], "float32", False)]


def _update_rows(case: Case, repeats: int, rounds: int) -> list[Row]:
    torch.manual_seed(0)
    policy = build_model(ModelConfig(), case.obs_space, case.action_space)
    fragment = _fragment(case, policy, np.random.default_rng(1))
    cfg = PPOConfig(update_epochs=1, num_minibatches=4)

    def update(autocast: bool) -> Callable[[], object]:
        def context() -> contextlib.AbstractContextManager[object]:
            return torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)

        learner = PPOLearner(policy, cfg, policy, context)
        return lambda: learner.update([fragment], 0)

    ms = _alternating({"bf16": update(True), "fp32": update(False)}, repeats, rounds)
    applied = "applied" if policy.cpu_autocast and native_bf16() else "not applied"
    metric = (
        f"{case.name}: PPO epoch, minibatches of {case.steps * case.envs // 4}, "
        f"bf16 autocast ({applied} by shoal here)"
    )
    return [Row(metric, "CPU ms", ms["bf16"], ms["fp32"], "float32", False)]


def _sft_rows(case: LMCase, repeats: int, rounds: int) -> list[Row]:
    from shoal.learner.lm_config import qwen2_sizes
    from shoal.learner.lm_pipeline import policy_spaces
    from shoal.learner.models.causal_lm import CausalLMPolicy

    torch.manual_seed(0)
    sizes = qwen2_sizes(case.hidden, case.layers, 4, case.intermediate)
    policy = build_model(replace(sizes, vocab_size=LM_VOCAB), *policy_spaces(LM_VOCAB, 512))
    assert isinstance(policy, CausalLMPolicy)
    rng = np.random.default_rng(2)
    batch = pack(
        [rng.integers(3, LM_VOCAB, LM_PROMPT).tolist() for _ in range(LM_BATCH)],
        [rng.integers(3, LM_VOCAB, LM_COMPLETION).tolist() for _ in range(LM_BATCH)],
        pad_id=0,
    )
    optimizer = torch.optim.AdamW(policy.lm.parameters(), lr=1e-4)

    def step(autocast: bool) -> Callable[[], object]:
        def once() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = sft_loss(lm_logits(policy.lm, batch), batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        return once

    ms = _alternating({"bf16": step(True), "fp32": step(False)}, repeats, rounds)
    applied = "where it measures faster" if native_bf16() else "not"
    metric = (
        f"causal LM {case.name}: SFT step of {LM_BATCH} x {LM_PROMPT + LM_COMPLETION} tokens, "
        f"bf16 autocast (applied by the pipeline here: {applied})"
    )
    return [Row(metric, "CPU ms", ms["bf16"], ms["fp32"], "float32", False)]


def run(quick: bool) -> list[Row]:
    """Every case's act row and update row, and the causal LMs' SFT step rows where the `lm`
    extra is installed; `quick` takes a handful of calls (shape only)."""
    torch.set_num_threads(1)
    act_repeats, update_repeats, rounds = (3, 1, 1) if quick else (200, 5, 5)
    rows: list[Row] = []
    for case in CASES:
        rows.extend(_act_rows(case, act_repeats, rounds))
        rows.extend(_update_rows(case, update_repeats, rounds))
    if importlib.util.find_spec("transformers") is not None:  # the `lm` extra
        for lm_case in LM_CASES[: 1 if quick else None]:
            rows.extend(_sft_rows(lm_case, update_repeats, rounds))
    return rows
