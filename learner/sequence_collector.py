"""`SequenceCollector`: a text environment's prompts, sampled by a causal LM, cut into
`SequenceFragment`s, with the duck-typed interface of `Collector` (learner/collector.py) so the
rollout actor drives either one.

A batch is `rows` completions: `rows / group_size` prompts drawn from the environment's train
split, each sampled `group_size` times, so a GRPO group (one prompt's samples) always stays in
one fragment. `new_buffers` draws the prompts and prefills them (learner/generation.py), each
`step` is one KV-cache decode step for the whole batch (the actor yields to its event loop
between steps, which is when weights arrive), and `finish` closes the batch.

Rewards. `finish` hands the batch's completions to ONE `score_many` call (one batched sandbox
call for code) on the collector's scoring thread and returns at once with a `PendingSequences`;
the actor awaits its fragment inside the push, so the sandbox runs while the next batch
generates. The thread only runs the environment's scoring (subprocesses and string work, no
torch), one batch at a time, in order. A program that loops, floods its output, forks or is not
valid UTF-8 is the sandbox's to confine: it comes back as a score of 0 with its status, and the
collector goes on.

Weights that arrive mid-batch follow `SamplingConfig.weight_arrival` (learner/generation.py):
"interrupt" loads them at once and resumes the batch on them (`Generator.swap`, later tokens
stamped with the new version); "finish" holds them until the batch's last token and loads them
in `finish`. Either way each token carries the version that sampled it and the fragment's
`policy_version` is the oldest of them (what the intake's staleness bound reads).
"""

from __future__ import annotations

import asyncio
import zlib
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shoal.learner.errors import LearnerError
from shoal.learner.fragment import Fragment
from shoal.learner.generation import Completions, Generation, Generator, SamplingConfig
from shoal.learner.models.causal_lm import CausalLMPolicy
from shoal.learner.sequences import SequenceFragment

Weights = Mapping[str, np.ndarray | torch.Tensor]
"""A complete policy version, as the actor receives it or a caller hands it over."""


def prompt_ids(task: Any, env: Any) -> list[int]:
    """A task's prompt as the policy reads it: BOS, then the environment's ids for it (the
    pipeline's encoding; a prompt longer than the environment allows is its error)."""
    return [int(env.tokenizer.bos_id), *env.prompt_ids(task)]


@dataclass
class SequenceBuffers:
    """One batch under construction: its tasks, their prompts and the generation state."""

    tasks: list[Any]
    prompts: list[list[int]]
    groups: np.ndarray
    generation: Generation


class PendingSequences:
    """A finished batch whose rewards the scoring thread is computing; `result()` (or awaiting
    `wait()`) gives its `SequenceFragment`. `seq` is known at once, for the actor's ledger."""

    def __init__(self, seq: int, future: Future[SequenceFragment]) -> None:
        self.seq = seq
        self.future = future

    def result(self) -> SequenceFragment:
        return self.future.result()

    async def wait(self) -> SequenceFragment:
        return await asyncio.wrap_future(self.future)


async def settled(item: Fragment | SequenceFragment | PendingSequences) -> Any:
    """The fragment to send: `item` itself, or a pending batch's once it is scored."""
    return await item.wait() if isinstance(item, PendingSequences) else item


