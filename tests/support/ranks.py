"""A learner group's ranks as real child processes: one command per rank, the group's
`GroupSpec` (gloo, a free port) in each one's environment, all reaped however the test ends."""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from shoal.learner.group import GroupSpec
from shoal.ports import free_port
from tests.support.processes import child_process

REPO = Path(__file__).resolve().parents[2]
RANK_TIMEOUT_S = 300.0
"""A failure detector for a rank that hangs (a collective no peer joins), not a time limit."""


def run_ranks(commands: Sequence[Sequence[str]], timeout_s: float = RANK_TIMEOUT_S) -> None:
    """Run `commands[r]` as rank r of a gloo group of len(commands) ranks, from the repository
    root with one torch thread each; every rank must exit 0."""
    port = free_port()
    world = len(commands)
    with ExitStack() as stack:
        procs = []
        for rank, command in enumerate(commands):
            spec = GroupSpec(rank=rank, world_size=world, port=port, backend="gloo", timeout_s=90)
            env = {**os.environ, **spec.to_env(), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
            procs.append(stack.enter_context(child_process(command, env=env, cwd=REPO)))
        codes = [proc.wait(timeout=timeout_s) for proc in procs]
        assert codes == [0] * world, f"rank exit codes {codes}: {commands[0]}"
