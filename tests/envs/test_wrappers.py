"""Job-configured wrappers (envs/wrappers.py): hostile wrapper lists are refused with the fix,
good ones apply in order, normalisation keeps the reported returns true, and the environment
hash changes with anything `[env]` applies."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.config import load, parse_toml
from shoal.envs.hashing import HashStore, env_hash, env_manifest
from shoal.envs.vector import make_vector
from shoal.envs.wrappers import (
    MAX_WRAPPERS,
    EnvConfig,
    WrapperError,
    WrapperSpec,
    gymnasium_wrappers,
    parse_wrapper_flag,
    parse_wrappers,
)
from shoal.errors import ConfigError
from shoal.learner.config import TrainConfig

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=300),
    lambda inner: (
        st.lists(inner, max_size=70) | st.dictionaries(st.text(max_size=20), inner, max_size=20)
    ),
    max_leaves=25,
)
_names = st.sampled_from(["atari", "NormalizeObservation", "ClipReward", "TimeLimit", "Autoreset",
                          "TransformReward", "RecordVideo", "Nope", "", "a" * 80, "1x"])  # fmt: skip
_entries = st.fixed_dictionaries(
    {"name": _names | st.text(max_size=70)},
    optional={"kwargs": st.dictionaries(st.text(max_size=20), _json, max_size=20), "x": _json},
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_entries, max_size=20) | _json)
def test_any_wrapper_list_is_specs_or_one_wrapper_error(raw: object) -> None:
    try:
        specs = parse_wrappers(raw)
    except WrapperError as exc:
        message = str(exc)
    else:
        message = ""
    if message:
        assert len(message) < 600  # one line a user reads, whatever the input held
        return
    assert len(specs) <= MAX_WRAPPERS
    for spec in specs:
        assert isinstance(spec, WrapperSpec)
        # What parsed once parses again to the same specs (the job JSON round trip).
        assert parse_wrappers([spec.to_json()]) == (spec,)


def test_a_good_list_keeps_its_order_and_kwargs() -> None:
    specs = parse_wrappers(
        [
            {"name": "atari", "kwargs": {"frame_stack": 2, "noop_max": 0}},
            {"name": "ClipReward", "kwargs": {"min_reward": -1, "max_reward": 1}},
            {"name": "TimeLimit", "kwargs": {"max_episode_steps": 100}},
        ]
    )
    assert [s.name for s in specs] == ["atari", "ClipReward", "TimeLimit"]
    assert specs[0].kwargs == {"frame_stack": 2, "noop_max": 0}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([{"name": "NormalizeObservaton"}], "did you mean NormalizeObservation"),
        ([{"name": "Nope"}], "name a wrapper set (atari) or a class of gymnasium.wrappers"),
        ([{"name": "Autoreset"}], "shoal's vectors reset every copy themselves"),
        ([{"name": "RecordVideo"}], "writes files on the node"),
        ([{"name": "TransformReward"}], "TransformReward needs func"),
        ([{"name": "ClipReward", "kwargs": {"low": 1}}], "takes min_reward, max_reward"),
        ([{"name": "atari", "kwargs": {"frame_stack": 0}}], "frame_stack = 0 is invalid"),
        ([{"name": "atari", "kwargs": {"stack": 4}}], "the atari set takes noop_max"),
        ([{"name": "atari", "extra": 1}], "unknown key(s) extra; valid: name, kwargs"),
        ([{"name": "TimeLimit", "kwargs": {"max_episode_steps": math.nan}}], "finite number"),
        ([{"name": "TimeLimit", "kwargs": {"max_episode_steps": {"a": 1}}}], "lists of them"),
        ([{"name": "TimeLimit", "kwargs": {"x": [[[[1]]]]}}], "nested 3 deep"),
        ([{"name": "TimeLimit", "kwargs": {"x": "y" * 300}}], "at most 256"),
        ([{"name": "atari"}] * (MAX_WRAPPERS + 1), f"at most {MAX_WRAPPERS} are allowed"),
        ("atari", "must be a list of tables"),
    ],
)
def test_refusals_name_the_fix(raw: object, message: str) -> None:
    with pytest.raises(WrapperError) as caught:
        parse_wrappers(raw)
    assert message in str(caught.value)


def test_only_wrapper_classes_of_gymnasium_wrappers_are_allowed() -> None:
    import gymnasium

    allowed = gymnasium_wrappers()
    assert {"NormalizeObservation", "NormalizeReward", "FrameStackObservation"} <= set(allowed)
    assert all(issubclass(cls, gymnasium.Wrapper) for cls in allowed.values())
    # Module-level names that are not wrappers (submodules, functions) are never reachable.
    for name in ("vector", "utils", "common", "importlib"):
        with pytest.raises(WrapperError):
            parse_wrappers([{"name": name}])


def test_the_wrapper_flag_reads_json_values_and_text() -> None:
    assert parse_wrapper_flag("atari:frame_stack=2,episodic_life=false") == {
        "name": "atari",
        "kwargs": {"frame_stack": 2, "episodic_life": False},
    }
    assert parse_wrapper_flag("ResizeObservation:shape=[42, 42]")["kwargs"] == {"shape": [42, 42]}
    assert parse_wrapper_flag("NormalizeReward") == {"name": "NormalizeReward", "kwargs": {}}
    with pytest.raises(WrapperError, match="is not key=value"):
        parse_wrapper_flag("atari:frame_stack")
    with pytest.raises(WrapperError, match=r"^--wrapper Nope: no wrapper 'Nope'"):
        parse_wrapper_flag("Nope")


def test_the_job_toml_env_section_loads_and_its_errors_name_the_file() -> None:
    text = """
