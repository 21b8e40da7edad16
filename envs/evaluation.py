"""Multi-dimensional evaluation of a policy: performance, generalisation and robustness.

Episodes run on a `VectorEnvironment` (auto-resetting), so a batched policy is called once per
step for all environments. Each environment slot owns a fixed quota of the requested episodes,
which keeps the estimate unbiased: counting the first N episodes to finish would favour short
ones. Every result carries the environment hash, so two reports can be told apart or matched.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium import spaces

from shoal.envs import report_html
from shoal.envs.errors import EnvError
from shoal.errors import ConfigError

if TYPE_CHECKING:
    from shoal.envs.wrappers import EnvConfig

Policy = Callable[[np.ndarray], np.ndarray]
Progress = Callable[[str, int, int], None]
"""Told (the condition being run, episodes finished in all conditions, episodes in all)."""

DEFAULT_OBS_NOISE: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2)
DEFAULT_ACTION_NOISE: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2)


class EvaluationError(EnvError, ConfigError):
    """An evaluation was asked for something impossible; the message names the argument."""


@dataclass(frozen=True)
class Variant:
    """One environment variant (an id plus constructor arguments) for the generalisation table."""

    name: str
    env_id: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalOptions:
    """How much to evaluate; validated here so a bad value fails before any environment starts."""

    episodes: int = 20
    num_envs: int = 8
    max_steps: int = 1_000_000
    """Environment steps per sweep point before giving up (an episode that never ends)."""
    success_threshold: float | None = None
    """An episode succeeds when its return is at least this; None: the registry's
    `reward_threshold` where the environment declares one, else no success rate."""
    obs_noise: tuple[float, ...] = DEFAULT_OBS_NOISE
    """Standard deviations of Gaussian noise added to every observation the policy sees."""
    action_noise: tuple[float, ...] = DEFAULT_ACTION_NOISE
    """Probabilities of replacing each action by a uniformly random one."""

    def __post_init__(self) -> None:
        if self.episodes < 1:
            raise EvaluationError(f"episodes={self.episodes}: evaluate at least 1 episode")
        if self.num_envs < 1:
            raise EvaluationError(f"num_envs={self.num_envs}: use at least 1 environment")
        if self.max_steps < 1:
            raise EvaluationError(f"max_steps={self.max_steps}: must be a positive step budget")
        for sigma in self.obs_noise:
            if not (math.isfinite(sigma) and sigma >= 0):
                raise EvaluationError(
                    f"obs_noise contains {sigma}: each σ must be a finite number ≥ 0"
                )
        for eps in self.action_noise:
            if not 0.0 <= eps <= 1.0:
                raise EvaluationError(
                    f"action_noise contains {eps}: each ε is a probability in [0, 1]"
                )


@dataclass(frozen=True)
class Metrics:
    """Summary of the episodes of one evaluation condition."""

    episodes: int
    mean_return: float
    std_return: float
    min_return: float
    max_return: float
    mean_length: float
    std_length: float
    success_rate: float | None
    env_steps: int
    steps_per_s: float
    returns: list[float]
    lengths: list[int]


@dataclass(frozen=True)
class VariantResult:
    """Performance on one environment variant; `held_out` is False for the training variant."""

    name: str
    env_id: str
    kwargs: dict[str, Any]
    env_hash: str
    held_out: bool
    metrics: Metrics


@dataclass(frozen=True)
class SweepPoint:
    """Performance at one noise level of a robustness sweep."""

    level: float
    metrics: Metrics


@dataclass(frozen=True)
class EvalResult:
    """Everything `write_report` puts on the page; `to_dict` is the JSON report."""

    env_id: str
    env_kwargs: dict[str, Any]
    seed: int
    env_hash: str
    success_criterion: str
    metrics: Metrics
    generalisation: list[VariantResult]
    obs_noise: list[SweepPoint]
    action_noise: list[SweepPoint]
    wall_s: float
    created_unix: float

    @property
    def success_rate(self) -> float | None:
        return self.metrics.success_rate

    @property
    def mean_return(self) -> float:
        return self.metrics.mean_return

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarise(
    returns: Sequence[float],
    lengths: Sequence[int],
    env_steps: int,
    seconds: float,
    success_threshold: float | None,
) -> Metrics:
    """Pure statistics over finished episodes (population std: the episodes are the whole sample)."""
    r = np.asarray(returns, dtype=np.float64)
    n = np.asarray(lengths, dtype=np.float64)
    success = None if success_threshold is None else float(np.mean(r >= success_threshold))
    return Metrics(
        episodes=len(r),
        mean_return=float(r.mean()),
        std_return=float(r.std()),
        min_return=float(r.min()),
        max_return=float(r.max()),
        mean_length=float(n.mean()),
        std_length=float(n.std()),
        success_rate=success,
        env_steps=env_steps,
        steps_per_s=env_steps / seconds if seconds > 0 else float("inf"),
        returns=[float(x) for x in r],
        lengths=[int(x) for x in n],
    )


def episode_quotas(episodes: int, num_envs: int) -> np.ndarray:
    """How many episodes each environment slot contributes; they sum to `episodes`."""
    quotas = np.full(num_envs, episodes // num_envs, dtype=np.int64)
    quotas[: episodes % num_envs] += 1
    return quotas


def random_actions(space: spaces.Space[Any], count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` uniform actions from the space, drawn from our generator so runs are reproducible."""
    if isinstance(space, spaces.Discrete):
        return rng.integers(int(space.start), int(space.start) + int(space.n), size=count)
    if isinstance(space, spaces.Box):
        low = np.where(np.isfinite(space.low), space.low, -1.0)
        high = np.where(np.isfinite(space.high), space.high, 1.0)
        return rng.uniform(low, high, size=(count, *space.shape)).astype(space.dtype)
    if isinstance(space, spaces.MultiDiscrete):
        return rng.integers(0, space.nvec, size=(count, *space.nvec.shape))
    raise EvaluationError(
        f"action noise needs a Discrete, Box or MultiDiscrete action space, not {space}; "
        "pass action_noise=() to skip the action-noise sweep"
    )


