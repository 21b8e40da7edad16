"""Sharded (DCP) checkpoints across real gloo groups: FSDP2 and DDP ranks save, a different
number of ranks restores (resharding), async saves keep the values of save time, broken or
hostile checkpoints are skipped or refused, and format-1 checkpoints still restore."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shoal.learner.checkpoint import CheckpointManager
from shoal.learner.checkpoint_files import MAX_MANIFEST_BYTES, parse_manifest
from shoal.learner.errors import CheckpointError
from shoal.learner.train_state import model_optimizer_state, restore_model_optimizer
from shoal.ports import free_port

RANKS = Path(__file__).with_name("checkpoint_ranks.py")
sys.path.insert(0, str(RANKS.parent))
from checkpoint_ranks import build, full, train_step  # noqa: E402


def run_ranks(mode: str, wrap: str, directory: Path, out: Path, world: int) -> None:
    """`world` real ranks of checkpoint_ranks.py on a fresh port; all killed on failure."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(RANKS),
                mode,
                wrap,
                str(directory),
                str(out),
                str(rank),
                str(world),
                str(port),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    try:
        outputs = [proc.communicate(timeout=200)[0] for proc in procs]
        for proc, output in zip(procs, outputs):
            assert proc.returncode == 0, output[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def assert_states_equal(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, msg=where)
        return
    assert isinstance(a, dict), where
    assert isinstance(b, dict), where
    assert a.keys() == b.keys(), f"{where}: {sorted(a)} != {sorted(b)}"
    for key in a:
        assert_states_equal(a[key], b[key], f"{where}.{key}")


def plain(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = build(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("wrap", ["fsdp", "ddp"])
def test_two_ranks_save_and_one_rank_restores(tmp_path: Path, wrap: str) -> None:
    """2 → 1: the shards of two ranks (written while they kept training) restore into one
    unwrapped model without a process group, equal to the state at save time."""
    directory = tmp_path / "ckpt"
    run_ranks("save", wrap, directory, tmp_path / "saved.pt", world=2)
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    with CheckpointManager(directory) as manager:
        info = manager.latest()
        assert info is not None
        assert (info.step, info.format) == (2, 2)
        manifest = json.loads(info.manifest.read_text())
        assert manifest["world_size"] == 2
        assert {f["path"] for f in manifest["files"]} >= {
            ".metadata", "trainer.json", "__0_0.distcp", "__1_0.distcp",
        }  # fmt: skip
        assert manager.load_trainer(info) == {"rank0": True, "world": 2}
        model, optimizer = plain(seed=99)
        restore_model_optimizer(model, optimizer, manager, info)
    assert_states_equal(saved, full(model_optimizer_state(model, optimizer)))
    train_step(model, optimizer, seed=5)  # the restored AdamW steps on from its state


@pytest.mark.timeout(300)
def test_one_rank_saves_and_two_fsdp_ranks_restore(tmp_path: Path) -> None:
    """1 → 2: a checkpoint of one plain process reshards into two FSDP2 ranks."""
    directory = tmp_path / "ckpt"
    model, optimizer = plain(seed=1)
    for step in range(3):
        train_step(model, optimizer, seed=step)
    with CheckpointManager(directory) as manager:
        manager.save(model_optimizer_state(model, optimizer), 3, {"from": "one"}, block=True)
    expected = full(model_optimizer_state(model, optimizer))
    run_ranks("load", "fsdp", directory, tmp_path / "loaded.pt", world=2)
    assert_states_equal(expected, torch.load(tmp_path / "loaded.pt", weights_only=True))


def test_async_save_keeps_the_values_of_save_time(tmp_path: Path) -> None:
    model, optimizer = plain(seed=2)
    train_step(model, optimizer, seed=0)
    expected = full(model_optimizer_state(model, optimizer))
    with CheckpointManager(tmp_path) as manager:
        manager.save(model_optimizer_state(model, optimizer), 1, {})
        for step in range(3):
            train_step(model, optimizer, seed=step + 1)
        manager.wait()
        restored, restored_opt = plain(seed=3)
        restore_model_optimizer(restored, restored_opt, manager, manager.latest())
    assert_states_equal(expected, full(model_optimizer_state(restored, restored_opt)))


def saved_twice(directory: Path) -> CheckpointManager:
    manager = CheckpointManager(directory, keep=5)
    for step in (1, 2):
        manager.save({"w": torch.full((64,), float(step))}, step, {"step": step})
    manager.wait()
    return manager


def flip_shard(directory: Path) -> None:
    shard = directory / "ckpt-000000000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-8] ^= 0xFF
    shard.write_bytes(bytes(data))


def drop_manifest(directory: Path) -> None:
    (directory / "ckpt-000000000002.json").unlink()


def tamper_manifest(directory: Path) -> None:
    """Rehash a flipped shard in the table but leave the table's own digest: detected."""
    flip_shard(directory)
    path = directory / "ckpt-000000000002.json"
    manifest = json.loads(path.read_text())
    shard = directory / "ckpt-000000000002" / "__0_0.distcp"
    for entry in manifest["files"]:
        if entry["path"] == "__0_0.distcp":
            entry["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    path.write_text(json.dumps(manifest))


def symlink_shard(directory: Path) -> None:
    shard = directory / "ckpt-000000000002" / "__0_0.distcp"
    moved = directory / "elsewhere.distcp"
    shard.rename(moved)
    shard.symlink_to(moved)


def drop_metadata(directory: Path) -> None:
    (directory / "ckpt-000000000002" / ".metadata").unlink()


@pytest.mark.parametrize(
    ("corrupt", "warning"),
    [
        (flip_shard, "sha256 does not match its manifest"),
        (drop_manifest, "manifest is missing"),
        (tamper_manifest, "does not match its own file table"),
        (symlink_shard, "not a regular file"),
        (drop_metadata, "is missing"),
    ],
)
def test_a_broken_newest_checkpoint_is_skipped_for_the_previous_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, corrupt: Any, warning: str
) -> None:
    with saved_twice(tmp_path):
        corrupt(tmp_path)
    with CheckpointManager(tmp_path) as reader:
        with caplog.at_level(logging.WARNING, logger="shoal.learner.checkpoint"):
            info = reader.latest()
        assert info is not None
        assert info.step == 1
        assert warning in caplog.text
        template = {"w": torch.empty(64)}
        reader.load_tensors(info, template)
        torch.testing.assert_close(template["w"], torch.full((64,), 1.0))
        assert reader.load_trainer(info) == {"step": 1}


def test_a_shard_corrupted_after_it_was_found_is_refused_before_reading(tmp_path: Path) -> None:
    with saved_twice(tmp_path) as manager:
        info = manager.latest()
        assert info is not None
        (info.path / ".metadata").write_bytes(b"\x80\x04cos\nsystem\n.")  # a hostile pickle
        with pytest.raises(CheckpointError, match="does not match its manifest"):
            manager.load_tensors(info, {"w": torch.empty(64)})


class Hostile:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("true",))


def test_a_metadata_pickle_with_a_matching_hash_is_still_not_executed(tmp_path: Path) -> None:
    """A forged checkpoint whose manifest hashes a hostile .metadata: the restricted
    unpickler refuses anything but DCP's own metadata classes."""
    with saved_twice(tmp_path) as manager:
        folder = tmp_path / "ckpt-000000000002"
        payload = pickle.dumps(Hostile())
        (folder / ".metadata").write_bytes(payload)
        path = tmp_path / "ckpt-000000000002.json"
        manifest = json.loads(path.read_text())
        for entry in manifest["files"]:
            if entry["path"] == ".metadata":
                entry.update(sha256=hashlib.sha256(payload).hexdigest(), size=len(payload))
        from shoal.learner.checkpoint_files import FileEntry, table_digest

        rows = [FileEntry(**f) for f in manifest["files"]]
        manifest["sha256"] = table_digest(rows)
        manifest["size"] = sum(f.size for f in rows)
        path.write_text(json.dumps(manifest))
        info = manager.latest()
        assert info is not None
        assert info.step == 2
        with pytest.raises(CheckpointError, match=r"\.system is not part of DCP metadata"):
            manager.load_tensors(info, {"w": torch.empty(64)})


def test_a_template_that_does_not_fit_is_a_clear_error(tmp_path: Path) -> None:
    with saved_twice(tmp_path) as manager:
        info = manager.latest()
        with pytest.raises(CheckpointError, match="does not fit what is being restored"):
            manager.load_tensors(info, {"other": torch.empty(64)})
        with pytest.raises(CheckpointError, match="tensors must be tensors"):
            manager.save({"w": [1, 2]}, 3, {})
        with pytest.raises(CheckpointError, match="not plain JSON"):
            manager.save({"w": torch.zeros(1)}, 3, {"t": torch.zeros(1)})


def write_manifest(directory: Path, step: int, body: bytes) -> None:
    (directory / f"ckpt-{step:012d}").mkdir(exist_ok=True)
    (directory / f"ckpt-{step:012d}.json").write_bytes(body)


def good_manifest_body(files: list[dict[str, Any]]) -> dict[str, Any]:
    from shoal.learner.checkpoint_files import FileEntry, table_digest

    return {
        "format": 2, "step": 9, "files": files, "world_size": 1, "created_unix": 1.0,
        "meta": {}, "size": 0, "sha256": table_digest([FileEntry(**f) for f in files]),
    }  # fmt: skip


def entry(path: str) -> dict[str, Any]:
    return {"path": path, "size": 1, "sha256": "0" * 64}


HOSTILE = {
    "huge": b" " * (MAX_MANIFEST_BYTES + 1),
    "deep": b"[" * 10_000 + b"]" * 10_000,
    "dotdot": json.dumps(
        good_manifest_body([entry(".metadata"), entry("trainer.json"), entry("../../x")])
    ).encode(),
    "absolute": json.dumps(
        good_manifest_body([entry(".metadata"), entry("trainer.json"), entry("/etc/passwd")])
    ).encode(),
    "subdir": json.dumps(
        good_manifest_body([entry(".metadata"), entry("trainer.json"), entry("a/b")])
    ).encode(),
    "many": json.dumps(
        good_manifest_body(
            [entry(".metadata"), entry("trainer.json")] + [entry(f"f{i}") for i in range(16_400)]
        )
    ).encode(),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_manifest_is_refused(tmp_path: Path, kind: str, caplog: Any) -> None:
    write_manifest(tmp_path, 9, HOSTILE[kind])
    with pytest.raises(CheckpointError):
        parse_manifest(HOSTILE[kind], 9)
    with (
        CheckpointManager(tmp_path) as manager,
        caplog.at_level(logging.WARNING, logger="shoal.learner.checkpoint"),
    ):
        assert manager.latest() is None
    assert "skipping checkpoint step 9" in caplog.text


json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12)
)
json_values = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(value=json_values)
@settings(max_examples=200, deadline=None)
def test_the_manifest_parser_refuses_any_other_json_with_a_checkpoint_error(value: Any) -> None:
    data = json.dumps(value).encode()
    with pytest.raises(CheckpointError):
        parse_manifest(data, 9)


@given(
    depth=st.integers(0, 5000),
    junk=st.binary(max_size=200),
    opener=st.sampled_from([b"[", b"{", b'{"a":']),
)
@settings(max_examples=100, deadline=None)
def test_the_manifest_parser_survives_depth_and_junk(
    depth: int, junk: bytes, opener: bytes
) -> None:
    with pytest.raises(CheckpointError):
        parse_manifest(opener * depth + junk, 9)


@given(
    names=st.lists(
        st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), min_size=1, max_size=20),
        min_size=1, max_size=5, unique=True,
    ),
)  # fmt: skip
@settings(max_examples=150, deadline=None)
def test_a_manifest_round_trips_and_names_stay_inside(names: list[str]) -> None:
    files = [entry(".metadata"), entry("trainer.json")] + [
        entry(n) for n in names if n not in (".metadata", "trainer.json")
    ]
    data = json.dumps(good_manifest_body(files)).encode()
    try:
        manifest = parse_manifest(data, 9)
    except CheckpointError:
        return  # refused as a whole: nothing of it is used
    assert {f.path for f in manifest.files} == {f["path"] for f in files}
    for f in manifest.files:
        assert "/" not in f.path
        assert f.path not in (".", "..")
        assert not os.path.isabs(f.path)


