"""What a text environment changes in a training job (CodeGen-v1, CodeExec-v1, Countdown-v1).

A text environment (envs/text_tasks.py) is not stepped: its rollout actors sample whole
completions and score them in batches (learner/sequence_collector.py), and its learner trains
a causal LM on `SequenceFragment`s. `resolve` turns a job for one into what every task of the
job runs with, before any process starts: the model family `auto` becomes `causal-lm` with
the tokenizer's vocabulary, and the keys that must agree (groups that fit a fragment, prompts
that fit the model's positions) are checked here, each as a ConfigError naming the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.errors import ConfigError

if TYPE_CHECKING:
    from gymnasium import spaces

    from shoal.learner.config import TextConfig, TrainConfig
    from shoal.learner.models import PolicyModel
    from shoal.learner.rollout import RolloutSpec
    from shoal.learner.sequence_collector import SequenceCollector


def is_text_job(env_id: str) -> bool:
    """Whether `env_id` names a text environment (trained through the token path)."""
    from shoal.envs.text_registry import is_text_env

    return is_text_env(env_id)


def make_env(env_id: str, text: TextConfig, env_kwargs: dict[str, Any]) -> Any:
    """The job's text environment, with its tokenizer and completion length."""
    from shoal.envs.errors import EnvError
    from shoal.envs.text_registry import make_text_env

    try:
        return make_text_env(
            env_id, tokenizer=text.tokenizer, max_new_tokens=text.max_new_tokens, **env_kwargs
        )
    except EnvError as exc:
        raise ConfigError(f"env_kwargs {env_kwargs!r} don't fit {env_id}: {exc}") from None


def resolve(cfg: TrainConfig) -> tuple[str, TrainConfig]:
    """(the environment's canonical id, `cfg` as the tasks of a text job run it): a causal-lm
    model sized to the tokenizer, every key the token path needs checked against the
    environment."""
    env = make_env(cfg.env_id, cfg.text, cfg.env_kwargs)
    env_id = str(env.name)
    try:
        vocab = int(env.tokenizer.vocab_size)
        length = int(env.observation_space.shape[0]) + 1  # BOS + prompt + completion
    finally:
        env.close()
    model = cfg.model
    if model.family == "auto":
        model = dataclasses.replace(model, family="causal-lm", vocab_size=vocab)
    if model.family != "causal-lm":
        raise ConfigError(
            f"model.family = {model.family!r} cannot write text: {env_id} needs 'causal-lm' "
            "(or leave it 'auto')"
        )
    if not model.path and model.vocab_size < vocab:
        raise ConfigError(
            f"model.vocab_size = {model.vocab_size} is invalid: the tokenizer "
            f"{cfg.text.tokenizer!r} has {vocab} ids"
        )
    if not model.path and model.max_positions < length:
        raise ConfigError(
            f"model.max_positions = {model.max_positions} is invalid: {env_id}'s longest prompt "
            f"plus text.max_new_tokens = {cfg.text.max_new_tokens} needs {length}"
        )
    rows, group = cfg.rollout.num_envs, cfg.token.group_size
    if rows % group:
        raise ConfigError(
            f"rollout.num_envs = {rows} is invalid with token.group_size = {group}: each "
            "fragment holds whole groups, so use a multiple of the group size"
        )
    return env_id, dataclasses.replace(cfg, model=model)


def job_spaces(env_id: str, cfg: TrainConfig) -> tuple[spaces.Space[Any], spaces.Space[Any]]:
    """The (observation, action) spaces the job's policy is built for, for either kind of
    environment: a text environment's token spaces, or a probe vector's."""
    if is_text_job(env_id):
        env = make_env(env_id, cfg.text, cfg.env_kwargs)
        env.close()
        return env.observation_space, env.action_space
    from shoal.envs.vector import make_vector

    probe = make_vector(env_id, 1, seed=cfg.seed, env=cfg.env, **cfg.env_kwargs)
    try:
        return probe.single_observation_space, probe.single_action_space
    finally:
        probe.close()


def text_collector(
    spec: RolloutSpec, actor_id: str, build: Callable[..., PolicyModel]
) -> SequenceCollector:
    """A rollout actor's collector for a text job: its environment and a policy built by
    `build(observation_space, action_space)`, sampling as the spec's `text` and `token` say."""
    from shoal.config import load
    from shoal.learner.config import TextConfig
    from shoal.learner.errors import PolicyError
    from shoal.learner.models.causal_lm import CausalLMPolicy
    from shoal.learner.sequence_collector import SequenceCollector
    from shoal.learner.token_config import TokenRLConfig

    text = load(TextConfig, spec.text, source="the rollout spec", environ={})
    token = load(TokenRLConfig, spec.token, source="the rollout spec", environ={})
    env = make_env(spec.env_id, text, dict(spec.env_kwargs))
    try:
        policy = build(env.observation_space, env.action_space)
        if not isinstance(policy, CausalLMPolicy):
            raise PolicyError(
                f"{spec.env_id} is written by a causal-lm policy, not {policy.family or 'custom'}"
            )
        sampling = text.sampling(token.temperature, tuple(env.stop))
        collector = SequenceCollector(
            actor_id,
            env,
            policy,
            sampling,
            rows=spec.num_envs,
            group_size=token.group_size,
            env_hash=env.digest(),
            seed=spec.seed,
        )
    except BaseException:
        env.close()
        raise
    return collector


EVAL_SAMPLES = 4
"""Completions per task in the end-of-run evaluation: pass@1 and pass@4 by the unbiased
estimator (learner/lm_eval.py)."""


def evaluate_checkpoint(
    path: Path, env_id: str, cfg: TrainConfig, out_dir: Path, seed: int
) -> tuple[float, Path, Path]:
    """The end-of-run evaluation of a text job: the checkpoint's policy writes EVAL_SAMPLES
    completions (at the training temperature) for `eval.episodes` tasks of each held-out
    split (the train split where the environment has no other), scored in one batch per split;
    returns (the first split's mean reward, report.json, report.html)."""
    from shoal.learner.lm_eval import evaluate_policy, write_report
    from shoal.learner.lm_sampling import sampler_for
    from shoal.train import load_policy

    policy, _, info = load_policy(path)
    env = make_env(env_id, cfg.text, cfg.env_kwargs)
    try:
        splits = [s for s in env.splits if s != "train"] or ["train"]
        tasks = {s: env.tasks(s, cfg.eval.episodes, seed) for s in splits}
        sampling = cfg.text.sampling(cfg.token.temperature, tuple(env.stop))
        sample = sampler_for(policy, env, sampling, seed=seed)
        results = {"policy": evaluate_policy(env, tasks, sample, EVAL_SAMPLES, (1, EVAL_SAMPLES))}
        meta = {"env_id": env_id, "env_hash": env.digest(), "checkpoint": str(info.path)}
        json_path, html_path = write_report(results, meta, out_dir)
    finally:
        env.close()
    return results["policy"][splits[0]].mean_reward, json_path, html_path