def perturb(
    obs: np.ndarray, sigma: float, space: spaces.Space[Any], rng: np.random.Generator
) -> np.ndarray:
    """A batch of observations `obs` [N, ...] of `space` with Gaussian noise of std `sigma`.

    Float observations take σ in their own units. Integer and bool ones (pixels, packed
    structures) take it as a fraction of each element's range in `space` (σ = 0.1 on 0–255
    pixels is 25.5 levels, on a one-hot of 4 categories 0.3), and the noisy value is rounded and
    saturates at the dtype's bounds: 250 + 10 is 255 on uint8, never 4."""
    noise = rng.normal(0.0, sigma, size=obs.shape)
    if obs.dtype.kind == "f":
        return obs + noise.astype(obs.dtype)
    low, high = _dtype_bounds(obs.dtype)
    noisy = obs.astype(np.float64) + noise * _value_range(space, obs.dtype)
    return np.clip(np.rint(noisy), low, high).astype(obs.dtype)


def _dtype_bounds(dtype: np.dtype[Any]) -> tuple[float, float]:
    """The lowest and highest values of an integer or bool dtype, as floats that cast back
    without overflow (float64 rounds int64's top up to 2**63)."""
    if dtype.kind == "b":
        return 0.0, 1.0
    info = np.iinfo(dtype)
    low, high = float(info.min), float(info.max)
    return low, high if int(high) <= info.max else float(np.nextafter(high, 0.0))


def _value_range(space: spaces.Space[Any], dtype: np.dtype[Any]) -> np.ndarray | float:
    """Each element's range (high − low) in `space`; the dtype's where the space is unbounded
    or says nothing (a single element of the batch, broadcast over it)."""
    low, high = _dtype_bounds(dtype)
    if isinstance(space, spaces.MultiDiscrete):
        return (space.nvec - 1).astype(np.float64)
    if isinstance(space, spaces.MultiBinary):
        return 1.0
    if not isinstance(space, spaces.Box):
        return high - low
    span = space.high.astype(np.float64) - space.low.astype(np.float64)
    return np.where(np.isfinite(span), span, high - low)


