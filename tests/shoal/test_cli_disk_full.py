"""`shoal train` on a disk that fills up while it runs (a real tmpfs, filled for real).

Whoever runs out of room first (the embedded coordinator's Raft journal, or rank 0's next
checkpoint) the command ends in one line or a summary, never a traceback, and any checkpoint it
names is complete on disk: a status that says a checkpoint exists must have that checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.cluster_train import exit_reason
from shoal.learner.checkpoint import CheckpointInfo, CheckpointManager
from shoal.local import LocalCluster
from shoal.run_status import find_checkpoint
from shoal.rundir import MIN_FREE_BYTES
from tests.support.waiting import eventually

DISK_BYTES = MIN_FREE_BYTES + (8 << 20)
"""Room to start a run (the command refuses less) and to write its first checkpoints."""


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of DISK_BYTES of its own, unmounted at the end whatever happened."""
    if os.geteuid() != 0:
        pytest.skip(
            "mounting a tmpfs needs root; the unprivileged full disk is covered by "
            "tests/chaos/test_faults.py (RLIMIT_FSIZE on a real learner rank)"
        )
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def _fill(disk: Path, leave: int) -> None:
    """Write zeros until only `leave` bytes are free (or none)."""
    size = max(0, shutil.disk_usage(disk).free - leave)
    try:
        with open(disk / "filler", "wb") as handle:
            handle.write(bytes(size))
    except OSError:
        pass  # full already (even for the filler's own entry): the run wrote meanwhile


def _complete(run_dir: Path) -> CheckpointInfo | None:
    directory = run_dir / "checkpoints"
    if not directory.is_dir():
        return None
    with CheckpointManager(directory) as manager:
        return manager.latest()


def _stop_unless_ending(proc: subprocess.Popen[str], run_dir: Path) -> None:
    """Let the run train a few checkpoint periods on the full disk, then stop it in order
    (SIGTERM, like Ctrl-C), unless it is already ending by itself: a process of its embedded
    cluster died of the full disk (a signal then would only interrupt its shutdown)."""
    cluster = LocalCluster(run_dir)
    for _ in range(60):
        if proc.poll() is not None or any(cluster.pid(s.name) is None for s in cluster.specs()):
            return
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)


def _stop_everything(run_dir: Path, proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if (run_dir / "cluster.json").exists():
        LocalCluster(run_dir).stop_all()


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("leave", [0, 200 * 1024], ids=["no-room", "room-for-all-but-checkpoints"])
def test_a_disk_that_fills_during_a_run_ends_in_one_line_and_a_complete_checkpoint(
    tmp_path: Path, small_disk: Path, leave: int
) -> None:
    run_dir = small_disk / "run"
    env = {
        **os.environ,
        "SHOAL_HOME": str(tmp_path / "home"),
        "SHOAL_RUN_DIR": str(tmp_path / "cluster"),
    }
    argv = ["train", "cartpole", "--run-dir", str(run_dir), "--quiet", "--no-eval", "--json"]
    argv += ["--checkpoint-interval", "1", "--time-limit", "600"]
    shoal = Path(sys.executable).with_name("shoal")
    proc = subprocess.Popen(
        [str(shoal), *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        first = eventually(lambda: _complete(run_dir), "a first complete checkpoint", 240.0)
        _fill(small_disk, leave)
        _stop_unless_ending(proc, run_dir)
        out, err = proc.communicate()
    finally:
        _stop_everything(run_dir, proc)
    assert "Traceback" not in err, err
    newest = _complete(run_dir)
    assert newest is not None
    assert newest.step >= first.step
    if proc.returncode == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith("shoal: error: "), err
        assert "is full; free space or choose a --run-dir on a larger disk" in lines[0], err
        assert f"the newest complete checkpoint is {newest.path}" in lines[0], err
        return
    assert proc.returncode in (0, 1), err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["checkpoint"] is not None, out
    reported = find_checkpoint(Path(summary["checkpoint"]))  # complete, or TrainError
    assert (reported.step, reported.path) == (summary["checkpoint_step"], newest.path)
    assert f"checkpoint: {summary['checkpoint']}" in out  # a path outside the cwd: absolute
    if summary["checkpoint_error"] is not None:
        assert f"shoal: warning: {summary['checkpoint_error']}" in err


def test_a_process_that_died_of_a_full_disk_is_named_with_the_fix(tmp_path: Path) -> None:
    tail = (
        "Traceback (most recent call last):\n"
        '  File "pysyncobj/journal.py", line 163, in storeMeta\n'
        "OSError: [Errno 28] No space left on device\n"
    )
    assert exit_reason(tail, tmp_path) == (
        f"the disk holding {tmp_path} is full; free space or choose a --run-dir on a larger disk"
    )
    assert exit_reason("starting\nValueError: boom\n\n", tmp_path) == "ValueError: boom"
    assert exit_reason("", tmp_path) == "its log is empty"


def test_a_process_silent_on_a_full_disk_is_named_with_the_fix(small_disk: Path) -> None:
    """A replica that died of the full disk could not log why (its log is on that disk): the
    disk itself says so."""
    silent = "c1 leads term 1\n"
    assert exit_reason(silent, small_disk) == "c1 leads term 1"
    _fill(small_disk, 0)
    assert exit_reason(silent, small_disk) == (
        f"the disk holding {small_disk} is full; free space or choose a --run-dir on a larger disk"
    )


def test_a_run_dir_without_room_to_start_is_refused_before_anything_starts(
    small_disk: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shoal.cli import main

    _fill(small_disk, MIN_FREE_BYTES // 2)
    run_dir = small_disk / "run"
    assert main(["train", "cartpole", "--run-dir", str(run_dir), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shoal: error: run directory {run_dir} has "), err
    assert f"less than the {MIN_FREE_BYTES} a run needs" in err
    assert not (run_dir / "cluster.json").exists()
