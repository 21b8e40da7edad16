"""Reading what a training run recorded in its directories, for the chaos checks: its JSON
files (written atomically), its `events.jsonl`, and the fragment ledgers across all learner
incarnations (`fragment_ledger`, checked against the newest checkpoint's trained ranges),
gathered from every accounting folder the job's tasks wrote (one per host when the hosts
share no directory). Used on the scenario's cluster job (chaos/job_process.py) and by the
embedded run's resume test.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shoal.chaos import invariants
from shoal.chaos.invariants import Verdict
from shoal.rundir import RunDir


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    events = []
    with contextlib.suppress(OSError):
        for line in RunDir(run_dir).events.read_text().splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return events


def ledger_verdict(run_dir: Path) -> Verdict:
    """`gathered_ledger_verdict` of a run whose tasks all wrote into `run_dir` (one host)."""
    run = RunDir(run_dir)
    return gathered_ledger_verdict([run.accounting], run.checkpoints)


def gathered_ledger_verdict(folders: Sequence[Path], checkpoints: Path) -> Verdict:
    """`fragment_ledger` over what the run wrote to its accounting `folders` (every actor and
    incarnation has files of its own, named by a fresh id, so folders simply add up) and its
    newest checkpoint in `checkpoints` (loaded, to compare its `trained_ranges` with the final
    incarnations' history). Journals are read where they are more complete than the
    snapshots: a rollout actor's always, a learner incarnation's unless it stopped in order
    (both are complete even after a SIGKILL)."""
    from shoal.learner.checkpoint import CheckpointManager
    from shoal.learner.journal import learner_ledgers, rollout_ledgers

    rollouts = [ledger for folder in folders for ledger in rollout_ledgers(folder)]
    learners = [ledger for folder in folders for ledger in learner_ledgers(folder)]
    with CheckpointManager(checkpoints) as manager:
        info = manager.latest()
        state = None if info is None else manager.load_trainer(info)
    final = None if state is None else state.get("trained_ranges", {})
    return invariants.fragment_ledger(rollouts, learners, final)
