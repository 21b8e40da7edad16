"""Stage 3: asynchronous RL of a causal-LM policy on a text environment's rewards, in-process.

Two threads share the work the cluster spreads over machines. The *generation worker* owns a
copy of the policy and a `SequenceCollector` (learner/sequence_collector.py): it samples
`group_size` completions for each of `prompts_per_step` train prompts, has them scored by the
environment's batched `score_many` on the collector's scoring thread (the sandbox runs while the
next batch generates) and puts the scored `SequenceFragment` into a bounded queue. The *learner*
(the calling thread) takes one fragment per update and runs `PPOLearner`'s token update
(learner/token_ppo.py: GRPO or token PPO with the decoupled, capped IS correction), then hands
the new weights to the worker, which adopts them before its next batch.

Staleness bound: the worker may start batch b only once the learner has made version
b - max_staleness, and it always adopts the newest weights before starting; so the batch the
learner consumes at version b was sampled by version >= b - max_staleness. With 0 the loop is
synchronous (generate, then update); with 1 generation of the next batch overlaps the update.

Prompts: the worker draws them from the environment's "rl" pool split where it has one
(CodeGen-v1: parameter values supervised training never saw, so reward comes from copying k from
the statement, not recalling it), else from "train" (`PromptPool`).

Validation: given a `validate` function (policy -> validation pass@1), the learner scores the
starting policy and then every `val_every` updates and the last, and leaves the policy holding
the best-scoring weights, the starting ones unless an update beat them
(learner/lm_validation.py). The worker keeps generating while the learner validates.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch

from shoal.learner.errors import PipelineError
from shoal.learner.generation import SamplingConfig
from shoal.learner.lm_config import RLStageConfig
from shoal.learner.lm_validation import BestByValidation, pool_split
from shoal.learner.models.causal_lm import CausalLMPolicy
from shoal.learner.ppo import PPOConfig, PPOLearner
from shoal.learner.sequence_collector import SequenceCollector
from shoal.learner.sequences import SequenceFragment

WAIT_S = 0.05
"""How often a blocked thread looks whether the other one failed."""


class PromptPool:
    """The environment as the RL collector sees it: its "train" draws come from `split`, every
    other attribute is the environment's. The collector (learner/sequence_collector.py) draws
    its prompts from "train", the split the cluster's text jobs train on."""

    def __init__(self, env: Any, split: str) -> None:
        self.env = env
        self.split = split

    def tasks(self, split: str = "train", count: int = 64, seed: int = 0) -> list[Any]:
        return self.env.tasks(self.split if split == "train" else split, count, seed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)


class _Versions:
    """The learner's version and its newest weights, shared with the worker (thread-safe)."""

    def __init__(self, weights: dict[str, np.ndarray]) -> None:
        self.version = 0
        self.weights = weights
        self.failed: BaseException | None = None
        self.stopped = False
        self._cond = threading.Condition()

    def publish(self, version: int, weights: dict[str, np.ndarray]) -> None:
        with self._cond:
            self.version, self.weights = version, weights
            self._cond.notify_all()

    def stop(self, error: BaseException | None = None) -> None:
        with self._cond:
            self.stopped = True
            self.failed = self.failed or error
            self._cond.notify_all()

    def wait_for(self, version: int) -> tuple[int, dict[str, np.ndarray]] | None:
        """The newest (version, weights) once the learner reached `version`; None if stopped."""
        with self._cond:
            while self.version < version and not self.stopped:
                self._cond.wait(WAIT_S)
            return None if self.stopped else (self.version, self.weights)


def _worker(
    collector: SequenceCollector,
    shared: _Versions,
    out: queue.Queue[SequenceFragment],
    cfg: RLStageConfig,
) -> None:
    """Generate `cfg.steps` batches; batch b waits for learner version b - max_staleness."""
    try:
        pending = None
        for b in range(cfg.steps):
            if pending is not None and shared.version < b - cfg.max_staleness:
                # the learner needs the scored batch before it can open the gate for this one
                _put(out, pending.result(), shared)
                pending = None
            latest = shared.wait_for(b - cfg.max_staleness)
            if latest is None:
                return
            if latest[0] != collector.policy_version:
                collector.set_weights(latest[0], latest[1])
            buf = collector.new_buffers()
            with torch.no_grad():
                for t in range(collector.horizon):
                    collector.step(buf, t)
            ready = collector.finish(buf, collector.policy_version)
            if pending is not None:
                _put(out, pending.result(), shared)
            pending = ready
        if pending is not None:
            _put(out, pending.result(), shared)
    except BaseException as exc:  # handed to the learner thread, which re-raises it
        shared.stop(exc)


def _put(out: queue.Queue[SequenceFragment], item: SequenceFragment, shared: _Versions) -> None:
    while not shared.stopped:
        try:
            out.put(item, timeout=WAIT_S)
            return
        except queue.Full:
            continue


