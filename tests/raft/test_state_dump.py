"""ClusterState inside a real single-node SyncObj: after log compaction wrote a dump, a restarted
replica rebuilds the same state (digest) from dump + journal."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from pysyncobj import SyncObj, SyncObjConf

from shoal.raft.commands import make_command
from shoal.raft.state import ClusterState
from tests.support.waiting import eventually

from .inprocess import free_port


def _replica(tmp_path: Path, addr: str) -> tuple[SyncObj, ClusterState]:
    state = ClusterState()
    conf = SyncObjConf(
        journalFile=str(tmp_path / "raft.journal"),
        fullDumpFile=str(tmp_path / "raft.dump"),
        logCompactionMinEntries=10,
        useFork=False,
        appendEntriesUseBatch=False,
    )
    return SyncObj(addr, [], conf, consumers=[state]), state


def _apply(state: ClusterState, op: str, args: dict, op_id: str) -> dict:
    done = threading.Event()
    box: list = []

    def callback(result: dict, reason: int) -> None:
        box.append((result, reason))
        done.set()

    state.propose(make_command(op, args, op_id, 1000.0), callback)
    assert done.wait(10), "command not applied"
    result, reason = box[0]
    assert reason == 0
    return result


@pytest.mark.timeout(60)
def test_restart_after_log_compaction_restores_the_same_digest(tmp_path: Path) -> None:
    addr = f"127.0.0.1:{free_port()}"
    sync, state = _replica(tmp_path, addr)
    try:
        _apply(state, "submit_job", {"job_id": "j1"}, "op-job")
        for i in range(40):
            _apply(state, "add_event", {"kind": "note", "message": str(i)}, f"op-{i}")
        sync.forceLogCompaction()
        eventually((tmp_path / "raft.dump").exists, "a dump written")
        _apply(state, "add_event", {"kind": "note", "message": "after-dump"}, "op-last")
        digest = state.digest()
    finally:
        sync.destroy()
        time.sleep(0.3)
    sync2, state2 = _replica(tmp_path, addr)
    try:
        eventually(lambda: state2.digest() == digest, "the restarted replica rebuilt the state")
        assert _apply(state2, "submit_job", {"job_id": "j1"}, "op-job")[
            "ok"
        ]  # retried op: first result
    finally:
        sync2.destroy()
