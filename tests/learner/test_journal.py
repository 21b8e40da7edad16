"""Accounting journals: one os.write per record on an O_APPEND fd, so a SIGKILL loses nothing
that was appended; the rollout ledger rebuilt from one equals the in-memory ledger."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.learner.buffer import Intake, IntakeFull
from shoal.learner.errors import LearnerError
from shoal.learner.journal import (
    Journal,
    learner_ledger,
    learner_ledgers,
    open_learner_journal,
    read_lines,
    rollout_ledger,
    rollout_ledgers,
)
from shoal.learner.seqranges import SeqRanges, ranges_json
from tests.learner.test_buffer import _ops, fragment
from tests.support.processes import child_process, eventually_while_running

events = st.lists(
    st.tuples(
        st.integers(0, 40),
        st.sampled_from(["inc-a", "inc-b"]),
        st.sampled_from(["accepted", "stale", "duplicate"]),
        st.booleans(),
    ),
    max_size=60,
)


@given(events)
def test_the_journal_rebuilds_what_the_actor_kept_in_memory(tmp_path_factory, history):
    """Sent seqs and acks (any order, some never acknowledged) written as an actor does,
    read back as the ledger the actor's own SeqRanges give."""
    path = tmp_path_factory.mktemp("journal") / "rollout-a#1.jsonl"
    journal = Journal(path)
    sent = SeqRanges()
    acked: dict[str, dict[str, SeqRanges]] = {}
    try:
        journal.append({"actor_id": "a#1", "sent": [], "acked": {}})
        for seq, incarnation, admission, was_acked in history:
            journal.append({"sent": seq})
            sent.add(seq)
            if was_acked:
                journal.append({"acked": seq, "incarnation": incarnation, "admission": admission})
                acked.setdefault(incarnation, {}).setdefault(admission, SeqRanges()).add(seq)
    finally:
        journal.close()
    assert rollout_ledger(read_lines(path)) == {
        "actor_id": "a#1",
        "sent": sent.to_json(),
        "acked": {inc: ranges_json(kinds) for inc, kinds in acked.items()},
    }


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    journal = Journal(path)
    journal.append({"sent": 0})
    journal.append({"acked": 0, "incarnation": "i", "admission": "accepted"})
    journal.close()
    with path.open("ab") as handle:
        handle.write(b'{"sent": 1')  # a write the disk cut short
    assert read_lines(path) == [
        {"sent": 0},
        {"acked": 0, "incarnation": "i", "admission": "accepted"},
    ]


@pytest.mark.parametrize("record", [{"sent": -1}, {"acked": "3"}, {"sent": True}])
def test_a_malformed_record_is_named(record: dict) -> None:
    with pytest.raises(LearnerError, match="malformed journal record"):
        rollout_ledger([record])


def test_bad_paths_and_a_closed_journal_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(LearnerError, match="cannot open the accounting journal"):
        Journal(tmp_path / "missing" / "j.jsonl")
    journal = Journal(tmp_path / "j.jsonl")
    journal.close()
    journal.close()
    with pytest.raises(LearnerError, match="is closed"):
        journal.append({"sent": 1})


def test_ledgers_prefer_the_journal_to_the_snapshot(tmp_path: Path) -> None:
    """The snapshot of actor a lags its journal; actor b has only a snapshot."""
    (tmp_path / "rollout-a.json").write_text(
        json.dumps({"actor_id": "a", "sent": [[0, 1]], "acked": {}})
    )
    journal = Journal(tmp_path / "rollout-a.jsonl")
    journal.append({"actor_id": "a", "sent": [], "acked": {}})
    for seq in range(3):
        journal.append({"sent": seq})
        journal.append({"acked": seq, "incarnation": "i", "admission": "accepted"})
    journal.close()
    b = {"actor_id": "b", "sent": [[0, 2]], "acked": {"i": {"accepted": [[0, 2]]}}}
    (tmp_path / "rollout-b.json").write_text(json.dumps(b))
    (tmp_path / "learner-0-x.json").write_text("{}")
    ledgers = rollout_ledgers(tmp_path)
    assert ledgers == [
        {"actor_id": "a", "sent": [[0, 3]], "acked": {"i": {"accepted": [[0, 3]]}}},
        b,
    ]


