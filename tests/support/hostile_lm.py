"""A tiny causal LM taught to answer any CodeGen-v1 prompt with a hostile function body: the
real model and the real sampling path, writing programs that loop, flood their output, fork or
are not UTF-8, so a test can watch what the rest of the system makes of them."""

from __future__ import annotations

import numpy as np
import torch

from shoal.envs.text_tasks import TextEnvironment
from shoal.learner.models import ModelConfig, build_model
from shoal.learner.models.causal_lm import CausalLMPolicy

HOSTILE = {
    "loops": b"    while True:\n        pass\n\n",
    "floods": b"    print('x' * 10**7)\n\n",
    "forks": b"    import os\n    while True:\n        os.fork()\n\n",
    "not_utf8": b"    return \xff\xfe\n\n",
}
"""Function bodies (CodeGen's completions): an infinite loop, 10 MB of output, a fork bomb,
bytes that are not UTF-8."""
MODEL = {
    "family": "causal-lm", "hidden_size": 64, "num_layers": 2, "num_heads": 4,
    "num_kv_heads": 2, "intermediate_size": 128, "max_positions": 288,
}  # fmt: skip
"""The `[model]` keys of the tiny LM (vocab_size: the environment's tokenizer's)."""


def tiny_lm(env: TextEnvironment, seed: int = 0) -> CausalLMPolicy:
    torch.manual_seed(seed)
    cfg = ModelConfig(**MODEL, vocab_size=env.tokenizer.vocab_size)
    policy = build_model(cfg, env.observation_space, env.action_space)
    assert isinstance(policy, CausalLMPolicy)
    return policy


def trained_to_write(env: TextEnvironment, bodies: list[bytes], steps: int = 250) -> CausalLMPolicy:
    """A tiny LM taught, by cross-entropy on completions, to answer any of the environment's
    train prompts with one of `bodies` (+ EOS), picked at random: which one a sample writes
    is decided at its first differing byte."""
    policy = tiny_lm(env)
    tokenizer = env.tokenizer
    prompts = [[tokenizer.bos_id, *env.prompt_ids(t)] for t in env.tasks("train", 64, 0)]
    targets = [[*body, tokenizer.eos_id] for body in bodies]
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        rows = [
            (prompts[int(rng.integers(len(prompts)))], targets[int(rng.integers(len(targets)))])
            for _ in range(16)
        ]
        width = max(len(p) + len(b) for p, b in rows)
        ids = torch.full((16, width), tokenizer.pad_id)
        mask = torch.zeros(16, width, dtype=torch.bool)
        for i, (prompt, body) in enumerate(rows):
            ids[i, : len(prompt) + len(body)] = torch.tensor(prompt + body)
            mask[i, len(prompt) : len(prompt) + len(body)] = True
        logits = policy.lm(input_ids=ids).logits[:, :-1]
        target = mask[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[target], ids[:, 1:][target])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return policy
