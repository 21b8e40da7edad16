"""The pre-flight check: the model a job would build, tried against the spaces of one copy of
its environment (wrapped as the workers wrap it) before any process starts.

Without it a mismatch (a cnn on vector observations, an MLP on raw Atari frames, a language
model on a control task, an action space no policy can output) is found by every learner rank
and rollout worker at start-up, and each crash-loops until the job's restart budget is spent.
Here it is one `PreflightError` (a TrainError: one line, exit 2) that names the reason and the
fix. The model built also sizes the fragments: a configuration where not even one step fits in
a transport frame is refused here too, and a horizon the actors will shorten is said up front.
`trainable` asks the same questions of an id with every default, for `shoal envs list`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shoal.errors import ShoalError
from shoal.rundir import TrainError

if TYPE_CHECKING:
    from gymnasium import spaces

    from shoal.learner.config import RolloutConfig
    from shoal.learner.models import ModelConfig, PolicyModel

NATURE_CNN_MIN = 36
"""The smallest image side the Nature CNN's three convolutions take (learner/models/cnn.py):
frames at least this big are what the cnn is for, and what an MLP must not flatten."""


class PreflightError(TrainError):
    """The job's model cannot train on its environment; the message says why and what to set."""


def mismatch(
    env_id: str,
    family: str,
    observation_space: spaces.Space[Any],
    action_space: spaces.Space[Any],
) -> str | None:
    """Why `family` cannot train on these spaces, with the fix, or None. Pure: the checks that
    have a better answer than the model's own error."""
    from shoal.learner.models.cnn import is_image_space

    shape = observation_space.shape
    if not shape:
        return (
            f"{env_id} observes {observation_space}, which has no fixed shape: shoal's policies "
            "need one; add a wrapper that gives one (e.g. --wrapper FlattenObservation)"
        )
    builtin = family in ("auto", "mlp", "cnn", "multi", "causal-lm")
    if builtin and not _acts_supported(action_space):
        return (
            f"{env_id} acts in {action_space}: shoal's policies output Discrete or 1-D Box "
            "actions; wrap the environment to one of those, or set your own model "
            "(model.family = 'package.module:factory')"
        )
    if family == "causal-lm" and not _token_ids(observation_space):
        return (
            f"model.family = 'causal-lm' reads token ids (a text environment, or integer "
            f"observations such as TokenRecall-v1's), and {env_id} observes "
            f"{observation_space}: use model.family = 'auto' for those"
        )
    if family == "cnn" and not is_image_space(observation_space):
        return (
            f"model.family = 'cnn' needs image observations (a 3-D uint8 Box such as Atari "
            f"frames); {env_id} observes {observation_space}: use model.family = 'auto'"
        )
    if (
        family == "mlp"
        and is_image_space(observation_space)
        and _frame_side(shape) >= NATURE_CNN_MIN
    ):
        size = int(observation_space.sample().size)
        return (
            f"model.family = 'mlp' would flatten {env_id}'s {'x'.join(map(str, shape))} frames "
            f"into {size:,} inputs of one dense layer, which does not learn from pixels: use "
            "model.family = 'auto' (the Nature CNN), with --preset atari for an ALE game"
        )
    return None


def _acts_supported(action_space: spaces.Space[Any]) -> bool:
    from gymnasium import spaces as gym_spaces

    return isinstance(action_space, gym_spaces.Discrete) or (
        isinstance(action_space, gym_spaces.Box) and len(action_space.shape) == 1
    )


def _frame_side(shape: tuple[int, ...]) -> int:
    """The shorter spatial side of an [H, W, C] or [C, H, W] image (the cnn's reading)."""
    first, second, last = shape
    channels_last = last < first and last < second
    return min(first, second) if channels_last else min(second, last)


def check_spaces(
    env_id: str,
    model: ModelConfig,
    observation_space: spaces.Space[Any],
    action_space: spaces.Space[Any],
) -> PolicyModel:
    """Refuse (PreflightError) a model that cannot train on these spaces: the known mismatches
    by name, anything else by building the model once, as every rank will (a causal LM on the
    meta device: however big, it costs no memory here). Returns the model built (its
    observation dtype sizes the fragments: `check_fragment`)."""
    import torch

    from shoal.learner.errors import PolicyError
    from shoal.learner.materialize import build_policy

    reason = mismatch(env_id, model.family, observation_space, action_space)
    if reason is not None:
        raise PreflightError(reason)
    try:  # a causal LM as a learner builds it: shapes only, its directory's names checked
        return build_policy(model, observation_space, action_space, torch.device("cpu"))
    except (PolicyError, TypeError) as exc:
        raise PreflightError(
            f"model.family = {model.family!r} cannot be built for {env_id} (observations "
            f"{observation_space}, actions {action_space}): {exc}"
        ) from None


def check_fragment(
    rollout: RolloutConfig,
    policy: PolicyModel,
    action_space: spaces.Space[Any],
    max_frame_bytes: int | None = None,
) -> str | None:
    """The horizon each rollout actor will use, as the actor computes it (learner/fragment_size.py):
    PreflightError when not even one step of `rollout.num_envs` environments fits in a frame of
    `max_frame_bytes` (default: the rollout workers' transport's), with the sizes and the fix; one
    line saying the horizon asked and the one used when it is shortened; None when it fits."""
    from shoal.learner.fragment_size import (
        FragmentTooLarge,
        fitted_horizon,
        shortened,
        step_layout,
    )
    from shoal.runtime.wire import DEFAULT_MAX_FRAME_BYTES

    max_frame_bytes = max_frame_bytes or DEFAULT_MAX_FRAME_BYTES
    layout = step_layout(rollout.num_envs, policy.obs_shape, policy.obs_dtype, action_space)
    try:
        horizon = fitted_horizon(rollout.horizon, layout, max_frame_bytes)
    except FragmentTooLarge as exc:
        raise PreflightError(str(exc)) from None
    if horizon == rollout.horizon:
        return None
    reason = shortened(rollout.horizon, horizon, layout, max_frame_bytes)
    return f"rollout.horizon: {rollout.horizon} asked, {horizon} used: {reason}"


def trainable(env_id: str) -> str:
    """Why `shoal train <env_id>` with every default (the auto preset, the auto model) would be
    refused, or "" when it would start: `shoal envs list`'s "trains" column."""
    from shoal.envs.vector import make_vector
    from shoal.learner.config import TrainConfig
    from shoal.learner.presets import apply_preset
    from shoal.learner.text_job import is_text_job

    if is_text_job(env_id):
        return ""  # the token path: a causal LM built for the tokenizer (learner/text_job.py)
    try:
        cfg = apply_preset(TrainConfig(env_id=env_id), set())
        env = make_vector(env_id, 1, seed=0, env=cfg.env)
        try:
            spaces_of = (env.single_observation_space, env.single_action_space)
        finally:
            env.close()
        policy = check_spaces(env_id, cfg.model, *spaces_of)
        check_fragment(cfg.rollout, policy, spaces_of[1])
    except ShoalError as exc:
        return str(exc)
    return ""


def _token_ids(space: spaces.Space[Any]) -> bool:
    """Integer vector observations: token ids a causal LM can read (the model checks the range)."""
    from gymnasium import spaces as gym_spaces

    dtype = getattr(space, "dtype", None)
    return isinstance(space, gym_spaces.Box) and dtype is not None and dtype.kind in "iu"
