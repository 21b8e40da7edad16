"""`--raft-bind`: a replica advertises `--raft` to its peers but listens on `--raft-bind`, so a
proxy can stand at the advertised address (what chaos's Raft partitions need)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.errors import ConfigError
from shoal.raft.config import CoordinatorConfig

from .inprocess import SECRET, TOKEN, InProcessReplica, free_port

pytestmark = pytest.mark.timeout(120)


def _coordinator(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    for name, text in (("token", "t0k3n"), ("secret", SECRET)):
        (tmp_path / name).write_text(text)
        os.chmod(tmp_path / name, 0o600)
    argv = [
        sys.executable, "-m", "shoal", "coordinator", "--id", "c1",
        "--raft", f"127.0.0.1:{free_port()}", "--api", f"127.0.0.1:{free_port()}",
        "--data-dir", str(tmp_path / "d"), "--token-file", str(tmp_path / "token"),
        "--secret-file", str(tmp_path / "secret"), *args,
    ]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_a_malformed_raft_bind_is_refused_naming_the_flag(tmp_path: Path) -> None:
    proc = _coordinator(tmp_path, "--raft-bind", "nowhere")
    assert proc.returncode == 2
    assert "--raft-bind='nowhere' is not HOST:PORT" in proc.stderr


def test_a_raft_bind_address_in_use_is_refused_naming_the_flag(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _coordinator(tmp_path, "--raft-bind", f"127.0.0.1:{port}")
    assert proc.returncode == 2
    assert f"--raft-bind=127.0.0.1:{port} cannot be bound" in proc.stderr


@pytest.mark.parametrize("bind", [None, "127.0.0.1:7002", "10.1.2.3:7000"])
def test_every_replica_needs_the_secret_even_on_loopback(tmp_path: Path, bind: str | None) -> None:
    with pytest.raises(ConfigError, match="refusing to start without the cluster secret"):
        CoordinatorConfig(
            replica_id="c1",
            raft="127.0.0.1:7000",
            raft_bind=bind,
            peers=(),
            api="127.0.0.1:7001",
            data_dir=tmp_path,
            secret="",
            token=TOKEN,
        )


def test_the_replica_listens_on_raft_bind_and_names_itself_by_raft(tmp_path: Path) -> None:
    bind = f"127.0.0.1:{free_port()}"
    replica = InProcessReplica(tmp_path, raft_bind=bind)
    try:
        replica.start()
        status, body = replica.request("GET", "/v1/cluster")
        assert status == 200
        assert body["raft"] == replica.config.raft
        assert body["leader"] == replica.config.raft
        with socket.create_connection(("127.0.0.1", int(bind.rsplit(":", 1)[1])), timeout=5):
            pass
        advertised = int(replica.config.raft.rsplit(":", 1)[1])
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", advertised), timeout=5).close()
    finally:
        replica.close()
