"""CheckpointManager: complete-or-ignored checkpoints, corruption skipped, disk full survived.
(Sharded saves across real process groups: test_checkpoint_dcp.py.)"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import ConfigError
from shoal.files import temp_path
from shoal.learner.checkpoint import CheckpointManager, SaveSchedule
from shoal.learner.errors import CheckpointError


def tensors_for(step: int) -> dict:
    return {"weights": torch.full((4, 4), float(step)), "nested": {"b": torch.arange(3)}}


def template() -> dict:
    return {"weights": torch.empty(4, 4), "nested": {"b": torch.empty(3, dtype=torch.int64)}}


def save(manager: CheckpointManager, step: int, block: bool = False) -> Path:
    return manager.save(tensors_for(step), step, {"step": step}, block=block)


def loaded(manager: CheckpointManager, info) -> dict:
    out = template()
    manager.load_tensors(info, out)
    return out


@pytest.fixture
def manager(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", keep=5)
    try:
        yield mgr
    finally:
        mgr.close()


def test_round_trip_of_tensors_trainer_state_and_meta(manager):
    path = manager.save(tensors_for(7), 7, {"env_steps": 70, "cfg": {"a": [1, 2]}},
                        meta={"env_hash": "abc"}, block=True)  # fmt: skip
    latest = manager.latest()
    assert latest == manager.last_complete
    assert (latest.path, latest.step, latest.format) == (path, 7, 2)
    assert latest.meta == {"env_hash": "abc"}
    assert manager.load_trainer(latest) == {"env_steps": 70, "cfg": {"a": [1, 2]}}
    torch.testing.assert_close(loaded(manager, latest)["weights"], torch.full((4, 4), 7.0))


def test_the_snapshot_is_taken_at_save_time(manager):
    weights = torch.zeros(3)
    manager.save({"w": weights}, 1, {})
    weights.add_(5.0)  # training goes on while the writer thread works
    manager.wait()
    out = {"w": torch.empty(3)}
    manager.load_tensors(manager.latest(), out)
    torch.testing.assert_close(out["w"], torch.zeros(3))


def test_newest_complete_wins_and_keep_prunes(tmp_path):
    with CheckpointManager(tmp_path, keep=2) as mgr:
        for step in (10, 20, 30):
            save(mgr, step)
        mgr.wait()
        assert mgr.latest().step == 30
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "ckpt-000000000020", "ckpt-000000000020.json",
            "ckpt-000000000030", "ckpt-000000000030.json",
        ]  # fmt: skip


def shard(path: Path) -> Path:
    return path / "__0_0.distcp"


def corrupt_flip(path: Path) -> None:
    data = bytearray(shard(path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard(path).write_bytes(bytes(data))


def corrupt_truncate(path: Path) -> None:
    shard(path).write_bytes(shard(path).read_bytes()[:-10])


def corrupt_drop_manifest(path: Path) -> None:
    path.with_suffix(".json").unlink()


def corrupt_garble_manifest(path: Path) -> None:
    path.with_suffix(".json").write_text("{not json")


def corrupt_drop_data(path: Path) -> None:
    shard(path).unlink()


def corrupt_trainer(path: Path) -> None:
    (path / "trainer.json").write_text('{"step": 99}')


@pytest.mark.parametrize(
    ("corrupt", "warning"),
    [
        (corrupt_flip, "sha256 does not match"),
        (corrupt_truncate, "sha256 does not match"),
        (corrupt_drop_manifest, "manifest is missing"),
        (corrupt_garble_manifest, "manifest refused: not valid JSON"),
        (corrupt_drop_data, "unreadable"),
        (corrupt_trainer, "sha256 does not match"),
    ],
)
def test_broken_newest_checkpoint_is_skipped_with_a_warning(manager, caplog, corrupt, warning):
    save(manager, 1)
    newest = save(manager, 2)
    manager.wait()
    corrupt(newest)
    with CheckpointManager(manager.directory) as reader:
        with caplog.at_level(logging.WARNING, logger="shoal.learner.checkpoint"):
            latest = reader.latest()
        assert latest is not None
        assert latest.step == 1
        assert warning in caplog.text
        assert reader.load_trainer(latest) == {"step": 1}


def test_load_refuses_a_file_corrupted_after_it_was_found(manager):
    save(manager, 3, block=True)
    info = manager.latest()
    corrupt_flip(info.path)
    with pytest.raises(CheckpointError, match="sha256 does not match its manifest"):
        loaded(manager, info)
    (info.path / "trainer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="does not match its manifest's sha256"):
        manager.load_trainer(info)


def test_no_checkpoint_gives_none(manager):
    assert manager.latest() is None


def test_unstorable_state_is_refused_naming_the_path(manager):
    with pytest.raises(CheckpointError, match=r"tensors\['cfg'\] is a int"):
        manager.save({"cfg": 1}, 1, {})
    with pytest.raises(CheckpointError, match="step must be an integer >= 0"):
        manager.save({}, -1, {})
    with pytest.raises(CheckpointError, match="trainer state must be a dict"):
        manager.save({}, 1, [1])  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="not plain JSON"):
        manager.save({}, 1, {"x": float("nan")})
    with pytest.raises(CheckpointError, match="finite numbers"):
        manager.save({}, 1, {}, meta={"x": float("inf")})


def _full_manifest_temp(manager: CheckpointManager, step: int) -> Path:
    """The temp file of `step`'s manifest made a link to /dev/full: a real ENOSPC on its write."""
    if not os.path.exists("/dev/full"):
        pytest.skip("/dev/full is not available on this system")
    link = temp_path(manager.directory / f"ckpt-{step:012d}.json")
    link.symlink_to("/dev/full")
    return link


