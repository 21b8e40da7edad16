"""Registry: id parsing, aliases, and errors whose exact messages name the fix."""

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.envs import (
    DeprecatedEnvironment,
    EnvError,
    InvalidEnvironmentId,
    RegistrationError,
    Registry,
    UnknownEnvironment,
    make,
    make_vector,
    spec,
)
from shoal.envs.registry import parse_id
from shoal.envs.time_limit import TimeLimit

names = st.from_regex(r"[A-Z][A-Za-z0-9]{0,10}(-[A-Z][A-Za-z0-9]{0,6}){0,2}", fullmatch=True)


@given(name=names, version=st.integers(0, 10**6))
def test_parse_round_trips_name_and_version(name, version):
    parsed = parse_id(f"{name}-v{version}")
    assert (parsed.namespace, parsed.name, parsed.version) == (None, name, version)


@given(name=names, version=st.integers(0, 99))
def test_parse_namespace(name, version):
    parsed = parse_id(f"gym:ALE/{name}-v{version}")
    assert (parsed.namespace, parsed.name, parsed.version) == ("gym", f"ALE/{name}", version)


@given(text=st.text(alphabet=" !@#$%^&*()+=,;'\"<>?", min_size=1, max_size=8))
def test_parse_refuses_garbage(text):
    with pytest.raises(InvalidEnvironmentId):
        parse_id(f"Cart{text}Pole-v1")


def _registry_with_versions():
    registry = Registry()
    for version in (0, 1, 3):
        registry.register(f"Maze-v{version}", "shoal.envs.cartpole:make_single")
    registry.register("CartPole-v1", "shoal.envs.cartpole:make_single", max_episode_steps=500)
    return registry


def test_unknown_id_names_the_closest():
    with pytest.raises(UnknownEnvironment) as exc:
        _registry_with_versions().make("CartPol-v1")
    assert str(exc.value) == "no environment 'CartPol-v1'; did you mean CartPole-v1?"


def test_a_misspelt_alias_names_the_canonical_id():
    with pytest.raises(UnknownEnvironment) as exc:
        _registry_with_versions().make("cartpol")
    assert str(exc.value) == "no environment 'cartpol'; did you mean CartPole-v1?"


def test_unknown_id_without_close_match_points_at_the_list():
    with pytest.raises(UnknownEnvironment) as exc:
        _registry_with_versions().make("Zzzzzzzzzzzzz-v4")
    assert str(exc.value) == (
        "no environment 'Zzzzzzzzzzzzz-v4'; run 'shoal envs list' to see the available ids"
    )


def test_outdated_version_names_the_newest():
    with pytest.raises(DeprecatedEnvironment) as exc:
        _registry_with_versions().make("Maze-v2")
    assert str(exc.value) == "Maze-v2 is outdated; use Maze-v3 instead"


def test_future_version_names_the_newest():
    with pytest.raises(UnknownEnvironment) as exc:
        _registry_with_versions().make("Maze-v9")
    assert str(exc.value) == "Maze-v9 does not exist; the newest version is Maze-v3"


def test_malformed_id():
    with pytest.raises(InvalidEnvironmentId) as exc:
        make("cart pole")
    assert str(exc.value) == (
        "'cart pole' is not a valid environment id: use Name-vN (e.g. GridWorld-v1) "
        "or gym:<Gymnasium id> (e.g. gym:CartPole-v1)"
    )


@pytest.mark.parametrize("alias", ["maze", "MAZE", "Maze", "maze-v1"])
def test_case_insensitive_aliases(alias):
    registry = _registry_with_versions()
    expected = "Maze-v1" if alias.endswith("-v1") else "Maze-v3"
    assert registry.spec(alias).id == expected


def test_default_registry_aliases_reach_the_builtins():
    assert spec("cartpole").id == "CartPole-v1"
    assert isinstance(make("cartpole"), TimeLimit)


def test_registration_errors():
    registry = _registry_with_versions()
    with pytest.raises(RegistrationError, match=re.escape("Maze-v1 is already registered")):
        registry.register("Maze-v1", "x:y")
    with pytest.raises(InvalidEnvironmentId, match=re.escape("cannot register 'Maze'")):
        registry.register("Maze", "x:y")
    with pytest.raises(InvalidEnvironmentId, match=re.escape("cannot register 'gym:Maze-v1'")):
        registry.register("gym:Maze-v1", "x:y")
    with pytest.raises(RegistrationError, match="max_episode_steps of Maze-v7 must be a positive"):
        registry.register("Maze-v7", "x:y", max_episode_steps=0)


def test_unloadable_entry_point():
    registry = Registry()
    registry.register("Ghost-v1", "shoal.envs.no_such_module:make")
    with pytest.raises(
        EnvError, match=re.escape("entry point 'shoal.envs.no_such_module:make' cannot be loaded")
    ):
        registry.make("Ghost-v1")


def test_unknown_kwarg_is_an_env_error_naming_the_keywords_it_takes():
    refusal = "CartPole-v1 takes no keyword 'gravity'; its keywords are: max_episode_steps, sutton_barto_reward"
    with pytest.raises(EnvError, match=re.escape(refusal)):
        make("CartPole-v1", gravity=3.0)
    with pytest.raises(EnvError, match=re.escape(refusal)):
        make_vector("CartPole-v1", 2, gravity=3.0)


def test_a_type_error_inside_a_constructor_keeps_its_own_message():
    def build(size: int = 3) -> None:
        raise TypeError("size must be an int")

    registry = Registry()
    registry.register("Odd-v1", build)
    with pytest.raises(EnvError, match=r"Odd-v1 cannot be made with \['size'\]: size must be"):
        registry.make("Odd-v1", size="x")


@given(st.dictionaries(st.text(max_size=12), st.integers(1, 1000), max_size=4))
def test_any_unknown_keyword_is_named_and_known_ones_make_the_environment(kwargs):
    unknown = sorted(set(kwargs) - {"max_episode_steps", "sutton_barto_reward"})
    if unknown:
        with pytest.raises(EnvError, match=re.escape(f"takes no keyword {unknown[0]!r}")):
            make("CartPole-v1", **kwargs)
    else:
        make("CartPole-v1", **kwargs).close()


def test_kwargs_and_time_limit_override():
    env = make("CartPole-v1", max_episode_steps=2, sutton_barto_reward=True)
    env.reset()
    first = env.step(0)
    second = env.step(0)
    assert first[1] == 0.0
    assert not first[2]
    assert second[2]
    assert second[3]["truncated"]


def test_gym_namespace_makes_gymnasium_envs():
    env = make("gym:MountainCar-v0")
    obs, _ = env.reset()
    assert obs.shape == (2,)
    assert spec("gym:MountainCar-v0").requirements == ("gymnasium",)


def test_unknown_gym_id_names_the_closest():
    with pytest.raises(UnknownEnvironment) as exc:
        make("gym:MountainCarr-v0")
    assert str(exc.value).startswith(
        "no environment 'gym:MountainCarr-v0'; did you mean gym:MountainCar-v0"
    )


def test_list_contains_builtins_and_gym_ids():
    ids = __import__("shoal.envs", fromlist=["list"]).list()
    assert "CartPole-v1" in ids
    assert "gym:CartPole-v1" in ids


def test_a_gymnasium_id_names_the_keywords_its_class_takes():
    refusal = "gym:CartPole-v1 takes no keyword 'gravity'; its keywords are: max_episode_steps, "
    with pytest.raises(EnvError, match=re.escape(refusal + "render_mode, sutton_barto_reward")):
        make("gym:CartPole-v1", gravity=3.0)