def test_a_format_1_checkpoint_of_the_old_learner_restores(tmp_path: Path) -> None:
    """The single .pt file the learner wrote before DCP: the hand-written Adam's state in
    torch.optim.Adam's layout (parameters by index); restored into AdamW by name."""
    model, optimizer = plain(seed=4)
    train_step(model, optimizer, seed=0)
    state = {
        i: {"step": torch.tensor(1.0), "exp_avg": torch.full_like(p, 0.5),
            "exp_avg_sq": torch.full_like(p, 0.25)}
        for i, p in enumerate(model.parameters())
    }  # fmt: skip
    legacy = {
        "model": model.state_dict(),
        "optimizer": {"state": state, "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.999),
                                                        "eps": 1e-8, "params": [0, 1, 2, 3]}]},
        "policy_spec": {"kind": "test"},
        "version": 7,
        "env_steps": 100,
    }  # fmt: skip
    write_format_1(tmp_path, 7, legacy)
    with CheckpointManager(tmp_path) as manager:
        info = manager.latest()
        assert info is not None
        assert (info.format, info.path.suffix) == (1, ".pt")
        assert manager.load_trainer(info) == {
            "policy_spec": {"kind": "test"}, "version": 7, "env_steps": 100,
        }  # fmt: skip
        restored, restored_opt = plain(seed=5)
        restore_model_optimizer(restored, restored_opt, manager, info)
        with pytest.raises(CheckpointError, match="format 1"):
            manager.load_tensors(info, {"w": torch.empty(1)})
    for (name, a), b in zip(model.named_parameters(), restored.parameters()):
        torch.testing.assert_close(a, b, msg=name)
        opt_state = restored_opt.state[b]
        torch.testing.assert_close(opt_state["exp_avg"], torch.full_like(b, 0.5))
        assert float(opt_state["step"]) == 1.0
    train_step(restored, restored_opt, seed=1)