@pytest.mark.timeout(60)
def test_every_appended_record_survives_a_sigkill(tmp_path: Path) -> None:
    """A real process appends records and SIGKILLs itself with no chance to flush or close."""
    path = tmp_path / "rollout-k.jsonl"
    script = textwrap.dedent(
        f"""
        import os, signal
        from pathlib import Path
        from shoal.learner.journal import Journal
        journal = Journal(Path({str(path)!r}))
        for seq in range(500):
            journal.append({{"sent": seq}})
            journal.append({{"acked": seq, "incarnation": "i", "admission": "accepted"}})
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=50)
    assert child.returncode == -9, child.stderr
    ledger = rollout_ledger(read_lines(path))
    assert ledger["sent"] == [[0, 500]]
    assert ledger["acked"] == {"i": {"accepted": [[0, 500]]}}


@pytest.mark.timeout(60)
def test_a_full_disk_holds_lines_until_there_is_room(tmp_path: Path) -> None:
    """A real process whose file size limit (RLIMIT_FSIZE, the kernel's EFBIG) stops its journal
    mid-line: appends go on without raising, the lines are held in order and counted, and once
    the limit is raised the next append writes them all, the cut line made whole."""
    path = tmp_path / "learner-0-i.jsonl"
    script = textwrap.dedent(
        f"""
        import json, resource
        from pathlib import Path
        from shoal.learner.journal import Journal
        journal = Journal(Path({str(path)!r}))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))
        for seq in range(100):
            journal.append({{"actor": "a", "seq": seq, "kind": "accepted"}})
        during = {{"held": journal.held, "full_writes": journal.full_writes}}
        during["size"] = Path({str(path)!r}).stat().st_size
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        journal.append({{"actor": "a", "seq": 100, "kind": "accepted"}})
        during["held_after"] = journal.held
        journal.close()
        print(json.dumps(during))
        """
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=50)
    assert child.returncode == 0, child.stderr
    seen = json.loads(child.stdout)
    assert seen["size"] == 1000
    assert seen["held"] > 0
    assert seen["full_writes"] > 0
    assert seen["held_after"] == 0
    records = read_lines(path)
    assert [r["seq"] for r in records] == list(range(101))
    assert len(path.read_bytes().splitlines()) == 101  # no torn line left behind


def test_a_journal_closed_while_holding_lines_says_how_much_was_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    journal = Journal(tmp_path / "j.jsonl")

    def no_room(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", no_room)
    journal.append({"sent": 1})
    assert journal.held == len(b'{"sent":1}\n')
    journal.close()
    assert "never found room on the disk and are lost" in caplog.text


def test_an_error_other_than_a_full_disk_still_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = Journal(tmp_path / "j.jsonl")

    def broken(fd: int, data: bytes) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "write", broken)
    with pytest.raises(OSError, match="Input/output"):
        journal.append({"sent": 1})


@settings(max_examples=100, deadline=None)
@given(_ops, st.integers(1, 5), st.integers(0, 3))
def test_an_intake_journal_rebuilds_the_intake_ledger(tmp_path_factory, ops, capacity, staleness):
    """Whatever the intake did (admit, drop as stale or duplicate, train, drop when the
    version moved on), its journal says the same as its in-memory ledger."""
    folder = tmp_path_factory.mktemp("accounting")
    journal = open_learner_journal(folder, 1, "inc")
    intake = Intake(capacity=capacity, max_staleness=staleness, journal=journal)
    try:
        journal.append({"resumed_from": "ckpt.pt", "base": {"a": [[0, 2]]}})
        for op in ops:
            if op[0] == "offer":
                _, actor, seq, lag = op
                try:
                    intake.offer(fragment(actor, seq, max(0, intake.version - lag + 2)))
                except IntakeFull:
                    pass
            elif op[0] == "take":
                intake.take(op[1])
            else:
                intake.set_version(intake.version + op[1])
    finally:
        journal.close()
    (ledger,) = learner_ledgers(folder)
    assert ledger == {
        "rank": 1,
        "incarnation": "inc",
        "final": False,
        "resumed_from": "ckpt.pt",
        "base": {"a": [[0, 2]]},
        **intake.ledger(),
    }


def test_learner_ledgers_prefer_a_final_snapshot_then_the_journal(tmp_path: Path) -> None:
    for incarnation in ("dead", "done"):
        journal = open_learner_journal(tmp_path, 0, incarnation)
        journal.append({"actor": "a", "seq": 0, "kind": "accepted"})
        journal.close()
    stale_snapshot = {"rank": 0, "incarnation": "dead", "final": False, "queued": {}}
    final = {"rank": 0, "incarnation": "done", "final": True, "queued": {}, "trained": {}}
    (tmp_path / "learner-0-dead.json").write_text(json.dumps(stale_snapshot))
    (tmp_path / "learner-0-done.json").write_text(json.dumps(final))
    (tmp_path / "learner-1-old.json").write_text(json.dumps({"rank": 1, "final": False}))
    dead, done, old = learner_ledgers(tmp_path)
    assert dead["queued"] == {"a": [[0, 1]]}  # the journal, newer than the snapshot
    assert done == final
    assert old == {"rank": 1, "final": False}  # no journal: the snapshot it left


def test_a_learner_record_of_unknown_kind_is_named() -> None:
    with pytest.raises(LearnerError, match="kind is not one of"):
        learner_ledger([{"actor": "a", "seq": 1, "kind": "eaten"}])


def _journals(run_dir: Path) -> dict[str, dict]:
    """Each rollout actor's ledger from its journal, by actor id."""
    folder = run_dir / "accounting"
    ledgers = (rollout_ledger(read_lines(p)) for p in folder.glob("rollout-*.jsonl"))
    return {ledger["actor_id"]: ledger for ledger in ledgers}


def _acked(ledger: dict) -> set[int]:
    return {
        seq
        for kinds in ledger["acked"].values()
        for ranges in kinds.values()
        for seq in SeqRanges.from_json(ranges)
    }


