"""A 2-rank `shoal train` (embedded cluster) that reaches its time limit stops in order: the
node stops the learner ranks first while the rollout workers still feed them, so rank 0
writes a final checkpoint newer than every periodic one and each rank closes its ledger."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shoal.cli import main
from shoal.train import find_checkpoint

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def _events(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def test_a_stopped_two_rank_run_writes_its_final_checkpoint_and_closes_its_ledgers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    argv = [
        "train", "cartpole", "--run-dir", str(run_dir), "--ranks", "2", "--workers", "2",
        "--time-limit", "60", "--target-return", "100000", "--checkpoint-interval", "1",
        "--quiet", "--json", "--no-eval",
    ]  # fmt: skip
    code = main(argv)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 1  # not solved: it ran to its time limit
    assert summary["stopped_by"] == "time_limit"

    events = _events(run_dir)
    assert not any(e.get("event") == "stop_timeout" for e in events)
    periodic = [i for i, e in enumerate(events) if e.get("event") == "checkpoint"]
    stops = [i for i, e in enumerate(events) if e.get("event") == "stop"]
    assert periodic, "no periodic checkpoint in 60 s at a 1 s interval"
    assert stops, "rank 0 wrote no final checkpoint"
    final = events[stops[-1]]
    assert stops[-1] > periodic[-1]
    assert final["step"] >= events[periodic[-1]]["step"]
    info = find_checkpoint(Path(summary["checkpoint"]))
    assert info.step == final["step"]

    ledgers = [json.loads(p.read_text()) for p in (run_dir / "accounting").glob("learner-*.json")]
    newest = {}
    for ledger in ledgers:
        rank = ledger["rank"]
        if rank not in newest or ledger["incarnation"] > newest[rank]["incarnation"]:
            newest[rank] = ledger
    assert sorted(newest) == [0, 1]
    assert all(ledger["final"] for ledger in newest.values())

    # The node stopped the ranks in a wave of their own, before the workers.
    logs = Path(summary["cluster"]["logs"])
    waves = [
        line.split("stopped task(s) ", 1)[1]
        for path in sorted(logs.glob("*.log"))
        for line in path.read_text().splitlines()
        if "stopped task(s) " in line
    ]
    job = summary["job_id"]
    assert waves == [f"{job}-learner-0, {job}-learner-1", f"{job}-rollout-0, {job}-rollout-1"]
