"""CheckpointManager: complete-or-ignored checkpoints, corruption skipped, disk full survived."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import ConfigError
from shoal.learner.checkpoint import CheckpointManager, SaveSchedule
from shoal.learner.errors import CheckpointError
from shoal.learner.policy import ActorCritic


def state_for(step: int) -> dict:
    return {
        "step": step,
        "weights": torch.full((4, 4), float(step)),
        "extra": {"arr": np.arange(3)},
    }


@pytest.fixture
def manager(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", keep=5)
    try:
        yield mgr
    finally:
        mgr.close()


def test_round_trip_of_a_policy_and_optimizer(manager):
    from gymnasium import spaces

    model = ActorCritic((4,), spaces.Discrete(2))
    opt = torch.optim.Adam(model.parameters())
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "spec": model.spec(),
        "step": 7,
    }
    info = manager.save(state, 7, meta={"env_hash": "abc"}, block=True)
    latest = manager.latest()
    assert latest == info
    assert latest.meta == {"env_hash": "abc"}
    loaded = manager.load(latest)
    clone = ActorCritic.from_spec(loaded["spec"])
    clone.load_state_dict(loaded["model"])
    for a, b in zip(model.parameters(), clone.parameters()):
        torch.testing.assert_close(a, b)
    assert loaded["step"] == 7


def test_the_snapshot_is_taken_at_save_time(manager):
    weights = torch.zeros(3)
    manager.save({"w": weights}, 1)
    weights.add_(5.0)  # training goes on while the writer thread works
    manager.wait()
    torch.testing.assert_close(manager.load(manager.latest())["w"], torch.zeros(3))


def test_numpy_arrays_come_back_as_tensors(manager):
    manager.save(state_for(1), 1, block=True)
    loaded = manager.load(manager.latest())
    torch.testing.assert_close(loaded["extra"]["arr"], torch.arange(3))


def test_newest_complete_wins_and_keep_prunes(tmp_path):
    with CheckpointManager(tmp_path, keep=2) as mgr:
        for step in (10, 20, 30):
            mgr.save(state_for(step), step)
        mgr.wait()
        assert mgr.latest().step == 30
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "ckpt-000000000020.json", "ckpt-000000000020.pt",
            "ckpt-000000000030.json", "ckpt-000000000030.pt",
        ]  # fmt: skip


def corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def corrupt_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def corrupt_drop_manifest(path: Path) -> None:
    path.with_suffix(".json").unlink()


def corrupt_garble_manifest(path: Path) -> None:
    path.with_suffix(".json").write_text("{not json")


def corrupt_drop_data(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize(
    ("corrupt", "warning"),
    [
        (corrupt_flip, "sha256 does not match"),
        (corrupt_truncate, "sha256 does not match"),
        (corrupt_drop_manifest, "manifest is missing"),
        (corrupt_garble_manifest, "unreadable"),
        (corrupt_drop_data, "unreadable"),
    ],
)
def test_broken_newest_checkpoint_is_skipped_with_a_warning(manager, caplog, corrupt, warning):
    manager.save(state_for(1), 1)
    newest = manager.save(state_for(2), 2)
    manager.wait()
    corrupt(newest.path)
    with caplog.at_level(logging.WARNING, logger="shoal.learner.checkpoint"):
        latest = manager.latest()
    assert latest is not None
    assert latest.step == 1
    assert warning in caplog.text
    assert manager.load(latest)["step"] == 1


def test_load_refuses_a_corrupt_file(manager):
    info = manager.save(state_for(3), 3, block=True)
    corrupt_flip(info.path)
    with pytest.raises(CheckpointError, match="does not match its recorded sha256"):
        manager.load(info)


def test_no_checkpoint_gives_none(manager):
    assert manager.latest() is None


def test_load_never_unpickles_arbitrary_objects(manager):
    """A file whose hash matches but holds a pickled object is refused by weights_only."""
    info = manager.save(state_for(1), 1, block=True)
    payload = _pickled_fraction()
    info.path.write_bytes(payload)
    manifest = json.loads(info.manifest.read_text())
    manifest["sha256"] = hashlib.sha256(payload).hexdigest()
    info.manifest.write_text(json.dumps(manifest))
    forged = manager.latest()
    assert forged is not None
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        manager.load(forged)


def _pickled_fraction() -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save({"evil": Fraction(1, 3)}, buffer)
    return buffer.getvalue()


def test_unstorable_state_is_refused_naming_the_path(manager):
    with pytest.raises(CheckpointError, match=r"state\['cfg'\] is a Fraction"):
        manager.save({"cfg": Fraction(1, 2)}, 1)
    with pytest.raises(CheckpointError, match="step must be an integer >= 0"):
        manager.save({}, -1)
    with pytest.raises(CheckpointError, match="state must be a dict"):
        manager.save([1], 1)  # type: ignore[arg-type]


def test_disk_full_raises_and_keeps_the_previous_checkpoint(manager):
    """A real ENOSPC: the new checkpoint's temp file is a link to /dev/full."""
    if not os.path.exists("/dev/full"):
        pytest.skip("/dev/full is not available on this system")
    manager.save(state_for(1), 1, block=True)
    (manager.directory / ".ckpt-000000000002.pt.tmp").symlink_to("/dev/full")
    with pytest.raises(CheckpointError, match=r"disk is full.*older checkpoints are untouched"):
        manager.save(state_for(2), 2, block=True)
    latest = manager.latest()
    assert latest.step == 1
    assert manager.load(latest)["step"] == 1
    assert not (manager.directory / ".ckpt-000000000002.pt.tmp").exists()