def _rollout_pid(run_dir: Path) -> int | None:
    """The newest rollout worker's pid (its start event), if it is still that process."""
    starts = [
        json.loads(line)
        for line in (run_dir / "events.jsonl").read_text().splitlines()
        if '"process": "rollout"' in line
    ]
    if not starts:
        return None
    pid = int(starts[-1]["pid"])
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return pid if b"rollout_main" in cmdline and str(run_dir).encode() in cmdline else None


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sigkilled_rollout_worker_keeps_every_acknowledgement(tmp_path: Path) -> None:
    """A real training run: its rollout worker is SIGKILLed while acknowledgements stream in.
    Every seq the learner admitted from that actor is in the actor's journal, except at most
    the one push still in flight at the kill (whose reply never arrived)."""
    run_dir = tmp_path / "run"
    argv = [
        sys.executable, "-m", "shoal", "train", "cartpole", "--json", "--quiet", "--no-eval",
        "--run-dir", str(run_dir), "--ranks", "1", "--workers", "1", "--seed", "5",
        "--target-return", "1e9", "--time-limit", "180",
    ]  # fmt: skip
    with child_process(argv, stdout=subprocess.PIPE, text=True) as proc:

        def streaming() -> tuple[str, int] | None:
            journals = _journals(run_dir) if (run_dir / "accounting").is_dir() else {}
            pid = _rollout_pid(run_dir) if (run_dir / "events.jsonl").exists() else None
            busy = [a for a, ledger in journals.items() if len(_acked(ledger)) >= 20]
            return (busy[0], pid) if busy and pid else None

        victim, pid = eventually_while_running(proc, streaming, "acknowledgements stream in", 90)
        os.kill(pid, signal.SIGKILL)
        eventually_while_running(
            proc,
            lambda: any(a != victim and _acked(j) for a, j in _journals(run_dir).items()),
            "a new rollout actor's fragments are acknowledged",
            90,
        )
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=90)
    journal = _journals(run_dir)[victim]
    (final,) = [
        ledger
        for p in (run_dir / "accounting").glob("learner-*.json")
        if (ledger := json.loads(p.read_text()))["final"]
    ]
    admitted = {
        seq
        for kind in ("trained", "stale", "duplicate", "queued")
        for seq in SeqRanges.from_json(final[kind].get(victim, []))
    }
    recorded = _acked(journal)
    assert recorded
    assert recorded <= admitted
    in_flight = admitted - recorded
    assert in_flight <= {max(SeqRanges.from_json(journal["sent"]))}


def _status(run_dir: Path) -> dict:
    try:
        return dict(json.loads((run_dir / "status-0.json").read_text()))
    except (OSError, ValueError):
        return {}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sigkilled_learner_journal_holds_every_fragment_it_acknowledged(tmp_path: Path) -> None:
    """A real run's learner rank SIGKILLed while it acknowledges fragments: every ack the rollout
    actors recorded from that incarnation is in its journal, with the same admission."""
    run_dir = tmp_path / "run"
    argv = [
        sys.executable, "-m", "shoal", "train", "cartpole", "--json", "--quiet", "--no-eval",
        "--run-dir", str(run_dir), "--ranks", "1", "--workers", "1", "--seed", "6",
        "--target-return", "1e9", "--time-limit", "180",
    ]  # fmt: skip
    with child_process(argv, stdout=subprocess.PIPE, text=True) as proc:

        def acknowledging() -> tuple[str, int] | None:
            status = _status(run_dir)
            incarnation = status.get("incarnation")
            acked = [
                len(SeqRanges.from_json(ranges))
                for ledger in (
                    _journals(run_dir) if (run_dir / "accounting").is_dir() else {}
                ).values()
                for ranges in ledger["acked"].get(incarnation, {}).values()
            ]
            cmdline = Path(f"/proc/{status.get('pid', 0)}/cmdline")
            running = cmdline.exists() and b"learner_main" in cmdline.read_bytes()
            return (str(incarnation), int(status["pid"])) if sum(acked) >= 20 and running else None

        victim, pid = eventually_while_running(
            proc, acknowledging, "the learner acknowledges fragments", 90
        )
        os.kill(pid, signal.SIGKILL)
        eventually_while_running(
            proc,
            lambda: _status(run_dir).get("incarnation") not in (None, victim),
            "a new learner incarnation",
            90,
        )
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=90)
    (journal,) = (run_dir / "accounting").glob(f"learner-0-{victim}.jsonl")
    ledger = learner_ledger(read_lines(journal))
    seqs = {kind: ledger[kind] for kind in ("trained", "stale", "duplicate", "queued")}
    checked = 0
    for rollout in _journals(run_dir).values():
        actor = rollout["actor_id"]
        for admission, ranges in rollout["acked"].get(victim, {}).items():
            kinds = ("trained", "queued", "stale") if admission == "accepted" else (admission,)
            recorded = {s for kind in kinds for s in SeqRanges.from_json(seqs[kind].get(actor, []))}
            acked = set(SeqRanges.from_json(ranges))
            assert acked <= recorded, f"{actor} {admission}: {sorted(acked - recorded)} missing"
            checked += len(acked)
    assert checked >= 20