def test_disk_full_raises_and_keeps_the_previous_checkpoint(manager):
    save(manager, 1, block=True)
    link = _full_manifest_temp(manager, 2)
    with pytest.raises(CheckpointError, match=r"disk is full.*older checkpoints are untouched"):
        save(manager, 2, block=True)
    latest = manager.latest()
    assert latest.step == 1
    assert manager.load_trainer(latest) == {"step": 1}
    assert not link.exists()
    assert not (manager.directory / "ckpt-000000000002").exists()  # its space is given back
    assert not list(manager.directory.glob(".ckpt-*.partial"))


def test_a_failed_background_write_is_counted_and_a_later_one_supersedes_it(manager):
    """What a trainer sees through a full disk: failures counted at once, nothing raised
    once a newer checkpoint is complete, and checkpoints only move forward."""
    save(manager, 1, block=True)
    _full_manifest_temp(manager, 2)
    save(manager, 2)
    save(manager, 3)
    manager.wait()  # step 3 is complete: step 2's failure no longer matters here
    assert manager.failures == 1
    assert "checkpoint step 2" in (manager.last_failure or "")
    assert "disk is full" in (manager.last_failure or "")
    assert manager.last_complete is not None
    assert manager.last_complete.step == 3
    assert [i.step for i in manager.list_complete()] == [3, 1]


def test_wait_raises_once_when_the_newest_write_failed(manager):
    save(manager, 1, block=True)
    _full_manifest_temp(manager, 2)
    save(manager, 2)
    with pytest.raises(CheckpointError, match=r"checkpoint step 2.*disk is full"):
        manager.wait()
    manager.wait()  # reported once
    assert manager.failures == 1
    assert manager.last_complete is not None
    assert manager.last_complete.step == 1
    assert "failures=1" in repr(manager)