def _full_temp_file(manager: CheckpointManager, step: int) -> Path:
    """The temp file of `step`'s data made a link to /dev/full: a real ENOSPC on its write."""
    if not os.path.exists("/dev/full"):
        pytest.skip("/dev/full is not available on this system")
    link = manager.directory / f".ckpt-{step:012d}.pt.tmp"
    link.symlink_to("/dev/full")
    return link


def test_a_failed_background_write_is_counted_and_a_later_one_supersedes_it(manager):
    """What a trainer sees through a full disk: failures counted at once, nothing raised
    once a newer checkpoint is complete, and checkpoints only move forward."""
    manager.save(state_for(1), 1, block=True)
    _full_temp_file(manager, 2)
    manager.save(state_for(2), 2)
    manager.save(state_for(3), 3)
    manager.wait()  # step 3 is complete: step 2's failure no longer matters here
    assert manager.failures == 1
    assert "checkpoint step 2" in (manager.last_failure or "")
    assert "disk is full" in (manager.last_failure or "")
    assert manager.last_complete is not None
    assert manager.last_complete.step == 3
    assert [i.step for i in manager.list_complete()] == [3, 1]


def test_wait_raises_once_when_the_newest_write_failed(manager):
    manager.save(state_for(1), 1, block=True)
    _full_temp_file(manager, 2)
    manager.save(state_for(2), 2)
    with pytest.raises(CheckpointError, match=r"checkpoint step 2.*disk is full"):
        manager.wait()
    manager.wait()  # reported once
    assert manager.failures == 1
    assert manager.last_complete is not None
    assert manager.last_complete.step == 1
    assert "failures=1" in repr(manager)


@pytest.mark.timeout(120)
def test_file_size_limit_in_a_child_process_is_reported_and_survived(tmp_path):
    """RLIMIT_FSIZE makes the child's real write fail (EFBIG); its old checkpoint stays loadable."""
    with CheckpointManager(tmp_path, keep=3) as mgr:
        mgr.save(state_for(1), 1, block=True)
    script = textwrap.dedent(
        f"""
        import resource, signal, sys, torch
        from shoal.learner.checkpoint import CheckpointManager
        from shoal.learner.errors import CheckpointError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        mgr = CheckpointManager({str(tmp_path)!r}, keep=3)
        try:
            mgr.save({{"big": torch.zeros(1 << 20)}}, 2, block=True)
        except CheckpointError as exc:
            print(exc)
            sys.exit(3)
        sys.exit(0)
        """
    )
    child = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=100
    )
    assert child.returncode == 3, child.stderr
    assert "checkpoint step 2" in child.stdout
    assert "older checkpoints are untouched" in child.stdout
    with CheckpointManager(tmp_path, keep=3) as mgr:
        latest = mgr.latest()
        assert latest.step == 1
        assert mgr.load(latest)["step"] == 1
    assert not list(tmp_path.glob(".*.tmp"))


def test_periodic_schedule_with_an_injected_clock(manager):
    now = [100.0]
    schedule = manager.periodic(interval_s=2.0, clock=lambda: now[0])
    assert not schedule.due()
    now[0] = 101.5
    assert schedule.remaining() == pytest.approx(0.5)
    now[0] = 102.0
    assert schedule.due()
    schedule.mark_saved()
    assert not schedule.due()
    assert SaveSchedule().interval_s == 900.0


@pytest.mark.parametrize("interval", [0, -1.0, float("inf"), "5", True])
def test_bad_interval_is_a_config_error(interval):
    with pytest.raises(ConfigError, match=r"checkpoint\.interval"):
        SaveSchedule(interval)


@pytest.mark.parametrize("keep", [0, -2, 1.5, True])
def test_bad_keep_is_a_config_error(tmp_path, keep):
    with pytest.raises(ConfigError, match=r"checkpoint\.keep"):
        CheckpointManager(tmp_path, keep=keep)