def _take(
    out: queue.Queue[SequenceFragment], shared: _Versions, worker: threading.Thread
) -> SequenceFragment:
    while True:
        try:
            return out.get(timeout=WAIT_S)
        except queue.Empty:
            if shared.failed is not None:
                raise PipelineError(
                    f"the generation worker failed: {shared.failed}"
                ) from shared.failed
            if not worker.is_alive() and out.empty():
                raise PipelineError("the generation worker stopped before its last batch") from None


def train_rl(
    policy: CausalLMPolicy,
    env: Any,
    env_hash: str,
    cfg: RLStageConfig,
    *,
    seed: int,
    validate: Callable[[CausalLMPolicy], float] | None = None,
    forward: Callable[[], AbstractContextManager[object]] = nullcontext,
) -> dict[str, Any]:
    """Train `policy` in place for `cfg.steps` updates on the device it is on (the worker's
    copy samples there too; each update's forward passes run inside `forward()`); returns the
    run's metrics (reward curve, staleness, statuses, throughput, and with `validate` the
    validation curve and the step whose weights the policy holds at the end)."""
    token = cfg.token
    sampling = SamplingConfig(temperature=token.temperature, max_new_tokens=cfg.max_new_tokens,
                              stop=tuple(env.stop), weight_arrival="finish")  # fmt: skip
    actor = copy.deepcopy(policy).eval()
    prompts = PromptPool(env, pool_split(env, "rl"))
    collector = SequenceCollector("pipeline-rl", prompts, actor, sampling,
                                  rows=cfg.prompts_per_step * token.group_size,
                                  group_size=token.group_size, env_hash=env_hash, seed=seed)  # fmt: skip
    learner = PPOLearner(policy, PPOConfig(lr=token.lr, adam_eps=token.adam_eps),
                         forward_context=forward)  # fmt: skip
    learner.token_cfg = token
    shared = _Versions(policy.get_weights())
    out: queue.Queue[SequenceFragment] = queue.Queue(maxsize=cfg.queue_size)
    worker = threading.Thread(target=_worker, args=(collector, shared, out, cfg),
                              name="rl-generation", daemon=True)  # fmt: skip
    started = time.perf_counter()
    curve: list[float] = []
    lags: list[float] = []
    statuses: Counter[str] = Counter()
    tokens = 0
    metrics: dict[str, float] = {}
    best = BestByValidation()
    kept = _validated(policy, validate, best, 0, shared.weights, None)
    worker.start()
    try:
        for version in range(cfg.steps):
            fragment = _take(out, shared, worker)
            lags.append(float(version - fragment.policy_version))
            curve.append(float(fragment.rewards.mean()))
            tokens += fragment.num_steps
            policy.train()
            metrics = learner.update([fragment], current_version=version)
            policy.eval()
            weights = policy.get_weights()
            shared.publish(version + 1, weights)
            if (version + 1) % cfg.val_every == 0 or version + 1 == cfg.steps:
                kept = _validated(policy, validate, best, version + 1, weights, kept)
    finally:
        shared.stop()
        worker.join()
        statuses.update(collector.statuses)
        collector.close()
    wall = time.perf_counter() - started
    if kept is not None:
        policy.set_weights(kept)
    keep = ("policy_loss", "approx_kl", "clipfrac", "entropy", "is_weight_mean", "value_loss")
    return {
        "updates": cfg.steps,
        "prompt_split": prompts.split,
        "samples": cfg.steps * cfg.prompts_per_step * token.group_size,
        "reward_curve": _smooth(curve),
        "reward_first5": _mean(curve[:5]),
        "reward_last5": _mean(curve[-5:]),
        "max_staleness_seen": max(lags, default=0.0),
        "mean_staleness": _mean(lags),
        "statuses": dict(statuses.most_common()),
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        **{f"last_{k}": float(metrics[k]) for k in keep if k in metrics},
        **(best.summary() if validate is not None else {}),
    }


def _validated(
    policy: CausalLMPolicy,
    validate: Callable[[CausalLMPolicy], float] | None,
    best: BestByValidation,
    step: int,
    weights: dict[str, np.ndarray],
    kept: dict[str, np.ndarray] | None,
) -> dict[str, np.ndarray] | None:
    """Score the policy (as of `step`, holding `weights`); the weights to keep after it."""
    if validate is None:
        return kept
    return weights if best.record(step, validate(policy)) else kept


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if values else float("nan")


def _smooth(curve: Sequence[float], points: int = 20) -> list[float]:
    """The reward curve averaged into at most `points` buckets (the manifest stays small)."""
    if not curve:
        return []
    return [
        float(np.mean(chunk))
        for chunk in np.array_split(np.asarray(curve), min(points, len(curve)))
    ]