env_id = "CartPole-v1"
[env]
normalize_reward = true
[[env.wrappers]]
name = "TimeLimit"
kwargs = { max_episode_steps = 50 }
"""
    cfg = load(TrainConfig, parse_toml(text, source="job.toml"), source="job.toml", environ={})
    assert cfg.env.normalize_reward
    assert not cfg.env.normalize_observation
    assert cfg.env.specs == (WrapperSpec("TimeLimit", {"max_episode_steps": 50}),)
    bad = text.replace('"TimeLimit"', '"TimeLimt"')
    with pytest.raises(
        ConfigError, match=r"job.toml: \[env\] wrappers\[0\]: no wrapper 'TimeLimt'"
    ):
        load(TrainConfig, parse_toml(bad, source="job.toml"), source="job.toml", environ={})


def test_the_hash_covers_wrappers_and_normalisation(tmp_path: Path) -> None:
    store = HashStore(tmp_path)
    bare = env_hash("CartPole-v1", {}, 0, store=store)
    assert env_hash("CartPole-v1", {}, 0, store=store, wrappers=EnvConfig()) == bare
    clip = EnvConfig(wrappers=({"name": "ClipReward", "kwargs": {"min_reward": 0}},))
    clip2 = EnvConfig(wrappers=({"name": "ClipReward", "kwargs": {"min_reward": 1}},))
    norm = EnvConfig(normalize_observation=True)
    digests = {
        bare,
        env_hash("CartPole-v1", {}, 0, store=store, wrappers=clip),
        env_hash("CartPole-v1", {}, 0, store=store, wrappers=clip2),
        env_hash("CartPole-v1", {}, 0, store=store, wrappers=norm),
        env_hash("CartPole-v1", {}, 0, store=store, wrappers=EnvConfig(normalize_reward=True)),
    }
    assert len(digests) == 5
    manifest = env_manifest("CartPole-v1", {}, 0, wrappers=clip)
    assert manifest["env"]["wrappers"] == [{"name": "ClipReward", "kwargs": {"min_reward": 0}}]


def test_normalised_copies_still_report_the_true_returns() -> None:
    # CartPole pays 1 per step: whatever NormalizeReward does to the rewards the learner sees,
    # a reported episode return equals its length.
    cfg = EnvConfig(normalize_observation=True, normalize_reward=True)
    with make_vector("CartPole-v1", 4, seed=0, env=cfg) as vec:
        obs = vec.reset()
        assert obs.dtype == np.float32
        assert obs.shape == (4, 4)
        rng = np.random.default_rng(0)
        returns, lengths, scaled = [], [], []
        while len(returns) < 8:
            step = vec.step(rng.integers(0, 2, 4))
            scaled += step.reward.tolist()
            returns += step.episode_return[step.ended].tolist()
            lengths += step.episode_length[step.ended].tolist()
    assert returns == [float(n) for n in lengths]
    assert any(abs(r - 1.0) > 1e-3 for r in scaled)  # the learner's rewards were scaled


def test_a_gymnasium_wrapper_by_name_applies_to_shoal_envs() -> None:
    cfg = EnvConfig(wrappers=({"name": "TimeLimit", "kwargs": {"max_episode_steps": 5}},))
    with make_vector("CartPole-v1", 2, seed=0, env=cfg) as vec:
        vec.reset()
        ends = [vec.step(np.zeros(2, dtype=np.int64)) for _ in range(5)][-1]
    assert ends.done.all()
    assert ends.truncated.all()
    assert ends.episode_length.tolist() == [5, 5]


def test_a_wrapper_that_cannot_wrap_is_one_wrapper_error() -> None:
    cfg = EnvConfig(wrappers=({"name": "FrameStackObservation", "kwargs": {"stack_size": 0}},))
    with pytest.raises(WrapperError, match="wrapper FrameStackObservation cannot wrap"):
        make_vector("CartPole-v1", 1, env=cfg)
    with pytest.raises(WrapperError, match="needs an Arcade Learning Environment game"):
        make_vector("CartPole-v1", 1, env=EnvConfig(wrappers=({"name": "atari"},)))
