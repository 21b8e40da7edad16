"""The best checkpoint: the one saved when the recent mean return was highest.

Training returns are not monotone: a policy can reach its peak and collapse after it, and with
only the newest `keep` checkpoints on disk the peak is rotated away. Every checkpoint's manifest
records `mean_return` (the mean of the last `target_window` episodes when it was saved,
learner/trainer.py); the checkpoint with the highest one (the newest on a tie) is spared by
rotation (checkpoint_layout.prune) and is what `shoal eval RUN --best` evaluates. Resuming still
takes the newest: the best is for using the policy, not for continuing the run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from shoal.learner.checkpoint_files import (
    MAX_MANIFEST_BYTES,
    MetaValue,
    parse_manifest,
    read_bounded,
)
from shoal.learner.checkpoint_layout import manifest_name, manifest_steps
from shoal.learner.errors import CheckpointError

BEST_KEY = "mean_return"
"""The manifest meta key the best checkpoint is chosen by."""


def rank(meta: Mapping[str, MetaValue], step: int) -> tuple[float, int] | None:
    """How good a checkpoint is: (its recent mean return, its step), None when it recorded
    no finite return (saved before any episode ended)."""
    value = meta.get(BEST_KEY)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value), step


def best_saved(directory: Path) -> tuple[float, int] | None:
    """(recent mean return, step) of the best checkpoint whose manifest is readable in
    `directory`, or None. Only manifests are read (a few KB each, no file is hashed), so rank
    0's writer calls this at every prune and `shoal train` to name it in the summary."""
    best: tuple[float, int] | None = None
    for step in manifest_steps(directory):
        try:
            manifest = parse_manifest(
                read_bounded(directory / manifest_name(step), MAX_MANIFEST_BYTES), step
            )
        except CheckpointError:
            continue  # not complete; `latest()` skips it with a warning too
        found = rank(manifest.meta, step)
        if found is not None and (best is None or found > best):
            best = found
    return best
