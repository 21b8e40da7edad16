"""Environment hash: stable for the same inputs, different for each changed field, and the diff
names the field."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.envs import Registry
from shoal.envs.errors import EnvError
from shoal.envs.hashing import (
    HashStore,
    UnknownHash,
    diff_manifests,
    env_hash,
    env_manifest,
    manifest_hash,
)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path))
    return tmp_path


def test_same_inputs_same_hash(home):
    first = env_hash("CartPole-v1", {}, 3)
    assert first == env_hash("cartpole", None, 3)
    assert len(first) == 64
    stored = json.loads((home / "envs" / "hashes" / f"{first}.json").read_text())
    assert stored == env_manifest("CartPole-v1", {}, 3)


@settings(max_examples=30, deadline=None)
@given(
    size=st.integers(5, 20),
    density=st.floats(0.0, 0.5, allow_nan=False),
    seed=st.one_of(st.none(), st.integers(0, 2**40)),
)
def test_key_order_does_not_matter(size, density, seed):
    forward = env_manifest("GridWorld-v1", {"size": size, "wall_density": density}, seed)
    backward = env_manifest("GridWorld-v1", {"wall_density": density, "size": size}, seed)
    assert manifest_hash(forward) == manifest_hash(backward)


CHANGES = [
    (("Acrobot-v1", {}, 1), "id: CartPole-v1 → Acrobot-v1"),
    (
        ("CartPole-v1", {"sutton_barto_reward": True}, 1),
        "kwargs.sutton_barto_reward: (absent) → true",
    ),
    (("CartPole-v1", {}, 2), "seed: 1 → 2"),
    (("CartPole-v1", {}, None), "seed: 1 → null"),
    (("CartPole-v1", {"max_episode_steps": 200}, 1), "max_episode_steps: 500 → 200"),
]


@pytest.mark.parametrize(("changed", "line"), CHANGES)
def test_each_field_changes_the_hash_and_the_diff_names_it(changed, line):
    base = env_manifest("CartPole-v1", {}, 1)
    other = env_manifest(*changed)
    assert manifest_hash(base) != manifest_hash(other)
    assert line in diff_manifests(base, other)


def test_python_and_package_versions_enter_the_hash():
    base = env_manifest("CartPole-v1", {}, 1)
    newer_python = {**base, "python": "3.12.1"}
    newer_numpy = {**base, "packages": {**base["packages"], "numpy": "9.9.9"}}
    assert len({manifest_hash(m) for m in (base, newer_python, newer_numpy)}) == 3
    assert diff_manifests(base, newer_python) == [f"python: {base['python']} → 3.12.1"]
    assert diff_manifests(base, newer_numpy) == [
        f"packages.numpy: {base['packages']['numpy']} → 9.9.9"
    ]


def test_entry_point_enters_the_hash():
    one, two = Registry(), Registry()
    one.register("Thing-v1", "shoal.envs.cartpole:make_single")
    two.register("Thing-v1", "shoal.envs.acrobot:make_single")
    first, second = env_manifest("Thing-v1", registry=one), env_manifest("Thing-v1", registry=two)
    assert diff_manifests(first, second) == [
        "entry_point: shoal.envs.cartpole:make_single → shoal.envs.acrobot:make_single"
    ]


def test_gym_envs_hash_their_packages():
    manifest = env_manifest("gym:CartPole-v1")
    assert set(manifest["packages"]) == {"gymnasium"}


def test_store_resolves_prefixes_and_names_unknown_hashes(tmp_path):
    store = HashStore(tmp_path)
    digest = env_hash("CartPole-v1", {}, 0, store=store)
    assert store.load(digest[:8]) == (digest, env_manifest("CartPole-v1", {}, 0))
    with pytest.raises(UnknownHash, match=f"unknown environment hash {'0' * 10}: no manifest in"):
        store.load("0" * 10)
    with pytest.raises(
        UnknownHash, match="'xyz' is not an environment hash: give 6 to 64 hex digits"
    ):
        store.load("xyz")


def test_unhashable_parameters_are_refused():
    with pytest.raises(
        EnvError, match=r"parameter kwargs.size=nan cannot be hashed: use a finite number"
    ):
        env_manifest("GridWorld-v1", {"size": float("nan")})
    with pytest.raises(EnvError, match=r"parameter kwargs.size=<object object"):
        env_manifest("GridWorld-v1", {"size": object()})
    with pytest.raises(EnvError, match="seed must be an integer or None, got 'x'"):
        env_manifest("GridWorld-v1", seed="x")


def test_unwritable_store_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(
        EnvError, match=r"cannot record environment hash in .*set SHOAL_HOME to a writable"
    ):
        env_hash("Acrobot-v1", {}, 9, store=HashStore(blocker / "hashes"))
