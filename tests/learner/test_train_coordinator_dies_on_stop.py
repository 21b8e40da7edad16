"""`shoal train` stopped in order (SIGTERM) while its embedded coordinator does not answer, which
then dies: the one error line says which process died and why (as when it dies mid-run, a full
disk, say), not that the stop request was refused. The interleaving is forced, not hoped for:
the coordinator is frozen (SIGSTOP) before the run is told to stop, and killed only once the
run ignores SIGTERM (it is stopping in order) and holds a connection to the frozen coordinator
(its stop request)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from shoal.chaos.sockets import holds_socket, tcp_table
from shoal.local import LocalCluster
from tests.support.waiting import eventually

SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def _checkpointed(run_dir: Path) -> bool:
    events = run_dir / "events.jsonl"
    if not events.exists():
        return False
    return any(
        line.startswith("{") and json.loads(line).get("event") == "checkpoint"
        for line in events.read_text().splitlines()
    )


def _ignores_sigterm(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & SIGTERM_BIT)
    return False


def _dialled(pid: int, port: int) -> bool:
    """Whether process `pid` holds a TCP connection to 127.0.0.1:`port`."""
    table = tcp_table(Path("/proc") / str(pid))
    return any(
        remote == ("127.0.0.1", port) and holds_socket(pid, inode)
        for (_, remote), inode in table.items()
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_coordinator_that_dies_while_the_run_stops_is_named_in_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "SHOAL_HOME": str(tmp_path / "home"),
        "SHOAL_RUN_DIR": str(tmp_path / "cluster"),
    }
    shoal = Path(sys.executable).with_name("shoal")
    argv = [str(shoal), "train", "cartpole", "--run-dir", str(run_dir), "--quiet", "--no-eval"]
    argv += ["--json", "--checkpoint-interval", "1", "--time-limit", "600"]
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        eventually(lambda: _checkpointed(run_dir), "a first checkpoint", 240.0)
        cluster = LocalCluster(run_dir)
        (replica,) = [s for s in cluster.specs() if s.api_url is not None]
        assert replica.api_url is not None
        pid = cluster.pid(replica.name)
        assert pid is not None
        port = urlsplit(replica.api_url).port
        assert port is not None
        os.kill(pid, signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        eventually(lambda: _ignores_sigterm(proc.pid), "the run stopping in order", 120.0)
        eventually(
            lambda: _dialled(proc.pid, port), "its stop request to the frozen replica", 120.0
        )
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if (run_dir / "cluster.json").exists():
            LocalCluster(run_dir).stop_all()
    assert "Traceback" not in err, err
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"shoal: error: {replica.name} of the embedded cluster exited; "), (
        err
    )
    assert "the newest complete checkpoint is " in lines[0], err