@dataclass
class _Condition:
    obs_sigma: float = 0.0
    action_eps: float = 0.0
    label: str = "no noise"


class _Tally:
    """Counts finished episodes across every condition of one evaluation for `progress`."""

    def __init__(self, total: int, progress: Progress | None) -> None:
        self.total, self.done, self.progress = total, 0, progress
        self.label = ""

    def start(self, label: str) -> None:
        self.label = label
        if self.progress is not None:
            self.progress(label, self.done, self.total)

    def episode(self) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(self.label, self.done, self.total)


def _run_episodes(
    vec: Any,
    policy: Policy,
    opts: EvalOptions,
    num_envs: int,
    seed: int,
    condition: _Condition,
    tally: _Tally,
) -> tuple[list[float], list[int], int, float]:
    """Step until every slot has finished its quota of episodes; returns returns, lengths, steps, s."""
    rng = np.random.default_rng([seed, 0x5EED])
    quotas = episode_quotas(opts.episodes, num_envs)
    done_count = np.zeros(num_envs, dtype=np.int64)
    returns: list[float] = []
    lengths: list[int] = []
    steps = 0
    start = time.perf_counter()
    obs = vec.reset(seed=seed)
    while (done_count < quotas).any():
        if steps >= opts.max_steps:
            raise EvaluationError(
                f"{opts.episodes} episodes did not finish within max_steps={opts.max_steps} "
                "environment steps; raise max_steps or check that the episodes can end"
            )
        seen = obs
        if condition.obs_sigma > 0:
            seen = perturb(obs, condition.obs_sigma, vec.single_observation_space, rng)
        actions = np.asarray(policy(seen))
        if condition.action_eps > 0:
            swap = rng.random(num_envs) < condition.action_eps
            if swap.any():
                actions = actions.copy()
                actions[swap] = random_actions(vec.single_action_space, int(swap.sum()), rng)
        result = vec.step(actions)
        steps += num_envs
        for i in np.flatnonzero(result.ended):
            if done_count[i] < quotas[i]:
                done_count[i] += 1
                returns.append(float(result.episode_return[i]))
                lengths.append(int(result.episode_length[i]))
                tally.episode()
        obs = result.obs
    return returns, lengths, steps, time.perf_counter() - start


def _measure(
    policy: Policy,
    env_id: str,
    kwargs: Mapping[str, Any],
    seed: int,
    opts: EvalOptions,
    threshold: float | None,
    condition: _Condition,
    tally: _Tally,
    env: EnvConfig | None = None,
) -> Metrics:
    from shoal.envs.vector import make_vector

    tally.start(condition.label)
    num_envs = min(opts.num_envs, opts.episodes)
    vec = make_vector(env_id, num_envs, seed, env=env, **dict(kwargs))
    try:
        returns, lengths, steps, seconds = _run_episodes(
            vec, policy, opts, num_envs, seed, condition, tally
        )
    finally:
        vec.close()
    return summarise(returns, lengths, steps, seconds, threshold)


def _threshold(env_id: str, explicit: float | None) -> tuple[float | None, str]:
    if explicit is not None:
        return explicit, f"episode return ≥ {explicit:g}"
    declared, source = _declared_threshold(env_id)
    if declared is None:
        return None, "none (the environment declares no reward threshold; pass success_threshold)"
    return declared, f"episode return ≥ {declared:g} ({source})"


