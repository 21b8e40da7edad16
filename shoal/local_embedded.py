"""The embedded cluster `shoal train` starts when none is up: one coordinator replica and one
node daemon as children of the training process, in its run directory, tuned so that a
submitted job starts at once, and gone when the block that uses them ends.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

from shoal.local import LocalCluster, ProcessSpec, coordinator_specs, node_specs

EMBEDDED_HEARTBEAT_S = 0.2
"""The embedded node's heartbeat period. Its heartbeat is also its watch for assignments, so a
task placed on it starts within this; one node on loopback can afford five requests a second."""
EMBEDDED_SETTINGS = """\
# The embedded cluster's replica (written by `shoal train`; docs/operations.md lists the keys).
[scheduler]
# A submitted job is placed within one period; a round with nothing new committed since the
# last one returns at once, so a short period costs little.
period = 0.1

[raft]
# A replica alone has no vote to split: it may elect itself as soon as it runs.
append_period = 0.02
min_timeout = 0.07
max_timeout = 0.1
"""


def embedded_specs(run_dir: Path) -> list[ProcessSpec]:
    """One coordinator replica and one node daemon with this host's own GPUs (if any), tuned
    so that a job submitted to them starts quickly (the replica reads its settings from
    `run_dir/coordinator.toml`, which `embedded_cluster` writes)."""
    config = run_dir / "coordinator.toml"
    specs = coordinator_specs(run_dir, 1, extra_args=("--config", str(config)))
    urls = [s.api_url for s in specs if s.api_url]
    node_args = ("--heartbeat", str(EMBEDDED_HEARTBEAT_S))
    return specs + node_specs(run_dir, urls, 1, 0, extra_args=node_args)


@contextlib.contextmanager
def embedded_cluster(run_dir: Path) -> Iterator[LocalCluster]:
    """A fresh one-replica, one-node cluster in `run_dir` for the length of the block, stopped
    on the way out however the block ends (its processes also die with this one).

    The processes are started and the block entered at once, so the caller's own start-up
    overlaps theirs; `wait_ready` before the first write. The replica starts from an empty Raft
    log even when `run_dir` held an earlier run's: a job that was running when that run was
    killed must not come back to life and start its tasks again."""
    local = LocalCluster(run_dir)
    specs = embedded_specs(local.run_dir)
    local.create(specs)
    (local.run_dir / "coordinator.toml").write_text(EMBEDDED_SETTINGS)
    for spec in specs:
        if spec.kind == "coordinator":
            shutil.rmtree(local.run_dir / "data" / spec.name, ignore_errors=True)
    try:
        for spec in specs:
            local.start(spec.name, die_with_parent=True)
        yield local
    finally:
        local.stop_all()
