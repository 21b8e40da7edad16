"""`shoal envs list|info|hash|diff` through `shoal.cli.main`, as a user runs them."""

import json

import pytest

from shoal.cli import main
from shoal.commands.envs import family, parse_kwargs


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path))
    return tmp_path


def test_hash_prints_a_stable_hash(capsys):
    assert main(["envs", "hash", "GridWorld-v1", "--kwargs", "size=10", "--seed", "3"]) == 0
    first = capsys.readouterr().out.strip()
    assert main(["envs", "hash", "gridworld", "--kwargs", "size=10", "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == first
    assert len(first) == 64


def test_hash_refuses_kwargs_the_environment_does_not_take(capsys):
    assert main(["envs", "hash", "CartPole-v1", "--kwargs", "gravity=3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "CartPole-v1 takes no keyword 'gravity'; its keywords are:" in captured.err


def test_hash_json_carries_the_manifest(capsys):
    assert main(["envs", "hash", "CartPole-v1", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["manifest"]["id"] == "CartPole-v1"
    assert payload["manifest"]["max_episode_steps"] == 500


def test_diff_names_each_changed_field(capsys):
    main(["envs", "hash", "GridWorld-v1", "--kwargs", "size=10", "--seed", "1"])
    first = capsys.readouterr().out.strip()
    main(["envs", "hash", "GridWorld-v1", "--kwargs", "size=12", "--seed", "2"])
    second = capsys.readouterr().out.strip()
    assert main(["envs", "diff", first[:10], second]) == 0
    assert capsys.readouterr().out.splitlines() == ["kwargs.size: 10 → 12", "seed: 1 → 2"]
    assert main(["envs", "diff", first, first]) == 0
    assert "describe the same environment" in capsys.readouterr().out


def test_diff_of_an_unknown_hash_says_which(capsys):
    main(["envs", "hash", "CartPole-v1"])
    known = capsys.readouterr().out.strip()
    assert main(["envs", "diff", known, "abcdef0123"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shoal: error: unknown environment hash abcdef0123: no manifest in")


def test_info_describes_a_builtin(capsys):
    assert main(["envs", "info", "acrobot", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["id"] == "Acrobot-v1"
    assert info["vector"] == "native batched"
    assert info["action_space"] == "Discrete(3)"
    assert info["max_episode_steps"] == 500


def test_unknown_id_is_one_line_with_the_fix(capsys):
    assert main(["envs", "info", "CartPol-v1"]) == 2
    assert (
        capsys.readouterr().err
        == "shoal: error: no environment 'CartPol-v1'; did you mean CartPole-v1?\n"
    )


def test_bad_kwargs_are_refused(capsys):
    assert main(["envs", "hash", "GridWorld-v1", "--kwargs", "size"]) == 2
    assert "--kwargs expects KEY=VALUE (e.g. size=10), got 'size'" in capsys.readouterr().err


def test_parse_kwargs_reads_json_values():
    assert parse_kwargs(["size=10", "density=0.5", "name=abc", "flag=true", "xs=[1,2]"]) == {
        "size": 10,
        "density": 0.5,
        "name": "abc",
        "flag": True,
        "xs": [1, 2],
    }


@pytest.mark.parametrize(
    ("env_id", "expected"),
    [
        ("gym:ALE/Pong-v5", "pong"),
        ("gym:PongNoFrameskip-v4", "pong"),
        ("gym:Pong-ramDeterministic-v4", "pong"),
        ("gym:Pong-ram-v4", "pong"),
        ("GridWorld-HeldOut-v1", "gridworld-heldout"),
    ],
)
def test_family_folds_versions_and_atari_variants(env_id, expected):
    assert family(env_id) == expected


@pytest.mark.timeout(120)
def test_list_probes_shoal_envs_and_caches(capsys, home):
    assert main(["envs", "list", "--no-gym", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    ids = {entry["id"] for entry in listed}
    assert {"CartPole-v1", "Acrobot-v1", "GridWorld-HeldOut-v1"} <= ids
    assert all(entry["ok"] for entry in listed)
    assert (home / "envs" / "catalog.json").exists()
    assert main(["envs", "list", "--no-gym"]) == 0
    assert "environments make, reset and step here" in capsys.readouterr().out