def _declared_threshold(env_id: str) -> tuple[float | None, str]:
    """The registry spec's `reward_threshold`, else Gymnasium's for the same id: shoal's
    CartPole-v1 and Acrobot-v1 reproduce Gymnasium's dynamics, so its threshold applies."""
    import gymnasium

    from shoal.envs import registry

    spec = registry.spec(env_id)
    declared = getattr(spec, "reward_threshold", None)
    if declared is not None:
        return float(declared), "the environment's threshold"
    gym_id = spec.id.removeprefix(f"{registry.GYM_NAMESPACE}:")
    try:
        gym_threshold = gymnasium.spec(gym_id).reward_threshold
    except gymnasium.error.Error:
        return None, ""
    if gym_threshold is None:
        return None, ""
    return float(gym_threshold), f"Gymnasium's threshold for {gym_id}"


def evaluate(
    policy: Policy,
    env_id: str,
    *,
    episodes: int = 20,
    seed: int = 0,
    env_kwargs: Mapping[str, Any] | None = None,
    held_out: Sequence[Variant] = (),
    options: EvalOptions | None = None,
    progress: Progress | None = None,
    env: EnvConfig | None = None,
) -> EvalResult:
    """Evaluate `policy` (obs batch [N, ...] -> actions [N]) on `env_id` and its variants.

    `episodes` overrides `options.episodes`. Every condition (the main run, each held-out
    variant, each noise level) runs `episodes` episodes from the same seed, so the numbers
    differ only by the condition. Called from one thread; it builds and closes its own envs.
    `progress` is told of each condition and each finished episode (it runs on that thread).
    `env` is the job's `[env]` section (wrappers, normalisation) every condition applies.
    """
    from shoal.envs.hashing import env_hash

    opts = replace(options or EvalOptions(), episodes=episodes)
    kwargs = dict(env_kwargs or {})
    threshold, criterion = _threshold(env_id, opts.success_threshold)
    noisy = sum(1 for level in (*opts.obs_noise, *opts.action_noise) if level != 0)
    tally = _Tally(opts.episodes * (1 + len(held_out) + noisy), progress)
    start = time.perf_counter()
    main = _measure(policy, env_id, kwargs, seed, opts, threshold, _Condition(), tally, env)
    digest = env_hash(env_id, kwargs, seed, wrappers=env)
    variants = [VariantResult("train", env_id, kwargs, digest, False, main)]
    for variant in held_out:
        v_kwargs = dict(variant.kwargs)
        held = _Condition(label=f"variant {variant.name}")
        metrics = _measure(
            policy, variant.env_id, v_kwargs, seed, opts, threshold, held, tally, env
        )
        variants.append(
            VariantResult(
                variant.name,
                variant.env_id,
                v_kwargs,
                env_hash(variant.env_id, v_kwargs, seed, wrappers=env),
                True,
                metrics,
            )
        )

    def sweep(levels: Sequence[float], make: Callable[[float], _Condition]) -> list[SweepPoint]:
        return [
            SweepPoint(
                level,
                main
                if level == 0
                else _measure(
                    policy, env_id, kwargs, seed, opts, threshold, make(level), tally, env
                ),
            )
            for level in levels
        ]

    obs_sweep = sweep(opts.obs_noise, lambda s: _Condition(obs_sigma=s, label=f"obs noise σ={s:g}"))
    act_sweep = sweep(
        opts.action_noise, lambda e: _Condition(action_eps=e, label=f"action noise ε={e:g}")
    )
    return EvalResult(
        env_id=env_id,
        env_kwargs=kwargs,
        seed=seed,
        env_hash=variants[0].env_hash,
        success_criterion=criterion,
        metrics=main,
        generalisation=variants,
        obs_noise=obs_sweep,
        action_noise=act_sweep,
        wall_s=time.perf_counter() - start,
        created_unix=time.time(),
    )


def _metric_row(label: str, m: Metrics) -> list[object]:
    return [
        label,
        m.episodes,
        m.mean_return,
        m.std_return,
        m.mean_length,
        m.success_rate,
        m.steps_per_s,
    ]


_HEADER = (
    "condition",
    "episodes",
    "mean return",
    "std return",
    "mean length",
    "success",
    "steps/s",
)


