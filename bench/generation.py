"""`shoal bench generation`: generated tokens/s of the KV-cache `Generator` beside HF `generate`
on the same model, the same prompts and the same max_new_tokens, in the same run; and what a
weight swap mid-batch (the "interrupt" mode) costs beside finishing on the old weights.

The model is a byte-level Qwen2 of a few million parameters built from its config (nothing is
downloaded), bigger than the default CodeGen student (0.25M, sized for two CPU cores:
docs/pipeline.md), so the decode step's matrix work weighs as it does in a real recipe. Both sides sample from the plain softmax
(temperature 1, top-p 1, HF's top-k off) or decode greedily, and never stop early (EOS is held
back on both sides), so each generates exactly batch x max_new_tokens tokens. Rounds alternate
shoal and HF so load from other work on a shared machine hits both; medians are reported.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from gymnasium import spaces

from shoal.bench.report import Row
from shoal.envs.tokenizer import ByteTokenizer
from shoal.learner.generation import Generator, SamplingConfig
from shoal.learner.models import CausalLMPolicy, ModelConfig, build_model

_PROMPTS = (
    "def add_three(x):\n    # return x plus 3\n",
    "def is_even(n):\n",
    "def count_vowels(s):\n    # how many of s's characters are vowels\n",
    "def first(xs):\n",
    "def clamp(x, low, high):\n    # x held between low and high\n",
    "def rev(s):\n",
)


@dataclass(frozen=True)
class Size:
    """The model and the batch one bench run measures."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    batch: int
    new_tokens: int
    rounds: int


FULL = Size(256, 4, 4, 2, 688, batch=16, new_tokens=64, rounds=3)
"""About 3M parameters (the default CodeGen student is 0.25M)."""
QUICK = Size(32, 1, 2, 1, 64, batch=4, new_tokens=8, rounds=1)


def build_policy(size: Size) -> CausalLMPolicy:
    vocab = ByteTokenizer().vocab_size
    cfg = ModelConfig(
        family="causal-lm",
        arch="qwen2",
        vocab_size=vocab,
        hidden_size=size.hidden,
        num_layers=size.layers,
        num_heads=size.heads,
        num_kv_heads=size.kv_heads,
        intermediate_size=size.intermediate,
        max_positions=512,
    )
    obs = spaces.Box(0, vocab - 1, shape=(256,), dtype=np.int64)
    policy = build_model(cfg, obs, spaces.Discrete(vocab))
    assert isinstance(policy, CausalLMPolicy)
    return policy.eval()


def _prompts(batch: int) -> list[list[int]]:
    tokenizer = ByteTokenizer()
    return [tokenizer.encode(_PROMPTS[n % len(_PROMPTS)]) for n in range(batch)]


def _sampling(size: Size, greedy: bool) -> SamplingConfig:
    return SamplingConfig(
        temperature=0.0 if greedy else 1.0, max_new_tokens=size.new_tokens, stop_at_eos=False
    )