class SequenceCollector:
    """Owns a text environment, a causal-LM policy copy and its generator; one caller at a time
    (the rollout actor's loop), plus the scoring thread it feeds."""

    def __init__(
        self,
        actor_id: str,
        env: Any,
        policy: CausalLMPolicy,
        sampling: SamplingConfig,
        rows: int,
        group_size: int,
        env_hash: str,
        seed: int = 0,
    ) -> None:
        if group_size < 1 or rows < group_size or rows % group_size:
            raise LearnerError(
                f"{rows} rows per fragment cannot hold whole groups of {group_size}: use a "
                "multiple of the group size (rollout.num_envs, text.group_size)"
            )
        self.actor_id = actor_id
        self.env = env
        self.policy = policy
        self.sampling = sampling
        self.rows = rows
        self.group_size = group_size
        self.env_hash = env_hash
        self.horizon = sampling.max_new_tokens
        self.generator = Generator(policy, env.tokenizer, sampling, seed=seed)
        self.policy_version = 0
        self.policy_source = ""
        self.seq = 0
        self.env_steps = 0
        self.statuses: Counter[str] = Counter()
        """Scores by status (passed, timeout, output_limit, ...), for the actor's stats."""
        self._rng = np.random.default_rng(seed)
        self._salt = (zlib.crc32(actor_id.encode()) & 0x7FFFFFFF) << 32
        self._batches = 0
        self._current: Generation | None = None
        self._held: tuple[int, Weights, str] | None = None
        self._scoring = ThreadPoolExecutor(1, thread_name_prefix=f"score-{actor_id[:16]}")

    # -- weights -------------------------------------------------------------------------

    def set_weights(self, version: int, weights: Weights, source: str = "") -> None:
        """Adopt a complete version: at once (resuming a running batch on it, "interrupt"),
        or, with "finish" while a batch runs, once that batch's last token is sampled."""
        running = self._current is not None and not self._current.done
        if running and self.sampling.weight_arrival == "finish":
            self._held = (version, weights, source)
            return
        self._load(version, weights, source)
        if running and self._current is not None:
            self.generator.swap(self._current, version)

    def _load(self, version: int, weights: Weights, source: str) -> None:
        self.policy.set_weights(weights)
        self.policy_version = version
        self.policy_source = source
        self._held = None

    # -- the batch -----------------------------------------------------------------------

    def new_buffers(self) -> SequenceBuffers:
        """Draw the batch's prompts and prefill them with the current weights."""
        count = self.rows // self.group_size
        tasks = list(self.env.tasks("train", count, int(self._rng.integers(2**31))))
        if len(tasks) != count:
            raise LearnerError(
                f"the environment gave {len(tasks)} tasks for {count} asked: it must draw "
                "with replacement when its split is small"
            )
        rows = [task for task in tasks for _ in range(self.group_size)]
        prompts = [prompt_ids(task, self.env) for task in rows]
        first = self._salt + self._batches * count
        groups = np.repeat(np.arange(first, first + count, dtype=np.int64), self.group_size)
        self._batches += 1
        with torch.no_grad():
            self._current = self.generator.start(prompts, self.policy_version)
        return SequenceBuffers(rows, prompts, groups, self._current)

    def step(self, buf: SequenceBuffers, t: int) -> None:
        """One decode step for every unfinished row (nothing once all have finished)."""
        self.generator.step(buf.generation)

    def finish(self, buf: SequenceBuffers, version: int) -> PendingSequences:
        """Close the batch: its completions go to the scoring thread; held weights load now.
        `version` is unused: the fragment's version is the oldest stamped on its tokens."""
        while self.generator.step(buf.generation):  # a caller that stopped early
            pass
        done = self.generator.result(buf.generation)
        self._current = None
        if self._held is not None:
            self._load(*self._held)
        seq, source = self.seq, self.policy_source
        self.seq += 1
        self.env_steps += int(done.lengths.sum())
        future = self._scoring.submit(self._score, buf, done, seq, source)
        return PendingSequences(seq, future)

    def collect(self) -> SequenceFragment:
        """One whole scored fragment with the current policy (the synchronous form)."""
        buf = self.new_buffers()
        for t in range(self.horizon):
            self.step(buf, t)
        return self.finish(buf, self.policy_version).result()

    def close(self) -> None:
        """Stop the scoring thread (a batch being scored is abandoned) and the environment."""
        self._scoring.shutdown(wait=False, cancel_futures=True)
        self.env.close()

    # -- on the scoring thread -----------------------------------------------------------

    def _score(
        self, buf: SequenceBuffers, done: Completions, seq: int, source: str
    ) -> SequenceFragment:
        scores = self.env.score_many(buf.tasks, done.texts)
        rewards = np.asarray([s.reward for s in scores], dtype=np.float32)
        self.statuses.update(str(s.status) for s in scores)
        return assemble(
            self.actor_id, seq, source, self.env_hash, buf, done, rewards, self.generator.pad_id
        )


def assemble(
    actor_id: str,
    seq: int,
    source: str,
    env_hash: str,
    buf: SequenceBuffers,
    done: Completions,
    rewards: np.ndarray,
    pad_id: int,
) -> SequenceFragment:
    """Prompt + completion rows, right-padded with `pad_id`, as a fragment (array
    operations: row i's prompt and completion land where the masks say)."""
    prompt_lengths = np.asarray([len(p) for p in buf.prompts], dtype=np.int32)
    lengths = done.lengths.astype(np.int32)
    width = int((prompt_lengths + lengths).max())
    position = np.arange(width)[None, :]
    start = prompt_lengths.astype(np.int64)[:, None]
    in_prompt = position < start
    in_completion = (position >= start) & (position < start + lengths[:, None])
    sampled = np.arange(done.tokens.shape[1])[None, :] < lengths[:, None]
    tokens = np.full((len(buf.prompts), width), pad_id, dtype=np.int64)
    tokens[in_prompt] = np.concatenate([np.asarray(p, dtype=np.int64) for p in buf.prompts])
    tokens[in_completion] = done.tokens[sampled]
    logprobs = np.zeros(tokens.shape, dtype=np.float32)
    logprobs[in_completion] = done.logprobs[sampled]
    values = np.zeros(tokens.shape, dtype=np.float32)
    values[in_completion] = done.values[sampled]
    versions = np.full(tokens.shape, -1, dtype=np.int32)
    versions[in_completion] = done.versions[sampled]
    return SequenceFragment(
        actor_id=actor_id,
        seq=seq,
        policy_version=int(versions[in_completion].min()),
        env_hash=env_hash,
        tokens=tokens,
        prompt_lengths=prompt_lengths,
        completion_lengths=lengths,
        logprobs=logprobs,
        versions=versions,
        values=values,
        rewards=rewards,
        groups=buf.groups,
        policy_source=source,
    )