@pytest.mark.timeout(120)
def test_file_size_limit_in_a_child_process_is_reported_and_survived(tmp_path):
    """RLIMIT_FSIZE makes the child's real shard write fail (EFBIG) inside DCP's writer; its
    old checkpoint stays loadable and the half-written shards are removed."""
    with CheckpointManager(tmp_path, keep=3) as mgr:
        save(mgr, 1, block=True)
    script = textwrap.dedent(
        f"""
        import resource, signal, sys, torch
        from shoal.learner.checkpoint import CheckpointManager
        from shoal.learner.errors import CheckpointError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        mgr = CheckpointManager({str(tmp_path)!r}, keep=3)
        try:
            mgr.save({{"big": torch.zeros(1 << 20)}}, 2, {{}}, block=True)
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
    assert "file size limit" in child.stdout
    assert "older checkpoints are untouched" in child.stdout
    with CheckpointManager(tmp_path, keep=3) as mgr:
        latest = mgr.latest()
        assert latest.step == 1
        assert mgr.load_trainer(latest) == {"step": 1}
    assert not list(tmp_path.glob(".ckpt-*"))


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


def test_a_reader_never_deletes_a_staging_directory_and_the_writer_cleans_stale_ones(manager):
    in_flight = manager.directory / ".ckpt-000000000009.abcdef.partial"
    in_flight.mkdir()
    (in_flight / "__0_0.distcp").write_bytes(b"half")
    orphan = manager.directory / "ckpt-000000000000"  # renamed into place, no manifest yet
    orphan.mkdir()
    with CheckpointManager(manager.directory) as reader:
        assert reader.latest() is None
    assert in_flight.exists()
    assert orphan.exists()
    save(manager, 1, block=True)
    assert not in_flight.exists()
    assert not orphan.exists()


def test_saving_the_same_step_again_replaces_it(manager):
    save(manager, 4, block=True)
    first = manager.latest()
    manager.save(tensors_for(5), 4, {"step": "again"}, block=True)
    again = manager.latest()
    assert (again.step, again.path) == (4, first.path)
    assert again.sha256 != first.sha256
    assert manager.load_trainer(again) == {"step": "again"}
    assert [i.step for i in manager.list_complete()] == [4]


tensor_trees = st.recursive(
    st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=6).map(
        lambda v: torch.tensor(v, dtype=torch.float32)
    ),
    lambda inner: st.dictionaries(st.text("abcxyz_", min_size=1, max_size=4), inner,
                                  min_size=1, max_size=3),
    max_leaves=6,
)  # fmt: skip
json_trees = st.recursive(
    st.one_of(st.integers(-(2**40), 2**40), st.floats(allow_nan=False, allow_infinity=False),
              st.text(max_size=8), st.booleans(), st.none()),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip


def empty_like(tree):
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree)
    return {k: empty_like(v) for k, v in tree.items()}


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b)
        return
    assert a.keys() == b.keys()
    for key in a:
        assert_same(a[key], b[key])


@given(
    tensors=st.dictionaries(st.text("abc", min_size=1, max_size=3), tensor_trees, min_size=1,
                            max_size=3),
    trainer=st.dictionaries(st.text(max_size=6), json_trees, max_size=5),
    step=st.integers(0, 10**9),
)  # fmt: skip
@settings(max_examples=15, deadline=None)
def test_any_tensors_and_trainer_state_round_trip(tensors, trainer, step):
    with tempfile.TemporaryDirectory() as directory, CheckpointManager(directory) as mgr:
        mgr.save(tensors, step, trainer, block=True)
        info = mgr.latest()
        assert info == mgr.last_complete
        out = empty_like(tensors)
        mgr.load_tensors(info, out)
        assert_same(tensors, out)
        assert mgr.load_trainer(info) == json.loads(json.dumps(trainer))


def test_a_run_reports_only_a_checkpoint_that_was_written(tmp_path):
    """Rank 0's status names the checkpoint it began to write. On a full disk that one never
    completes: the run reports (and records) the newest complete one, and says why."""
    from shoal.learner.config import TrainConfig
    from shoal.run_status import RunStatus, find_checkpoint

    if not os.path.exists("/dev/full"):
        pytest.skip("/dev/full is not available on this system")
    run_dir = tmp_path / "run"
    with CheckpointManager(run_dir / "checkpoints") as mgr:
        written = save(mgr, 1, block=True)
        _full_manifest_temp(mgr, 2)
        began = save(mgr, 2)  # what the rank's status names at once
        with pytest.raises(CheckpointError, match="disk is full"):
            mgr.wait()
        claim = {
            "checkpoint": str(began),
            "checkpoint_step": 2,
            "checkpoint_failures": mgr.failures,
            "checkpoint_error": mgr.last_failure,
        }
    (run_dir / "status-0.json").write_text(json.dumps(claim))
    status = RunStatus(TrainConfig(), "CartPole-v1", run_dir, None)
    status.read()
    result = status.result("time_limit", 1.0, None, None, None)
    assert (result.checkpoint, result.checkpoint_step) == (str(written), 1)
    assert find_checkpoint(Path(result.checkpoint)).path == written
    assert find_checkpoint(written.with_suffix(".json")).path == written
    assert find_checkpoint(run_dir).path == written
    assert result.checkpoint_error is not None
    assert result.checkpoint_error.startswith("checkpoint step 2 was not written; ")
    assert "disk is full" in result.checkpoint_error

    claim.update(checkpoint=str(written), checkpoint_step=1)
    (run_dir / "status-0.json").write_text(json.dumps(claim))
    status.read()
    healed = status.result("time_limit", 1.0, None, None, None)
    assert (healed.checkpoint, healed.checkpoint_error) == (str(written), None)


def test_a_run_without_a_complete_checkpoint_reports_none(tmp_path):
    from shoal.learner.config import TrainConfig
    from shoal.run_status import RunStatus

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "ckpt-000000000003").mkdir(parents=True)  # no manifest
    (run_dir / "status-0.json").write_text(
        json.dumps(
            {
                "checkpoint": str(run_dir / "checkpoints" / "ckpt-000000000003"),
                "checkpoint_step": 3,
            }
        )
    )
    status = RunStatus(TrainConfig(), "CartPole-v1", run_dir, None)
    status.read()
    result = status.result("error", 1.0, None, None, None)
    assert (result.checkpoint, result.checkpoint_step) == (None, None)
    assert result.checkpoint_error == "checkpoint step 3 was not written"
