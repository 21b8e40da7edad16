"""Every verb, given the mistakes users make (a missing file, a bad id, a bad option value, no
cluster there), ends with exit status 2 and one `shoal: error:` line naming what to fix, never a
traceback; and every command that reads something can print it as JSON."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.cli import build_parser, main, path_error
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
    (["eval", "{tmp}", "--episodes", "0"], "--episodes=0 is invalid: use an integer >= 1"),
    (
        ["eval", "{tmp}", "--seed", "-1"],
        "--seed=-1 is invalid: use an integer from 0 to 4294967295",
    ),
    (["envs", "hash", "CartPole-v1", "--seed", "-1"], "--seed=-1 is invalid"),
    (["train", "cartpole", "--seed", "-1"], "seed = -1 is invalid: use an integer from 0 to "),
    (["train", "cartpole", "--pipeline", "--seed", "-1"], "--seed=-1 is invalid"),
    (
        ["train", "cartpole", "--workers", "100000"],
        "rollout.workers = 100000 is invalid: use an integer from 1 to 1024",
    ),
    (
        ["train", "cartpole", "--envs", str(10**12)],
        "rollout.num_envs = 1000000000000 is invalid: use an integer from 1 to 65536",
    ),
    (["up", "--timeout", "-1"], "--timeout=-1.0 is invalid: use a number of seconds > 0"),
    (["up", "--timeout", "nan"], "--timeout=nan is invalid: use a number of seconds > 0"),
    (["up", "--island-size", "0"], "--island-size=0 is invalid: use an integer from 1 to 1024"),
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


# Files a user passes that are not what they should be: {file} holds the bytes.
DEEP = b"a = " + b"[" * 5000 + b"]" * 5000
BINARY = b"\x85\x00\xff\xfe" * 64
JOB = b'env_id = "CartPole-v1"\n[rollout]\n'
FILE_MISTAKES: list[tuple[list[str], bytes, str]] = [
    (["train", "{file}"], BINARY, "byte 0x85 at offset 0 is not UTF-8"),
    (["train", "{file}"], DEEP, "brackets nest deeper than 32 levels (line 1)"),
    (["train", "{file}"], JOB + b"num_envs = 1e20\n", "rollout.num_envs = 1e+20 is invalid"),
    (
        ["train", "{file}"],
        JOB + b"num_envs = 100000000000000000000\n",
        "num_envs = 100000000000000000000 is invalid: use an integer from 1 to 65536",
    ),
    (["train", "{file}"], JOB + b"workers = 100000\n", "rollout.workers = 100000 is invalid"),
    (["train", "{file}", "--pipeline"], BINARY, "is not UTF-8"),
    (["chaos", "run", "{file}"], b"k" + b".k" * 100_000 + b" = 1", "a dotted key nests deeper"),
    (["chaos", "run", "{file}"], BINARY, "is not UTF-8"),
    (["up", "--coordinator-config", "{file}"], DEEP, "brackets nest deeper than 32 levels"),
    (["up", "--coordinator-config", "{file}"], BINARY, "is not UTF-8"),
]


@pytest.mark.parametrize(
    ("argv", "content", "words"),
    FILE_MISTAKES,
    ids=[f"{' '.join(a)} {w}" for a, _, w in FILE_MISTAKES],
)
def test_a_bad_file_is_one_error_line_naming_it(
    isolated: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    content: bytes,
    words: str,
) -> None:
    path = isolated / "job.toml"
    path.write_bytes(content)
    code = main([a.replace("{file}", str(path)) for a in argv])
    _one_error_line(code, capsys.readouterr().err, f"{path}: ", words)


def _one_error_line(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("shoal: error: "), err
    for word in words:
        assert word in lines[0], err


def _shoal(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A real `shoal` process, as a user runs it."""
    shoal = Path(sys.executable).with_name("shoal")
    return subprocess.run([str(shoal), *argv], env=env, capture_output=True, text=True)


@pytest.fixture
def shoal_env(isolated: Path) -> dict[str, str]:
    """The environment of a child `shoal`: the isolated home, run dir and token."""
    return dict(os.environ)


SUBPROCESS_MISTAKES: list[tuple[list[str], bytes, str]] = [
    (["train", "{file}"], BINARY, "byte 0x85 at offset 0 is not UTF-8"),
    (["train", "cartpole", "--workers", "100000"], b"", "use an integer from 1 to 1024"),
    (["up", "--coordinator-config", "{file}", "--run-dir", "{tmp}/up"], DEEP, "nest deeper"),
    (["up", "--timeout", "-1", "--run-dir", "{tmp}/up"], b"", "--timeout=-1.0 is invalid"),
]


@pytest.mark.parametrize(
    ("argv", "content", "words"),
    SUBPROCESS_MISTAKES,
    ids=[" ".join(a) for a, _, _ in SUBPROCESS_MISTAKES],
)
def test_a_real_shoal_process_ends_a_mistake_in_one_line_and_starts_nothing(
    isolated: Path, shoal_env: dict[str, str], argv: list[str], content: bytes, words: str
) -> None:
    path = isolated / "job.toml"
    path.write_bytes(content)
    tmp = isolated / "empty"
    done = _shoal(
        [a.replace("{file}", str(path)).replace("{tmp}", str(tmp)) for a in argv], shoal_env
    )
    _one_error_line(done.returncode, done.stderr, words)
    assert list(tmp.iterdir()) == [], "a refused command left something behind"


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory nobody may write: a read-only tmpfs as root (root ignores permission
    bits), a directory without write permission otherwise."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o500)
        yield path
        path.chmod(0o700)
        return
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _daemon_argv(verb: str, data_dir: Path, secret: Path) -> list[str]:
    from shoal.ports import free_port

    if verb == "node":
        return ["node", "--coordinators", "http://127.0.0.1:1", "--data-dir", str(data_dir)]
    raft, api = free_port(), free_port()
    return [
        *COORDINATOR,
        "--raft",
        f"127.0.0.1:{raft}",
        "--api",
        f"127.0.0.1:{api}",
        "--data-dir",
        str(data_dir),
        "--secret-file",
        str(secret),
    ]


@pytest.mark.parametrize("verb", ["node", "coordinator"])
@pytest.mark.parametrize("inside", [False, True], ids=["the-dir", "a-new-dir-inside"])
def test_a_read_only_data_dir_is_one_error_line_naming_it(
    isolated: Path, shoal_env: dict[str, str], read_only_dir: Path, verb: str, inside: bool
) -> None:
    secret = isolated / "secret"
    secret.write_text("s" * 64)
    secret.chmod(0o600)
    data_dir = read_only_dir / "d" if inside else read_only_dir
    done = _shoal(_daemon_argv(verb, data_dir, secret), shoal_env)
    reason = os.strerror(errno.EROFS if os.geteuid() == 0 else errno.EACCES)
    _one_error_line(done.returncode, done.stderr, str(data_dir.name), reason)


def test_only_file_system_errors_on_a_path_become_one_line() -> None:
    denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/srv/shoal")
    assert path_error(denied) == (
        f"/srv/shoal: {os.strerror(errno.EACCES)}; choose a path this user may write, "
        "or fix its permissions"
    )
    assert path_error(ConnectionRefusedError(errno.ECONNREFUSED, "refused")) is None
    assert path_error(OSError(errno.ENOSPC, "No space left on device")) is None  # no path
