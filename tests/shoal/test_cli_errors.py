"""Every verb, given the mistakes users make (a missing file, a bad id, a bad option value, no
cluster there), ends with exit status 2 and one `shoal: error:` line naming what to fix, never a
traceback; and every command that reads something can print it as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.cli import build_parser, main
from shoal.commands.completion import command_tree
from shoal.local import LocalCluster, coordinator_specs

pytestmark = pytest.mark.timeout(120)

MISSING = "/nonexistent/shoal-test"
COORDINATOR = ["coordinator", "--id", "c1"]
TOKEN_MISSING = ["--data-dir", "{tmp}/c", "--token-file", MISSING]

# (argv, words the one error line must contain). {tmp} is a fresh empty directory.
MISTAKES: list[tuple[list[str], str]] = [
    (["status"], "start one with `shoal up`"),
    (["status", "--json"], "start one with `shoal up`"),
    (["logs"], "start one with `shoal up`"),
    (["logs", "-n", "0"], "--lines=0 is invalid"),
    (["down"], "start one with `shoal up`"),
    (["envs", "info", "NoSuchEnv-v0"], "no environment 'NoSuchEnv-v0'"),
    (["envs", "hash", "NoSuchEnv-v0"], "no environment 'NoSuchEnv-v0'"),
    (["envs", "hash", "CartPole-v1", "--kwargs", "size"], "KEY=VALUE"),
    (["envs", "diff", "abc", "def"], "is not an environment hash"),
    (["envs", "diff", "0123456789ab", "ba9876543210"], "unknown environment hash 0123456789ab"),
    (["envs", "list", "--workers", "0", "--no-gym"], "workers must be at least 1"),
    (["eval", MISSING], "does not exist"),
    (["eval", "{tmp}", "--episodes", "0"], "--episodes 0 is invalid"),
    (["train", "NoSuchEnv-v0"], "no environment 'NoSuchEnv-v0'"),
    (["train", f"{MISSING}/job.toml"], "no such file"),
    (["train", "cartpole", "--workers", "0"], "rollout.workers = 0 is invalid"),
    (["train", "cartpole", "--time-limit", "-3"], "time_limit_s = -3.0 is invalid"),
    (["chaos", "run", f"{MISSING}.toml"], "no scenario file"),
    (["up", "--replicas", "2"], "--replicas=2 must be odd"),
    (["up", "--run-dir", "/proc/shoal-test"], "cannot lay out the run directory /proc/shoal-test"),
    (["chaos", "run", "smoke", "--run-dir", "/proc/shoal-test"], "choose a writable --run-dir"),
    (["up", "--sim-gpus", "-1"], "--sim-gpus=-1"),
    (["console", "--coordinators", "ftp://x"], "must be http(s)://HOST:PORT"),
    (["console", "--coordinators", "http://127.0.0.1:1", "--token-file", MISSING], MISSING),
    (
        [*COORDINATOR, "--raft", "nowhere", "--api", "127.0.0.1:0", "--data-dir", "{tmp}/c"],
        "--raft='nowhere' is not HOST:PORT",
    ),
    (
        [*COORDINATOR, "--raft", "127.0.0.1:0", "--api", "127.0.0.1:0", *TOKEN_MISSING],
        "cannot read the API token file",
    ),
    (["node", "--coordinators", "ftp://x", "--data-dir", "{tmp}/n"], "'ftp://x' is invalid"),
    (["node", "--data-dir", "{tmp}/n", "--sim-gpus", "5000"], "--sim-gpus=5000 is invalid"),
    (["node", "--data-dir", "{tmp}/n", "--label", "nokey"], "--label 'nokey' is invalid"),
    (["node", "--data-dir", "{tmp}/n", "--heartbeat", "0"], "heartbeat_s=0.0 is invalid"),
    (["node", "--data-dir", "{tmp}/n", "--metrics", "nowhere"], "--metrics='nowhere'"),
    (["node", "--data-dir", "{tmp}/n", "--token-file", MISSING], "cannot read the API token"),
]

# Mistakes argparse catches itself (a choice that does not exist, a value of the wrong type).
ARGPARSE_MISTAKES: list[tuple[list[str], str]] = [
    (["completion", "fish"], "invalid choice: 'fish'"),
    (["bench", "nosuchsuite"], "invalid choice: 'nosuchsuite'"),
    (["node", "--data-dir", "d", "--sim-gpus", "many"], "invalid int value: 'many'"),
    (["nosuchverb"], "invalid choice: 'nosuchverb'"),
]

READ_COMMANDS = [
    ("envs", "list"),
    ("envs", "info"),
    ("envs", "hash"),
    ("envs", "diff"),
    ("status",),
    ("logs",),
    ("eval",),
    ("train",),
    ("chaos", "run"),
    ("chaos", "soak"),
    ("bench",),
]


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No real home, run dir or token leaks in: each mistake meets an empty world."""
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SHOAL_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("SHOAL_API_TOKEN", "test-token-0123456789")
    (tmp_path / "empty").mkdir()
    return tmp_path


def _argv(template: list[str], tmp: Path) -> list[str]:
    argv = [a.replace("{tmp}", str(tmp / "empty")) for a in template]
    if argv[0] == "node" and "--coordinators" not in argv:
        argv += ["--coordinators", "http://127.0.0.1:1"]
    return argv


@pytest.mark.parametrize(("argv", "words"), MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_a_mistake_is_one_error_line_and_exit_status_2(
    isolated: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    code = main(_argv(argv, isolated))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert errors[0].startswith("shoal: error: "), err
    assert words in errors[0]


@pytest.mark.parametrize(
    ("argv", "words"), ARGPARSE_MISTAKES, ids=[" ".join(a) for a, _ in ARGPARSE_MISTAKES]
)
def test_argparse_refuses_bad_values_with_status_2(
    isolated: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("shoal"), err
    assert ": error: " in last
    assert words in last


@pytest.mark.parametrize("path", READ_COMMANDS, ids=" ".join)
def test_every_read_command_has_json(path: tuple[str, ...]) -> None:
    node = command_tree(build_parser())
    for word in path:
        node = node.children[word]
    assert "--json" in node.options


def test_logs_json_lists_each_process_with_its_lines(
    isolated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local = LocalCluster(isolated / "cluster")
    local.create(coordinator_specs(local.run_dir, 1))
    local.log_path("c1").parent.mkdir(parents=True, exist_ok=True)
    local.log_path("c1").write_text("one\ntwo\nthree\n")
    assert main(["logs", "--json", "-n", "2", "--run-dir", str(local.run_dir)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == [{"process": "c1", "path": str(local.log_path("c1")), "lines": ["two", "three"]}]
    assert main(["logs", "c7", "--run-dir", str(local.run_dir)]) == 2
    assert capsys.readouterr().err.strip() == "shoal: error: no process 'c7'; known: ['c1']"


def test_envs_diff_json_names_the_differing_fields(
    isolated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hashes = []
    for seed in ("1", "2"):
        assert main(["envs", "hash", "CartPole-v1", "--seed", seed, "--json"]) == 0
        hashes.append(json.loads(capsys.readouterr().out)["hash"])
    assert main(["envs", "diff", hashes[0][:12], hashes[1][:12], "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["first"], report["second"]) == tuple(hashes)
    assert report["differences"] == ["seed: 1 → 2"]
    assert main(["envs", "diff", hashes[0], hashes[0], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["differences"] == []
