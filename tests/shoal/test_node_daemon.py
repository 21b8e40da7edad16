"""`shoal node` as a real process without a cluster: it waits for unreachable coordinators with
growing pauses and clear log lines, still stops on SIGTERM, refuses a data dir in use and bad
options with one line."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from shoal.ports import free_port
from tests.support.processes import logged_process
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(120)


def node_argv(data_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "shoal", "node",
        "--coordinators", f"http://127.0.0.1:{free_port()}",
        "--data-dir", str(data_dir), "--heartbeat", "0.2", *extra,
    ]  # fmt: skip


def node_env() -> dict[str, str]:
    """This process's environment with the operator token the node daemons here are given."""
    return {**os.environ, "SHOAL_API_TOKEN": "test-token"}


def run_node(
    data_dir: Path, *extra: str, env: dict[str, str] | None = None
) -> CompletedProcess[str]:
    """`shoal node` run to its end (these runs are refused at start-up): status and stderr."""
    argv = node_argv(data_dir, *extra)
    environment = node_env() if env is None else env
    return subprocess.run(argv, capture_output=True, text=True, env=environment, timeout=60)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    log = tmp_path / "node.log"
    with logged_process(node_argv(tmp_path / "data"), log, node_env()) as process:
        yield process, log


def wait_for_lines(log: Path, pattern: str, count: int) -> list[str]:
    def found() -> list[str] | None:
        lines = [line for line in log.read_text().splitlines() if re.search(pattern, line)]
        return lines if len(lines) >= count else None

    return eventually(found, f"{count} lines like {pattern!r} in {log}", 60, detail=log.read_text)


def test_unreachable_coordinators_are_retried_at_a_steady_period_and_sigterm_still_stops(
    daemon: tuple[subprocess.Popen[bytes], Path],
) -> None:
    """The first registration retries every 0.1 s (warned about every 5 s, not every try)."""
    process, log = daemon
    lines = wait_for_lines(log, r"cannot register node .* retrying in", 2)
    pauses = [float(re.search(r"retrying in ([0-9.]+) s", line)[1]) for line in lines[:2]]  # type: ignore[index]
    assert pauses == [0.1, 0.1]
    assert "did not accept" in lines[0]
    assert process.poll() is None
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


def test_a_data_dir_in_use_is_refused(
    daemon: tuple[subprocess.Popen[bytes], Path], tmp_path: Path
) -> None:
    _, log = daemon
    wait_for_lines(log, r"cannot register node", 1)
    second = run_node(tmp_path / "data")
    assert second.returncode == 2
    assert "used by another running node daemon" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--sim-gpus", "-2"], "--sim-gpus=-2 is invalid"),
        (["--label", "rack"], "--label 'rack' is invalid"),
        (["--heartbeat", "0"], "heartbeat_s=0.0 is invalid"),
        (["--node-id", "bad id!"], "--node-id='bad id!' is invalid"),
    ],
)
def test_bad_options_end_in_one_line(tmp_path: Path, extra: list[str], fragment: str) -> None:
    done = run_node(tmp_path / "data", *extra)
    assert done.returncode == 2
    assert fragment in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_listen_address_in_use_is_refused(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_node(tmp_path / "data", "--listen", f"127.0.0.1:{port}")
    assert done.returncode == 2
    assert f"--listen=127.0.0.1:{port} cannot be bound" in done.stderr


def test_a_missing_token_is_refused(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SHOAL_API_TOKEN"}
    done = run_node(tmp_path / "data", env=env)
    assert done.returncode == 2
    assert "--token-file" in done.stderr
