"""Accounting journals: one os.write per record on an O_APPEND fd, so a SIGKILL loses nothing
that was appended; the rollout ledger rebuilt from one equals the in-memory ledger."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.learner.errors import LearnerError
from shoal.learner.journal import Journal, read_lines, rollout_ledger, rollout_ledgers
from shoal.learner.seqranges import SeqRanges, ranges_json

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


def _journals(run_dir: Path) -> dict[str, dict]:
    """Each rollout actor's ledger from its journal, by actor id."""
    ledgers = (rollout_ledger(read_lines(p)) for p in (run_dir / "accounting").glob("*.jsonl"))
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


def _until(what: str, check, proc: subprocess.Popen, within: float = 90.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"training exited ({proc.returncode}) before: {what}"
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {within:g} s: {what}")


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
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:

        def streaming() -> tuple[str, int] | None:
            journals = _journals(run_dir) if (run_dir / "accounting").is_dir() else {}
            pid = _rollout_pid(run_dir) if (run_dir / "events.jsonl").exists() else None
            busy = [a for a, ledger in journals.items() if len(_acked(ledger)) >= 20]
            return (busy[0], pid) if busy and pid else None

        victim, pid = _until("acknowledgements stream in", streaming, proc)
        os.kill(pid, signal.SIGKILL)
        _until(
            "a new rollout actor's fragments are acknowledged",
            lambda: any(a != victim and _acked(j) for a, j in _journals(run_dir).items()),
            proc,
        )
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
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