def test_unwritable_directory_is_a_checkpoint_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="cannot create checkpoint directory"):
        CheckpointManager(blocker / "sub")


def test_a_reader_never_deletes_a_temp_file_and_the_writer_cleans_stale_ones(manager):
    in_flight = manager.directory / ".ckpt-000000000009.pt.tmp"
    in_flight.write_bytes(b"half")
    with CheckpointManager(manager.directory) as reader:
        assert reader.latest() is None
    assert in_flight.exists()
    manager.save(state_for(1), 1, block=True)
    assert not in_flight.exists()


def test_saving_the_same_step_and_content_again_rewrites_nothing(manager):
    first = manager.save(state_for(4), 4, block=True)
    written = first.path.stat().st_mtime_ns, first.manifest.stat().st_mtime_ns
    again = manager.save(state_for(4), 4, block=True)
    assert again.sha256 == first.sha256
    assert (first.path.stat().st_mtime_ns, first.manifest.stat().st_mtime_ns) == written
    changed = manager.save({**state_for(4), "extra": 1}, 4, block=True)
    assert manager.latest().sha256 == changed.sha256 != first.sha256


leaves = st.one_of(
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.booleans(),
    st.none(),
    st.lists(st.floats(-1e6, 1e6, width=32), max_size=6).map(
        lambda v: torch.tensor(v, dtype=torch.float32)
    ),
)
states = st.dictionaries(
    st.text(min_size=1, max_size=6),
    st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
        ),
        max_leaves=8,
    ),
    max_size=5,
)


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


@given(state=states, step=st.integers(0, 10**9))
@settings(max_examples=15, deadline=None)
def test_any_storable_state_round_trips(state, step):
    with tempfile.TemporaryDirectory() as directory, CheckpointManager(directory) as mgr:
        info = mgr.save(state, step, block=True)
        assert mgr.latest() == info
        assert_same(state, mgr.load(info))


def test_a_run_reports_only_a_checkpoint_that_was_written(tmp_path):
    """Rank 0's status names the checkpoint it began to write. On a full disk that one never
    completes: the run reports (and records) the newest complete one, and says why."""
    from shoal.learner.config import TrainConfig
    from shoal.train import RunStatus, find_checkpoint

    if not os.path.exists("/dev/full"):
        pytest.skip("/dev/full is not available on this system")
    run_dir = tmp_path / "run"
    with CheckpointManager(run_dir / "checkpoints") as mgr:
        written = mgr.save(state_for(1), 1, block=True)
        (mgr.directory / ".ckpt-000000000002.pt.tmp").symlink_to("/dev/full")
        began = mgr.save(state_for(2), 2)  # what the rank's status names at once
        with pytest.raises(CheckpointError, match="disk is full"):
            mgr.wait()
        claim = {
            "checkpoint": str(began.path),
            "checkpoint_step": began.step,
            "checkpoint_failures": mgr.failures,
            "checkpoint_error": mgr.last_failure,
        }
    (run_dir / "status-0.json").write_text(json.dumps(claim))
    status = RunStatus(TrainConfig(), "CartPole-v1", run_dir, None)
    status.read()
    result = status.result("time_limit", 1.0, None, None, None)
    assert (result.checkpoint, result.checkpoint_step) == (str(written.path), 1)
    assert find_checkpoint(Path(result.checkpoint)) == written
    assert result.checkpoint_error is not None
    assert result.checkpoint_error.startswith("checkpoint step 2 was not written; ")
    assert "disk is full" in result.checkpoint_error

    claim.update(checkpoint=str(written.path), checkpoint_step=1)
    (run_dir / "status-0.json").write_text(json.dumps(claim))
    status.read()
    healed = status.result("time_limit", 1.0, None, None, None)
    assert (healed.checkpoint, healed.checkpoint_error) == (str(written.path), None)


def test_a_run_without_a_complete_checkpoint_reports_none(tmp_path):
    from shoal.learner.config import TrainConfig
    from shoal.train import RunStatus

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "ckpt-000000000003.pt").write_bytes(b"half")  # no manifest
    (run_dir / "status-0.json").write_text(
        json.dumps(
            {
                "checkpoint": str(run_dir / "checkpoints" / "ckpt-000000000003.pt"),
                "checkpoint_step": 3,
            }
        )
    )
    status = RunStatus(TrainConfig(), "CartPole-v1", run_dir, None)
    status.read()
    result = status.result("error", 1.0, None, None, None)
    assert (result.checkpoint, result.checkpoint_step) == (None, None)
    assert result.checkpoint_error == "checkpoint step 3 was not written"