def render_html(result: EvalResult, sections: Sequence[tuple[str, str]] = ()) -> str:
    """The static report page: summary table, `sections` (heading, HTML: a run's learning
    curves, say), return histogram, generalisation (only where held-out variants were
    evaluated: one bar compares nothing) and noise plots."""
    m = result.metrics
    summary = report_html.table_html(
        ("field", "value"),
        [
            ("environment", result.env_id),
            ("kwargs", json.dumps(result.env_kwargs, sort_keys=True)),
            ("seed", result.seed),
            ("environment hash", result.env_hash),
            ("success criterion", result.success_criterion),
            ("evaluation wall time (s)", result.wall_s),
        ],
    )
    main_table = report_html.table_html(_HEADER, [_metric_row("train variant, no noise", m)])
    histogram = report_html.histogram_svg(m.returns, "Episode returns", "return")
    generalisation = _generalisation(result) if len(result.generalisation) > 1 else []
    sweeps = []
    for name, label, points in (
        ("Observation noise", "σ", result.obs_noise),
        ("Action noise", "ε", result.action_noise),
    ):
        plot = report_html.line_svg(
            [
                report_html.Point(p.level, p.metrics.mean_return, p.metrics.std_return)
                for p in points
            ],
            f"Return vs {name.lower()}",
            f"{label} ({'noise std' if label == 'σ' else 'probability of a random action'})",
            "mean return ± std",
        )
        table = report_html.table_html(
            _HEADER, [_metric_row(f"{label} = {p.level:g}", p.metrics) for p in points]
        )
        sweeps.append((f"Robustness: {name.lower()}", f'<div class="plots">{plot}</div>{table}'))
    return report_html.page(
        f"shoal evaluation: {result.env_id}",
        [
            ("Run", summary),
            *sections,
            ("Performance", f'{main_table}<div class="plots">{histogram}</div>'),
            *generalisation,
            *sweeps,
        ],
    )


def _generalisation(result: EvalResult) -> list[tuple[str, str]]:
    """The held-out variants' table and bar chart beside the training variant's."""
    gen_table = report_html.table_html(
        ("variant", "env id", "held out", "environment hash", "mean return", "success"),
        [
            (
                v.name,
                v.env_id,
                v.held_out,
                v.env_hash,
                v.metrics.mean_return,
                v.metrics.success_rate,
            )
            for v in result.generalisation
        ],
    )
    gen_plot = report_html.bar_svg(
        [v.name for v in result.generalisation],
        [v.metrics.mean_return for v in result.generalisation],
        "Mean return per variant",
        "mean return",
    )
    return [("Generalisation", f'{gen_table}<div class="plots">{gen_plot}</div>')]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "env"


def write_report(
    result: EvalResult,
    out_dir: str | Path,
    label: str | None = None,
    sections: Sequence[tuple[str, str]] = (),
) -> tuple[Path, Path]:
    """Write `eval-<env>-<hash>.json` and `.html` into `out_dir` (created if missing); with
    a `label` (a checkpoint step and time, say) `eval-<env>-<hash>-<label>[-n]`, never a
    name already there, so a later evaluation never replaces an earlier one's report.
    `sections` go on the page (see `render_html`)."""
    directory = Path(out_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EvaluationError(
            f"cannot create report directory {directory}: {exc.strerror}; pick a writable out_dir"
        ) from exc
    stem = f"eval-{_slug(result.env_id)}-{result.env_hash[:12]}"
    if label is not None:
        stem = _unused(directory, f"{stem}-{_slug(label)}")
    json_path = directory / f"{stem}.json"
    html_path = directory / f"{stem}.html"
    json_path.write_text(json.dumps(result.to_dict(), indent=2, sort_keys=True) + "\n")
    html_path.write_text(render_html(result, sections))
    return json_path, html_path


def _unused(directory: Path, stem: str) -> str:
    """`stem`, or `stem-2`, `stem-3`, ...: the first whose .json and .html are both free."""
    candidate, n = stem, 1
    while (directory / f"{candidate}.json").exists() or (directory / f"{candidate}.html").exists():
        n += 1
        candidate = f"{stem}-{n}"
    return candidate