class _Clock:
    """Wall and CPU seconds since it started: torch runs on one thread here, so this process's
    CPU time is the work itself, far less disturbed than wall time by other load on the machine."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def _shoal_run(
    policy: CausalLMPolicy, prompts: list[list[int]], cfg: SamplingConfig
) -> tuple[float, float]:
    """(tokens/s, CPU seconds per token) of one `Generator.generate`."""
    generator = Generator(policy, ByteTokenizer(), cfg, seed=0)
    clock = _Clock()
    done = generator.generate(prompts, version=0)
    wall, cpu = clock.read()
    tokens = int(done.lengths.sum())
    return tokens / wall, cpu / tokens


def _hf_run(
    policy: CausalLMPolicy, prompts: list[list[int]], size: Size, greedy: bool
) -> tuple[float, float]:
    """(tokens/s, CPU seconds per token) of one HF `generate` on the same left-padded batch."""
    from transformers import GenerationMixin

    lm = policy.lm
    assert isinstance(lm, GenerationMixin)  # every HF causal LM is one
    tokenizer = ByteTokenizer()
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_id] * (width - len(p)) + p for p in prompts])
    mask = (ids != tokenizer.pad_id).long()
    sampling = {} if greedy else {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    clock = _Clock()
    with torch.no_grad():
        out = lm.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=size.new_tokens,
            min_new_tokens=size.new_tokens,
            do_sample=not greedy,
            eos_token_id=tokenizer.eos_id,
            pad_token_id=tokenizer.pad_id,
            use_cache=True,
            **sampling,
        )
    wall, cpu = clock.read()
    tokens = (out.shape[1] - width) * len(prompts)
    return tokens / wall, cpu / tokens


def _swap_run(policy: CausalLMPolicy, prompts: list[list[int]], size: Size) -> dict[str, float]:
    """One batch that swaps at its midpoint, in CPU seconds: the swap, the median decode step,
    the remaining steps (what "finish" spends before new weights sample) and the whole batch
    per token."""
    generator = Generator(policy, ByteTokenizer(), _sampling(size, greedy=False), seed=0)
    half = size.new_tokens // 2
    batch = _Clock()
    state = generator.start(prompts, version=0)
    steps = []
    for _ in range(half):
        clock = _Clock()
        generator.step(state)
        steps.append(clock.read()[1])
    clock = _Clock()
    generator.swap(state, version=1)
    swap = clock.read()[1]
    while generator.step(state):
        pass
    tokens = int(generator.result(state).lengths.sum())
    step = statistics.median(steps)
    return {
        "swap": swap,
        "step": step,
        "rest": step * (size.new_tokens - half),
        "per_token": batch.read()[1] / tokens,
    }


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def measure(size: Size) -> list[Row]:
    """The table for one size (tests run it at a tiny one)."""
    torch.manual_seed(0)
    policy = build_policy(size)
    prompts = _prompts(size.batch)
    runs: dict[str, list[tuple[float, float]]] = {}
    swaps: list[dict[str, float]] = []
    _shoal_run(policy, prompts, _sampling(size, greedy=False))  # warm-up: first-call costs
    _hf_run(policy, prompts, size, greedy=False)
    cases = (("sample", prompts, False), ("greedy", prompts, True), ("one", prompts[:1], False))
    for _ in range(size.rounds):
        for key, batch, greedy in cases:
            runs.setdefault(key, []).append(_shoal_run(policy, batch, _sampling(size, greedy)))
            runs.setdefault(f"hf_{key}", []).append(_hf_run(policy, batch, size, greedy))
        swaps.append(_swap_run(policy, prompts, size))
    shape = f"batch {size.batch}, {size.new_tokens} new tokens"
    rate = {k: statistics.median(r for r, _ in v) for k, v in runs.items()}
    cpu = {k: statistics.median(c for _, c in v) * 1e3 for k, v in runs.items()}
    rest = size.new_tokens - size.new_tokens // 2
    return [
        Row(f"tokens/s, sampling T=1, {shape}", "1/s", rate["sample"], rate["hf_sample"],
            "HF generate(do_sample)", True),
        Row(f"tokens/s, greedy, {shape}", "1/s", rate["greedy"], rate["hf_greedy"],
            "HF generate(greedy)", True),
        Row(f"tokens/s, sampling T=1, batch 1, {size.new_tokens} new tokens", "1/s", rate["one"],
            rate["hf_one"], "HF generate(do_sample)", True),
        Row(f"CPU per token, sampling T=1, {shape}", "ms", cpu["sample"], cpu["hf_sample"],
            "HF generate(do_sample)", False),
        Row(f"CPU until new weights sample, mid-batch arrival, {shape}", "ms",
            _median(swaps, "swap") * 1e3, _median(swaps, "rest") * 1e3,
            f"finish: the remaining {rest} steps", False),
        Row(f"CPU per token with one mid-batch swap, {shape}", "ms",
            _median(swaps, "per_token") * 1e3, cpu["sample"], "the same batch, no swap", False),
        Row(f"swap cost in decode steps (CPU), {shape}", "steps",
            _median(swaps, "swap") / _median(swaps, "step"), None, "-", False),
    ]  # fmt: skip


def run(quick: bool) -> list[Row]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on a shared CPU: one thread per side, both sides
    try:
        return measure(QUICK if quick else FULL)
    finally:
        torch.set_num_threads(threads)
