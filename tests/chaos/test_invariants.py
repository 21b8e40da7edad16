"""Each invariant holds on good observations and names what broke on bad ones."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from shoal.chaos import invariants
from shoal.chaos.history import Operation
from tests.support.waiting import eventually


def test_linearizable_names_the_lost_write() -> None:
    ops = [
        Operation("a", "write", "k", "v1", 0, 1),
        Operation("b", "read", "k", None, 2, 3),
    ]
    verdict = invariants.linearizable(ops)
    assert not verdict.held
    assert "b read k=None" in verdict.detail
    assert invariants.linearizable(ops[:1]).held


def test_digests() -> None:
    same = {
        "c1": {"digest": "ab" * 32, "commit_index": 7},
        "c2": {"digest": "ab" * 32, "commit_index": 7},
    }
    assert invariants.digests_equal(same).held
    differ = {**same, "c3": {"digest": "cd" * 32, "commit_index": 7}}
    verdict = invariants.digests_equal(differ)
    assert not verdict.held
    assert "c3: cdcd" in verdict.detail
    assert "c2" in invariants.digests_equal({**same, "c2": None}).detail


def test_checkpoints_forward() -> None:
    assert invariants.checkpoints_forward([100, 200], [0, 100, 200, 200], 200).held
    back = invariants.checkpoints_forward([100, 200], [100, 200, 100], 200)
    assert "from 200 to 100" in back.detail
    lost = invariants.checkpoints_forward([100, 200], [100], 100)
    assert "step 200 lost" in lost.detail


def test_recovered() -> None:
    good = {"kind": "kill", "target": "leader", "recovered": True, "recovery_s": 0.4}
    assert "0.40 s" in invariants.recovered([good]).detail
    late = {"kind": "pause", "target": "c2", "recovered": False, "recovery_s": None}
    assert "pause c2" in invariants.recovered([good, late]).detail


def test_a_fault_this_machine_cannot_make_is_named_not_counted() -> None:
    """host-delay on a kernel without netem: never injected, so neither recovered nor late;
    the report's recovery figures leave it out and its text says why."""
    from dataclasses import asdict

    from shoal.chaos.curve import recovery_stats
    from shoal.chaos.report import FaultRecord, RunReport, render_text

    good = {"kind": "kill", "target": "leader", "recovered": True, "recovery_s": 0.4}
    why = "this kernel has no netem qdisc"
    unmade = FaultRecord("host-delay", "n1", ["n1"], detail=f"unsupported here: {why}")
    unmade.unsupported = why
    verdict = invariants.recovered([good, asdict(unmade)])
    assert verdict.held
    assert "unsupported here, so not made: ['host-delay n1']" in verdict.detail
    late = {"kind": "pause", "target": "c2", "recovered": False, "recovery_s": None}
    assert not invariants.recovered([late, asdict(unmade)]).held
    stats = recovery_stats([good, asdict(unmade)])
    assert stats["all"]["faults"] == 1
    assert "host-delay" not in stats
    report = RunReport("hosts", "/tmp/x", [unmade], {"recovered": verdict}, operations=0)
    assert f"UNSUPPORTED here: {why}" in render_text(report)


def test_leaks_are_found(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(tmp_path)])
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        eventually(  # the child's cmdline is empty until exec finished
            lambda: proc.pid in invariants.leaked_processes(tmp_path), "the child is found leaked"
        )
        assert invariants.busy_ports([port]) == [port]
        assert not invariants.no_leaks([proc.pid], [port]).held
    finally:
        proc.kill()
        proc.wait()
        listener.close()
    assert invariants.leaked_processes(tmp_path) == []
    assert invariants.busy_ports([port]) == []
    assert invariants.no_leaks([], []).held


@given(st.lists(st.integers(0, 10_000), max_size=30))
def test_checkpoints_forward_holds_exactly_for_non_decreasing_watches(observed: list[int]) -> None:
    final = max(observed, default=0)
    verdict = invariants.checkpoints_forward(observed, observed, final)
    assert verdict.held == (observed == sorted(observed))


@given(
    st.dictionaries(st.sampled_from(["c1", "c2", "c3"]), st.sampled_from(["a", "b"]), min_size=1)
)
def test_digests_equal_holds_exactly_when_all_digests_agree(digests: dict[str, str]) -> None:
    views = {n: {"digest": d * 64, "commit_index": 1} for n, d in digests.items()}
    assert invariants.digests_equal(views).held == (len(set(digests.values())) == 1)


def _start(rank: int, step: int, resumed: str | None) -> dict[str, object]:
    return {
        "event": "start",
        "process": "learner",
        "rank": rank,
        "step": step,
        "resumed_from": resumed,
    }


def test_restarts_resume_from_the_newest_checkpoint_before_them() -> None:
    events: list[dict[str, object]] = [
        _start(0, 0, None),
        _start(1, 0, None),
        {"event": "start", "process": "rollout", "pid": 9},
        {"event": "checkpoint", "step": 40},
        _start(0, 40, "ckpt-40"),
        _start(1, 40, "ckpt-40"),
    ]
    held = invariants.restarts_resumed(events, restarted=True)
    assert held.held, held.detail
    assert "2 learner rank restarts" in held.detail
    assert not invariants.restarts_resumed(events[:4], restarted=True).held
    assert invariants.restarts_resumed(events[:4], restarted=False).held
    behind = invariants.restarts_resumed([*events, _start(0, 12, "ckpt-12")], restarted=True)
    assert not behind.held
    assert "rank 0 at step 12 (newest checkpoint 40)" in behind.detail
    fresh = invariants.restarts_resumed([*events, _start(1, 40, None)], restarted=True)
    assert not fresh.held


def test_training_progress_names_late_and_missing_faults() -> None:
    ok = {"kind": "kill", "target": "leader", "progress_s": 1.5, "bound_s": 10.0}
    late = {"kind": "learner-kill", "target": "rank0", "progress_s": 31.0, "bound_s": 30.0}
    never = {"kind": "node-kill", "target": "n1", "progress_s": None, "bound_s": 30.0}
    assert invariants.training_progress([ok]).held
    verdict = invariants.training_progress([ok, late, never])
    assert not verdict.held
    assert "learner-kill rank0 (31.0 s > 30 s)" in verdict.detail
    assert "node-kill n1 (never)" in verdict.detail
    assert "kill leader" not in verdict.detail


def test_both_holds_only_when_both_do() -> None:
    yes, no = invariants.Verdict(True, "a"), invariants.Verdict(False, "b")
    assert invariants.both(yes, yes, "x").held
    assert not invariants.both(yes, no, "x").held
    assert invariants.both(no, yes, "across").detail == "b; across: a"