def write_format_1(directory: Path, step: int, state: dict[str, Any]) -> None:
    """A format-1 checkpoint exactly as the old CheckpointManager wrote it."""
    data_path = directory / f"ckpt-{step:012d}.pt"
    torch.save(state, data_path)
    payload = data_path.read_bytes()
    manifest = {
        "format": 1, "step": step, "file": data_path.name,
        "sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload),
        "created_unix": 1.0, "meta": {"env_id": "CartPole-v1"},
    }  # fmt: skip
    (directory / f"ckpt-{step:012d}.json").write_text(json.dumps(manifest))


def test_a_newer_format_2_checkpoint_wins_over_format_1(tmp_path: Path) -> None:
    write_format_1(tmp_path, 1, {"model": {}, "optimizer": {}, "version": 1})
    with CheckpointManager(tmp_path, keep=5) as manager:
        manager.save({"w": torch.ones(2)}, 2, {"version": 2}, block=True)
        assert [(i.step, i.format) for i in manager.list_complete()] == [(2, 2), (1, 1)]
        assert manager.load_trainer(manager.latest()) == {"version": 2}


def test_a_format_1_checkpoint_never_unpickles_arbitrary_objects(tmp_path: Path) -> None:
    """A format-1 file whose hash matches but holds a pickled object: weights_only refuses it."""
    from fractions import Fraction

    manager = CheckpointManager(tmp_path)
    write_format_1(tmp_path, 1, {"model": {}, "evil": Fraction(1, 3)})
    forged = manager.latest()
    assert forged is not None
    assert forged.format == 1
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        manager.load_legacy(forged)
    with pytest.raises(CheckpointError, match="format 1"):
        manager.load_tensors(forged, {})
    manager.save({"w": torch.ones(1)}, 2, {}, block=True)
    with pytest.raises(CheckpointError, match="format 2"):
        manager.load_legacy(manager.latest())
    manager.close()
