"""`shoal up / status / logs / down` and `shoal coordinator`'s refusals, as a user runs them."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.local import LocalCluster
from shoal.ports import free_port

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def shoal(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "shoal", *args], capture_output=True, text=True, timeout=90
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_up_status_logs_down_leave_nothing_running(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    local = LocalCluster(run_dir)
    try:
        out = shoal("up", "--replicas", "3", "--run-dir", str(run_dir)).stdout
        assert "leader http://127.0.0.1:" in out
        for name in ("secret", "api-token"):
            assert (run_dir / name).stat().st_mode & 0o777 == 0o600
        status = json.loads(shoal("status", "--json", "--run-dir", str(run_dir)).stdout)
        states = sorted(p["state"] for p in status["processes"])
        assert states == ["follower", "follower", "leader"]
        assert len({p["leader"] for p in status["processes"]}) == 1
        again = shoal("up", "--run-dir", str(run_dir), check=False)
        assert again.returncode == 2
        assert "already running" in again.stderr
        assert "replica c2" in shoal("logs", "c2", "--run-dir", str(run_dir)).stdout
        pids = [p["pid"] for p in status["processes"]]
        assert "stopped c1, c2, c3" in shoal("down", "--run-dir", str(run_dir)).stdout
        assert all(
            not Path(f"/proc/{pid}").exists()
            or b"zombie" in Path(f"/proc/{pid}/status").read_bytes().lower()
            for pid in pids
        )
        assert all(
            p["state"] == "down"
            for p in json.loads(shoal("status", "--json", "--run-dir", str(run_dir)).stdout)[
                "processes"
            ]
        )
    finally:
        if (run_dir / "cluster.json").exists():
            local.stop_all()


def test_status_and_logs_without_a_cluster_say_how_to_start_one(tmp_path: Path) -> None:
    for verb in ("status", "down", "logs"):
        proc = shoal(verb, "--run-dir", str(tmp_path / "none"), check=False)
        assert proc.returncode == 2
        assert "shoal up" in proc.stderr


def test_up_rejects_an_even_replica_count(tmp_path: Path) -> None:
    proc = shoal("up", "--replicas", "2", "--run-dir", str(tmp_path), check=False)
    assert proc.returncode == 2
    assert "--replicas=2 must be odd" in proc.stderr


def _token(tmp_path: Path, mode: int = 0o600) -> Path:
    path = tmp_path / "token"
    path.write_text("t0k3n")
    os.chmod(path, mode)
    return path


def _secret(tmp_path: Path, text: str = "a-cluster-secret-of-enough-length") -> Path:
    path = tmp_path / "secret"
    path.write_text(text)
    os.chmod(path, 0o600)
    return path


@pytest.mark.parametrize("raft", ["127.0.0.1", "10.1.2.3"])
def test_coordinator_refuses_to_start_without_the_secret(tmp_path: Path, raft: str) -> None:
    proc = shoal(
        "coordinator", "--id", "c1", "--raft", f"{raft}:7000", "--api", "127.0.0.1:7001",
        "--data-dir", str(tmp_path), "--token-file", str(_token(tmp_path)), check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "refusing to start without the cluster secret" in proc.stderr
    assert "pass --secret-file FILE" in proc.stderr


def test_coordinator_refuses_a_short_secret(tmp_path: Path) -> None:
    proc = shoal(
        "coordinator", "--id", "c1", "--raft", "127.0.0.1:7000", "--api", "127.0.0.1:7001",
        "--data-dir", str(tmp_path), "--token-file", str(_token(tmp_path)),
        "--secret-file", str(_secret(tmp_path, "hunter2")), check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "the cluster secret has 7 characters; use at least 16" in proc.stderr


def test_coordinator_refuses_a_token_file_others_can_read(tmp_path: Path) -> None:
    proc = shoal(
        "coordinator", "--id", "c1", "--raft", "127.0.0.1:7000", "--api", "127.0.0.1:7001",
        "--data-dir", str(tmp_path), "--token-file", str(_token(tmp_path, 0o644)), check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "chmod 600" in proc.stderr


def test_coordinator_rejects_bad_timings_naming_the_key(tmp_path: Path) -> None:
    proc = shoal(
        "coordinator", "--id", "c1", "--raft", "127.0.0.1:7000", "--api", "127.0.0.1:7001",
        "--data-dir", str(tmp_path), "--token-file", str(_token(tmp_path)),
        "--min-election-timeout", "0.1", check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "raft.min_timeout=0.1 must exceed 3 x raft.append_period" in proc.stderr


def test_coordinator_reports_an_address_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = shoal(
            "coordinator", "--id", "c1", "--raft", f"127.0.0.1:{port}", "--api", f"127.0.0.1:{free_port()}",
            "--data-dir", str(tmp_path / "d"), "--token-file", str(_token(tmp_path)),
            "--secret-file", str(_secret(tmp_path)), check=False,
        )  # fmt: skip
    assert proc.returncode == 2
    assert f"--raft=127.0.0.1:{port} cannot be bound" in proc.stderr


def test_two_coordinators_cannot_share_a_data_dir(tmp_path: Path) -> None:
    data = tmp_path / "d"
    data.mkdir()
    with open(data / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = shoal(
            "coordinator", "--id", "c1", "--raft", f"127.0.0.1:{free_port()}", "--api", f"127.0.0.1:{free_port()}",
            "--data-dir", str(data), "--token-file", str(_token(tmp_path)),
            "--secret-file", str(_secret(tmp_path)), check=False,
        )  # fmt: skip
    assert proc.returncode == 2
    assert "is in use by another coordinator" in proc.stderr
